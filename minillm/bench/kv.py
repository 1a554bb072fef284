"""Benchmark: KV eviction (chapter 15), each policy against the full cache, in one process.

    minillm bench kv [--quick] [--model PATH] [--budgets 256 512] [--prompt-len 2048] [--max-tokens 128]
                     [--batch-sizes 1 16] [--repeats 3] [--passkey-trials 8] [--json PATH]

Per policy (full cache = kv_eviction "none"; "window" = StreamingLLM with no sinks, the sliding window a
full-attention model would get; StreamingLLM with kv_positions "original" and "cache"; H2O; SnapKV) and
budget, three tables:
  memory    KV blocks one sequence holds at its peak (the engine's block manager counts them: the prompt
            prefills in one step, before anything is evicted) and after its last decode step (its table's
            entries that still hold a block), what those weigh (KV bytes per token x block_size), and
            the ratio to the full cache's
  quality   the first `max_tokens` greedy tokens after a long prompt (a Wikipedia text: the corpus of
            chapter 08 when its file is here, else the built-in prompts repeated): agreement with the full
            cache's tokens (fraction equal, first divergence), and the full-cache model's mean NLL of
            the policy's own continuation (teacher-forced, everything before it in context) beside that
            of the full cache's continuation. NOT teacher-forced NLL of a fixed text under the policy:
            the engine returns no logits for prompt positions. Then passkey retrieval: a 5-digit key
            hidden at a depth of a filler text of prompt_len tokens, asked for at the end (greedy, 8
            tokens): the fraction found, full cache first (the model's own ceiling)
  speed     decode tok/s at each batch size (steps where every request decodes), a median over
            `repeats` alternating repeats (each repeat runs the policies in a rotated order), and the
            ratio to the full cache per repeat (median, min, max)

--quick (the default on a CPU): prompt 160 tokens, budget 64, 16 new tokens, batch 1 and 4, 2 passkeys.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import torch

from ..engine import EngineConfig, LLMEngine
from ..hw import default_device
from ..sampling import SamplingParams
from .serving_setup import free_engine, header, load_models
from .table import print_table

# label -> engine arguments beside kv_budget ("none": the full cache, every block kept)
POLICIES = {
    "full": dict(kv_eviction="none"),
    "window": dict(kv_eviction="streaming", sink_tokens=0),
    "streaming": dict(kv_eviction="streaming", kv_positions="original"),
    "streaming-cache": dict(kv_eviction="streaming", kv_positions="cache"),
    "h2o": dict(kv_eviction="h2o"),
    "snapkv": dict(kv_eviction="snapkv"),
}
PARTS = ("quality", "speed")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def spread(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def long_text() -> tuple[str, str]:
    """(text, where it comes from): the corpus' held-out articles, else the built-in prompts repeated."""
    try:
        from ..data import load_corpus

        return load_corpus(download=False).eval_text(), "corpus"
    except (FileNotFoundError, ImportError, OSError):
        text = (Path(__file__).with_name("prompts.txt")).read_text()
        return " ".join([text] * 64), "builtin prompts.txt (no corpus file here)"


def passkey_prompt(tok, num_tokens: int, depth: float, key: int) -> list[int]:
    """A filler text of about num_tokens tokens with `The pass key is KEY.` at `depth` (0..1) in it."""
    intro = tok.encode("There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n")
    question = tok.encode("\nWhat is the pass key? The pass key is")
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    unit = tok.encode(FILLER)
    n = max(1, (num_tokens - len(intro) - len(question) - len(needle)) // len(unit))
    at = round(depth * n)
    return intro + unit * at + needle + unit * (n - at) + question


def engine_for(models, tok, policy: str, budget: int, engine_args: dict) -> LLMEngine:
    args = {**engine_args, **POLICIES[policy]}
    if policy != "full":
        args["kv_budget"] = budget
    eos = sorted(set(models.config.eos_token_ids or [getattr(tok, "eos_token_id", None)]) - {None})
    return LLMEngine(models.model, tok, eos, EngineConfig(**args), progress=False)


def generate(engine, prompts: list[list[int]], max_tokens: int, trace: bool = False) -> dict:
    """Greedy outputs (ignore EOS) and the decode steps' times; trace: the kept-block map of the one
    sequence (batch 1) after every step, 1 = the table entry holds a block, 0 = evicted (block 0)."""
    from ..engine.kv_eviction import NULL_BLOCK

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    got, steps, kept = {}, [], []
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        s = engine.scheduler
        decode = not s.waiting and all(q.num_tokens - q.num_computed_tokens == 1 for q in s.running)
        running, tokens = len(s.running), engine.engine_stats.num_generation_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((decode and running == len(prompts), time.perf_counter() - t0,
                      engine.engine_stats.num_generation_tokens - tokens))
        got |= {o.request_id: list(o.outputs[0].token_ids) for o in outs if o.finished}
        if trace and bm.block_tables:
            kept.append([int(b != NULL_BLOCK) for b in next(iter(bm.block_tables.values()))])
    dec = [x for x in steps if x[0] and x[2]]
    return {"tokens": [got[str(i)] for i in range(len(prompts))], "kept": kept,
            "decode_tok_s": sum(x[2] for x in dec) / sum(x[1] for x in dec) if dec else float("nan")}


@torch.inference_mode()
def continuation_nll(model, prompt: list[int], cont: list[int]) -> float:
    """The full-cache model's mean -log p of `cont` after `prompt` (one teacher-forced forward)."""
    from ..layers.attention import AttentionMetadata

    device = next(model.parameters()).device
    ids = torch.tensor(prompt + cont, device=device)  # [T]
    hidden = model(ids, torch.arange(len(ids), device=device), AttentionMetadata.from_seq_lens([len(ids)], device))
    logits = model.compute_logits(hidden[len(prompt) - 1: -1])  # [len(cont), vocab]: row i predicts cont[i]
    return float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(cont, device=device)))


