"""`minillm train-drafter`: self-distil Medusa heads or an EAGLE layer for a model (chapter 09, part two).

    minillm train-drafter --method eagle [--model PATH] [--steps 600] [--samples 8] [--max-tokens 256]

1. the target answers the training prompts (minillm/bench/prompts.txt: 32 questions, none of them
   `bench spec`'s prompts, which measure the result) through its chat template: one greedy answer and
   `--samples` sampled ones (temperature 0.8) per prompt, with the engine;
2. spec_decode/train_drafter.py fits the drafter to the target's hidden states and distributions;
3. it is saved (config.json + model.safetensors) under --out, by default the user's cache
   (~/.cache/minillm/drafters/<model>-<method>), and loads with
   speculative_config={"method": METHOD, "model": OUT, "num_speculative_tokens": K}.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "bench" / "prompts.txt"


def generate_corpus(model, tok, eos, prompts: list[str], samples: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """prompt + answer token ids: one greedy answer and `samples` sampled ones per prompt."""
    from ..engine import EngineConfig, LLMEngine
    from ..sampling import SamplingParams

    engine = LLMEngine(model, tok, eos, EngineConfig(), progress=False)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True) if tok.chat_template
           else tok.encode(p) for p in prompts]
    for i, p in enumerate(ids):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, temperature=0))
        if samples:
            engine.add_request(f"s{i}", {"prompt_token_ids": p}, SamplingParams(
                max_tokens=max_tokens, temperature=0.8, n=samples, seed=seed + i))
    out = []
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                prompt = ids[int(r.request_id[1:])]
                out += [prompt + list(c.token_ids) for c in r.outputs]
    engine.executor.shutdown()
    return out


def run(method: str, model=None, *, steps: int = 600, samples: int = 8, max_tokens: int | None = None,
        num_heads: int = 4, lr: float | None = None, batch_size: int = 16, out=None, device=None,
        num_prompts: int | None = None, json_path=None) -> dict:
    import torch  # the command's parser is built without torch: the imports are here

    from ..bench.serving_setup import load_models
    from ..hw import default_device
    from ..spec_decode.drafter_files import default_drafter_dir, save_drafter
    from ..spec_decode.train_drafter import train

    device = default_device() if device is None else torch.device(device)
    models = load_models(model, device)
    max_tokens = max_tokens or (256 if device.type == "cuda" else 16)
    prompts = [p for p in PROMPTS_FILE.read_text().splitlines() if p.strip()][:num_prompts]
    eos = sorted(set(models.config.eos_token_ids or []))
    t0 = time.perf_counter()
    corpus = generate_corpus(models.model, models.tokenizer, eos, prompts, samples, max_tokens)
    t_gen = time.perf_counter() - t0
    drafter, losses = train(method, models.model, corpus, num_heads=num_heads, steps=steps,
                            lr=lr or (1e-3 if method == "medusa" else 3e-4), batch_size=batch_size, log=print)
    t_train = time.perf_counter() - t0 - t_gen
    folder = Path(out) if out else default_drafter_dir(method, model or "smollm2-135m-instruct")
    config = dict(drafter.config) | {"trained_on": {"sequences": len(corpus), "tokens": sum(map(len, corpus)),
                                                    "steps": steps, "first_loss": losses[0], "last_loss": losses[-1]}}
    save_drafter(folder, config, drafter)
    result = {"method": method, "out": str(folder), "sequences": len(corpus), "tokens": sum(map(len, corpus)),
              "t_generate_s": t_gen, "t_train_s": t_train, "losses": losses}
    print(f"train-drafter {method}: {len(corpus)} sequences, {result['tokens']} tokens; generated in {t_gen:.0f} s, "
          f"trained in {t_train:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {folder}")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def add_arguments(parser) -> None:
    parser.add_argument("--method", required=True, choices=["medusa", "eagle"])
    parser.add_argument("--model", default=None, help="a .gguf file, HF folder or hub id (default: embedded)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--samples", type=int, default=8, help="sampled answers per prompt (plus one greedy)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (256 on a GPU)")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N training prompts")
    parser.add_argument("--num-heads", type=int, default=4, help="medusa: heads (the most drafts a step)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--out", default=None, help="the folder to write (default: under ~/.cache/minillm/drafters)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", dest="json_path", default=None, help="write the run's numbers here")


def main(args) -> int:
    run(args.method, args.model, steps=args.steps, samples=args.samples, max_tokens=args.max_tokens,
        num_heads=args.num_heads, lr=args.lr, batch_size=args.batch_size, out=args.out, device=args.device,
        num_prompts=args.num_prompts, json_path=args.json_path)
    return 0
