"""The host's phases of a batch-256 decode step, on any machine (chapter 13): `profile_decode_step`
(what `minillm bench profile` runs) on a model whose forward pass is cheap, overlap scheduling on and
off, each repeated and summarised by medians; then (--cprofile) a cProfile of the same steps, the forward pass left out: what is left, per call.

    .venv/bin/python scripts/host_overhead_cpu.py                       # tiny dummy model, on the CPU
    .venv/bin/python scripts/host_overhead_cpu.py --model smollm2-135m-dummy --device cuda   # the GPU's case

On a CPU "launch" is the tiny model's eager forward pass; schedule, prepare, sample and other are the
engine's bookkeeping, the part this script is for. Numbers depend on the machine: compare a change
with its "before" on the same one (a checkout of the parent commit run with the same venv).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics

import torch

from minillm.bench.serving_setup import NoTextTokenizer
from minillm.bench.step_profile import profile_decode_step
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.loader import load_model

# A forward pass that costs little even on a CPU: 2 layers, hidden 64, vocab 512
TINY = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024, name="tiny-llama")
PHASES = ["schedule_ms", "prepare_ms", "launch_ms", "sample_ms", "other_ms", "instrumented_wall_ms", "wall_ms"]


def make_engine(model_name: str | None, device: str, batch: int, overlap: bool) -> LLMEngine:
    if model_name is None:
        model, _, _ = load_model(TINY, load_format="dummy", device=device)
    else:  # a preset with dummy weights, as `minillm bench` names them (e.g. smollm2-135m-dummy)
        from minillm.bench.serving_setup import load_models
        model = load_models(model_name, torch.device(device)).model
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch), async_scheduling=overlap,
                          num_gpu_blocks=batch * 8 + 16)
    return LLMEngine(model, NoTextTokenizer(), [], config, progress=False)


def cprofile_steps(engine: LLMEngine, batch: int, steps: int, prompt_len: int, top: int) -> str:
    """cProfile of the engine's steps during one profile_decode_step (prefill, warm-up and its passes,
    taken as LLM.generate takes them), sorted by own time. The executor's execute_model (the forward
    pass: on a CPU the reference attention dwarfs everything else) is left out: the host's bookkeeping
    is what this is for."""
    profiler = cProfile.Profile()
    step, execute = engine.step, engine.executor.execute_model

    def profiled_step(unfinished_outputs: bool = True):
        return profiler.runcall(step, unfinished_outputs=unfinished_outputs)

    def unprofiled_execute(*args, **kwargs):
        profiler.disable()
        try:
            return execute(*args, **kwargs)
        finally:
            profiler.enable()

    engine.step, engine.executor.execute_model = profiled_step, unprofiled_execute  # instance attributes
    try:
        profile_decode_step(engine, batch, steps=steps, prompt_len=prompt_len)
    finally:
        vars(engine).pop("step", None)  # (profile_decode_step's own timers may have removed the second)
        vars(engine.executor).pop("execute_model", None)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="PRESET-dummy as minillm bench names it (default: tiny)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: a tiny model's best)")
    ap.add_argument("--cprofile", default=None, metavar="PATH", help="write a cProfile of the steps here")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results, report = {}, []
    for overlap in (True, False):
        engine = make_engine(args.model, args.device, args.batch, overlap)
        runs = [profile_decode_step(engine, args.batch, steps=args.steps, prompt_len=args.prompt_len)
                for _ in range(args.repeats + 1)][1:]  # the first run warms up the allocator and the caches
        key = "on" if overlap else "off"
        results[key] = {k: statistics.median(r[k] for r in runs) for k in PHASES}
        if args.cprofile:
            report.append(f"==== overlap {key}: {args.steps} steps at batch {args.batch} ====\n"
                          + cprofile_steps(engine, args.batch, args.steps, args.prompt_len, 30))
        engine.shutdown()
    print(f"batch {args.batch}, prompt {args.prompt_len}, device {args.device}, model {args.model or 'tiny'}; "
          f"ms per step, medians of {args.repeats} runs of {args.steps}-step medians")
    print(f"{'overlap':8}" + "".join(f"{k[:-3]:>11}" for k in PHASES))
    for key, row in results.items():
        print(f"{key:8}" + "".join(f"{row[k]:11.3f}" for k in PHASES))
    if args.cprofile:
        with open(args.cprofile, "w") as f:
            f.write("\n".join(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