def agreement(got: list[int], want: list[int]) -> dict:
    n = min(len(got), len(want))
    first = next((i for i in range(n) if got[i] != want[i]), n)
    return {"agree_frac": sum(a == b for a, b in zip(got, want)) / max(1, n), "first_divergence": first}


def build_engines(models, tok, budgets, policies, engine_args) -> dict:
    """One engine per (policy, budget), built and (on a GPU) warmed once: every run below reuses them,
    so the timed repeats alternate between engines that are all warm. A policy the model refuses (a
    ValueError naming why) maps to that message."""
    engines = {}
    for budget in budgets:
        for policy in policies:
            key = (policy, None if policy == "full" else budget)
            if key in engines:
                continue
            try:
                engines[key] = engine_for(models, tok, policy, budget, engine_args)
            except ValueError as e:
                engines[key] = str(e)
                continue
            if models.device.type == "cuda":  # Triton's compiles and the CUDA graphs, outside the timed steps
                engines[key].warm_up(max_prompt_len=engine_args["max_num_batched_tokens"])
                engines[key].block_manager.stats.peak_used_blocks = 0  # the warm-up's blocks are not a sequence's
    return engines


def quality_rows(models, tok, engines, text_ids, max_tokens, passkey_trials, seed):
    from ..engine.kv_eviction import reserved_blocks

    bpt = models.kv_bytes_per_token()
    rng = random.Random(seed)
    keys = [(rng.randrange(10000, 100000), (i + 0.5) / passkey_trials) for i in range(passkey_trials)]
    plen = len(text_ids)
    rows, maps, full = [], {}, None
    for (policy, budget), engine in engines.items():  # "full" first: the others compare with it
        row = {"policy": policy, "budget": budget}
        if isinstance(engine, str):
            rows.append({**row, "skipped": engine})
            continue
        bs = engine.config.block_size
        res = generate(engine, [text_ids], max_tokens, trace=True)
        peak = engine.block_manager.peak_used  # (the first run on this engine: its own peak)
        cont = res["tokens"][0]
        found = 0
        if passkey_trials:
            for key, depth in keys:
                out = generate(engine, [passkey_prompt(tok, plen, depth, key)], 8)["tokens"][0]
                found += str(key) in tok.decode(out)
        held = sum(res["kept"][-1]) if res["kept"] else peak  # after the last decode step
        row |= {"peak_blocks": peak, "held_blocks": held, "kv_mib": held * bs * bpt / 2**20,
                "reserved_blocks": reserved_blocks(engine.config),  # kv_positions="cache": the sinks' copies
                "nll_own": continuation_nll(models.model, text_ids, cont),
                "passkey": found / passkey_trials if passkey_trials else None, "tokens": cont}
        if policy == "full":
            full = row
        row |= agreement(cont, full["tokens"])
        row["nll_full"] = full["nll_own"]
        row["mem_vs_full"] = held / full["held_blocks"]
        maps[f"{policy}@{budget}"] = res["kept"]
        rows.append(row)
    return rows, maps


def speed_rows(engines, text_ids, max_tokens, batch_sizes, repeats):
    n = len(text_ids)
    rows, ratios = [], {}
    runs = [k for k, e in engines.items() if not isinstance(e, str)]
    for bsz in batch_sizes:
        # different prompts (the text from other offsets): no prefix-cache hit between them
        prompts = [(text_ids[i * 7:] + text_ids[: i * 7])[:n] for i in range(bsz)]
        per: dict = {}
        for r in range(repeats):
            order = runs[r % len(runs):] + runs[: r % len(runs)]  # alternating: a rotated order each repeat
            for key in order:
                if r == 0:
                    generate(engines[key], prompts, 2)  # this batch's step shapes, untimed
                per.setdefault(key, []).append(generate(engines[key], prompts, max_tokens)["decode_tok_s"])
        base = per[("full", None)]
        for (policy, budget), vals in per.items():
            rows.append({"policy": policy, "budget": budget, "batch": bsz, "decode_tok_s": statistics.median(vals),
                         "spread": spread(vals)})
            ratios[f"{policy}@{budget}/full batch{bsz}"] = spread([v / f for v, f in zip(vals, base)])
    return rows, ratios


def run(model=None, *, tokenizer=None, quick=None, budgets=None, prompt_len=None, max_tokens=None, batch_sizes=None,
        repeats=3, passkey_trials=None, policies=tuple(POLICIES), parts=PARTS, device=None, seed=0, json_path=None,
        block_size=16, **engine_args) -> dict:
    """parts: which of "quality" (memory, agreement, NLL, passkey at batch 1) and "speed" to run."""
    from ..notebook import describe_device, git_commit
    from .structured import versions

    device = default_device() if device is None else torch.device(device)
    quick = device.type != "cuda" if quick is None else quick
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    bad = set(policies) - set(POLICIES)
    if not policies or bad or "full" not in policies:
        raise ValueError(f"policies must include 'full' and name some of {', '.join(POLICIES)}; got {list(policies)}")
    parts = tuple(parts)
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"parts must name some of {', '.join(PARTS)}; got {list(parts)}")
    budgets = list(budgets or ([64] if quick else [256, 512]))
    prompt_len = prompt_len or (160 if quick else 2048)
    max_tokens = max_tokens or (16 if quick else 128)
    batch_sizes = list(batch_sizes or ([1, 4] if quick else [1, 16]))
    passkey_trials = (2 if quick else 8) if passkey_trials is None else passkey_trials
    models = load_models(model, device)
    tok = tokenizer if tokenizer is not None else models.tokenizer
    engine_args = {"block_size": block_size, **engine_args}
    if "num_gpu_blocks" not in engine_args:  # the full cache at the largest batch, and room: not 90 % of a GPU
        per_seq = -(-(prompt_len + max_tokens + 16) // block_size)
        engine_args["num_gpu_blocks"] = per_seq * max(batch_sizes) + 64 + max(batch_sizes)  # + the sinks' copies
    engine_args.setdefault("max_num_seqs", max(batch_sizes))
    engine_args.setdefault("cuda_graph_max_batch", max(batch_sizes))  # capture only the batches timed here
    engine_args.setdefault("max_num_batched_tokens", max(2048, prompt_len))  # a prompt prefills in one step
    if hasattr(tok, "encode"):
        text, source = long_text()
        text_ids = tok.encode(text)[:prompt_len]
    else:  # dummy weights: random ids, no passkey
        g = random.Random(seed)
        text_ids, source = [g.randrange(models.config.vocab_size) for _ in range(prompt_len)], "random ids"
        passkey_trials = 0
    info = header(f"kv: {models.label}; budgets {budgets} tokens, prompt {len(text_ids)}, {max_tokens} new, "
                  f"batch sizes {batch_sizes}, {repeats} repeats{' (quick)' if quick else ''}")
    result = {**info, "versions": versions(), "device": describe_device(device), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d"), "quick": quick, "repeats": repeats, "model": models.label,
              "budgets": budgets, "prompt_len": len(text_ids), "max_tokens": max_tokens, "batch_sizes": batch_sizes,
              "block_size": block_size, "text": source, "passkey_trials": passkey_trials,
              "kv_bytes_per_token": models.kv_bytes_per_token(),
              "quality_metric": "full-cache NLL of each policy's own greedy continuation (not teacher-forced "
                                "NLL of a fixed text under the policy)"}
    engines = build_engines(models, tok, budgets, policies, engine_args)
    if "quality" in parts:
        quality, maps = quality_rows(models, tok, engines, text_ids, max_tokens, passkey_trials, seed)
        result["quality"], result["kept_maps"] = quality, maps
        print_table([{k: v for k, v in q.items() if k != "tokens"} for q in quality],
                    ["policy", "budget", "peak_blocks", "held_blocks", "kv_mib", "mem_vs_full", "agree_frac",
                     "first_divergence", "nll_own", "nll_full", "passkey"], title="memory and quality (batch 1)")
    if "speed" in parts:
        speed, ratios = speed_rows(engines, text_ids, max_tokens, batch_sizes, repeats)
        result["speed"], result["summary"] = speed, ratios
        print_table([{k: v for k, v in s.items() if k != "spread"} | {"min": s["spread"]["min"], "max": s["spread"]["max"]}
                     for s in speed], title="decode tok/s (median of repeats)")
        print_table([{"ratio": k, "median": v["median"], "min": v["min"], "max": v["max"]} for k, v in ratios.items()],
                    title="decode tok/s vs the full cache (per repeat)")
    for e in engines.values():
        if not isinstance(e, str):
            free_engine(e)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file, HF folder or hub id (default: embedded)")
    parser.add_argument("--quick", action="store_true", default=None, help="small settings (the default on a CPU)")
    parser.add_argument("--full", dest="quick", action="store_false", help="the GPU settings, also on a CPU")
    parser.add_argument("--budgets", type=int, nargs="+", default=None, help="kv_budget tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=None, help="tokens of long text (and of each passkey prompt)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per request")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passkey-trials", type=int, default=None)
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which tables to run")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
