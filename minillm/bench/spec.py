"""Benchmark: speculative decoding (chapter 09), each proposer against plain decoding, same engine.

    minillm bench spec [--model PATH] [--k 2 4] [--draft-layers 8] [--draft-model PATH] [--batch-sizes 1 8 64]
                       [--medusa PATH] [--eagle PATH] [--repeats 3]

Two prompt sets, through the chat template, greedy, EOS ignored (every request makes max_tokens):
  grounded  the answer quotes the input: summarize / repeat a Wikipedia passage (chapter 08's corpus,
            minillm.data, when its file is here; else a paragraph below), edit a given Python function
  open      open-ended questions: little to look up, the n-gram proposer should find little

For every batch size and configuration (no speculation, ngram k, layer_skip L' k, draft model k) one
engine serves the requests while every step is timed: tokens per second (whole run, and decode steps
only), the acceptance (rate, mean acceptance length tau), and the step costs: t_1, a decode step
without drafts; t_verify, the forward pass of a step with k + 1 tokens per sequence; t_draft, the
proposer's time per step; overhead, t_1 minus its forward pass (scheduling, sampling). From those:

    predicted speedup = n * t_1 / (t_verify + t_draft + overhead)      measured = decode tok/s ratio

with n the tokens a sequence gets per decode step (tau where every sequence drafts; less in a batch where
the proposer finds nothing for some).

Learned drafters (part two): --medusa / --eagle name folders `minillm train-drafter` wrote. --repeats R
runs every configuration R times, alternating (plain, ngram, ..., plain, ngram, ...: drift over the run
hits all of them alike); each row is then the median, with tok_s_spread the (max - min) / median of the
decode tok/s over the repeats.

CUDA graphs replay steps with drafts as token-bucket graphs, and the draft passes (layer_skip, draft
model) as graphs of their own where a captured shape fits. On a CPU the sizes shrink and the numbers only say that the code runs.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from ..engine import EngineConfig, LLMEngine
from ..hw import default_device
from ..sampling import SamplingParams
from .serving_setup import free_engine, header, load_models
from .table import print_table

PASSAGE = (
    "The lighthouse at the mouth of the river was first lit in 1791. Its keeper climbed one hundred and "
    "twelve steps every evening to trim the wick, and the light could be seen from nineteen miles at sea. "
    "In 1874 the oil lamp was replaced by a paraffin burner, and in 1921 by an electric lamp fed from the "
    "town's new power station. The keepers left in 1958, when the light was automated, and the tower is "
    "now a small museum that keeps the old lens, the keepers' logbooks and a model of the first lamp.")
FUNCTION = '''def mean_and_spread(values):
    total = 0
    for v in values:
        total += v
    mean = total / len(values)
    spread = 0
    for v in values:
        spread += (v - mean) ** 2
    return mean, (spread / len(values)) ** 0.5'''
OPEN = ["Write a short story about a fox who learns to swim.", "Explain how a refrigerator keeps food cold.",
        "Give me ten ideas for a rainy weekend.", "Why do leaves change colour in autumn?"]


def prompts(kind: str) -> list[str]:
    if kind == "open":
        return OPEN
    passages = [PASSAGE]
    try:
        from ..data import load_corpus

        passages = [a.text[:1200] for a in load_corpus(download=False).evaluation[:3]]
    except (FileNotFoundError, ImportError, OSError):
        pass  # no corpus file on this machine: the built-in paragraph
    return ([f"Summarize this passage, quoting its key sentences:\n\n{p}" for p in passages]
            + [f"Repeat this passage word for word:\n\n{p}" for p in passages[:1]]
            + [f"Rename the variable `total` to `acc` in this Python function and give the whole function:"
               f"\n\n```python\n{FUNCTION}\n```"])


def configs(k: list[int], draft_layers: list[int], draft_model, disable_by_batch_size=None, min_acceptance_rate=None,
            medusa=None, eagle=None, adaptive=False):
    """(label, speculative_config) per configuration, plain decoding first."""
    out = [("plain", None)]
    out += [(f"ngram k={n}", {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 3}) for n in k]
    out += [(f"layer_skip L'={L} k={n}", {"method": "layer_skip", "num_draft_layers": L, "num_speculative_tokens": n})
            for L in draft_layers for n in k]
    if draft_model:
        out += [(f"draft k={n}", {"model": draft_model, "num_speculative_tokens": n}) for n in k]
    for method, path in (("medusa", medusa), ("eagle", eagle)):  # learned drafters (train-drafter's folders)
        if path:
            out += [(f"{method} k={n}", {"method": method, "model": path, "num_speculative_tokens": n}) for n in k]
    if adaptive:  # k chosen per step from the batch and the measured acceptance (spec_decode/adaptive.py)
        out = [(f"{name} adaptive" if spec else name, spec and spec | {"adaptive": True}) for name, spec in out]
    if disable_by_batch_size is not None:  # the adaptive setting: no drafts in larger batches
        out = [(f"{name} off>{disable_by_batch_size}" if spec else name,
                spec and spec | {"disable_by_batch_size": disable_by_batch_size}) for name, spec in out]
    if min_acceptance_rate is not None:  # and per sequence: pause drafting where it is not accepted
        out = [(f"{name} backoff<{min_acceptance_rate}" if spec else name,
                spec and spec | {"min_acceptance_rate": min_acceptance_rate}) for name, spec in out]
    return out


def _timed(engine: LLMEngine, log: dict) -> None:
    """Wrap the engine's forward pass and proposer with timers (synchronised: the step waits anyway)."""
    sync = torch.cuda.synchronize if engine.sizes.device.type == "cuda" else (lambda: None)

    def wrap(obj, name, key):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            log[key] = log.get(key, 0.0) + time.perf_counter() - t0
            return out
        setattr(obj, name, timed)

    wrap(engine.runner, "execute", "execute")
    if engine.proposer is not None:
        wrap(engine.proposer, "propose", "propose")


def serve(engine: LLMEngine, ids: list[list[int]], max_tokens: int, tag: str) -> dict:
    """All requests at once; every step timed and classified (decode: no prompt token in it)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    log, steps = {}, []
    _timed(engine, log)
    spec0, t_start = engine.engine_stats.spec.snapshot(), time.perf_counter()
    while engine.has_unfinished_requests():
        decode = all(s.num_tokens - s.num_computed_tokens == 1 for s in engine.scheduler.running) \
            and not engine.scheduler.waiting and not engine.scheduler.swapped
        log.clear()
        running = len(engine.scheduler.running)
        tokens, t0 = engine.engine_stats.num_generation_tokens, time.perf_counter()
        engine.step(unfinished_outputs=False)
        steps.append((decode, time.perf_counter() - t0, log.get("execute", 0.0), log.get("propose", 0.0),
                      engine.engine_stats.num_generation_tokens - tokens, running))
    wall = time.perf_counter() - t_start
    del engine.runner.execute  # the timers were instance attributes over the class's methods
    if engine.proposer is not None:
        del engine.proposer.propose
    dec = [s for s in steps if s[0]] or steps
    spec = engine.engine_stats.spec.minus(spec0)
    return {"tok_s": sum(s[4] for s in steps) / wall, "decode_tok_s": sum(s[4] for s in dec) / sum(s[1] for s in dec),
            "t_step_ms": 1e3 * statistics.median(s[1] for s in dec),
            "t_exec_ms": 1e3 * statistics.median(s[2] for s in dec),
            "t_draft_ms": 1e3 * statistics.median(s[3] for s in dec), "steps": len(steps),
            "acceptance": spec.acceptance_rate, "tau": spec.mean_acceptance_length or 1.0,
            # tokens per sequence per decode step, drafts or not: tau counts only the steps with drafts
            "tokens_per_seq_step": sum(s[4] for s in dec) / max(1, sum(s[5] for s in dec))}


def run(model=None, *, k=(2, 4), draft_layers=(8,), draft_model=None, batch_sizes=None, max_tokens=None,
        disable_by_batch_size=None, min_acceptance_rate=None, medusa=None, eagle=None, adaptive=False, repeats=1,
        device=None, json_path=None, **engine_args) -> dict:
    device = default_device() if device is None else torch.device(device)
    gpu = device.type == "cuda"
    batch_sizes = list(batch_sizes or ([1, 8, 64] if gpu else [1, 2]))
    max_tokens = max_tokens or (128 if gpu else 8)
    models = load_models(model, device)
    tok = models.tokenizer
    info = header(f"spec: greedy, {max_tokens} new tokens (EOS ignored), batch sizes {batch_sizes}; {models.label}")
    ids = {kind: [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
                  if tok.chat_template else tok.encode(p) for p in prompts(kind)] for kind in ("grounded", "open")}
    eos = sorted(set(models.config.eos_token_ids or []))
    runs = []
    layers = [L for L in draft_layers if L < models.config.num_layers]
    for rep in range(repeats):  # alternating: every configuration once per round
        for name, spec in configs(list(k), layers, draft_model, disable_by_batch_size, min_acceptance_rate,
                                  medusa, eagle, adaptive):
            engine = LLMEngine(models.model, tok, eos, EngineConfig(speculative_config=spec, **engine_args),
                               progress=False)
            engine.warm_up(max_prompt_len=max(len(p) for v in ids.values() for p in v))
            for kind, batch in ((kd, b) for kd in ids for b in batch_sizes):
                reqs = [ids[kind][i % len(ids[kind])] for i in range(batch)]
                serve(engine, reqs[:1], 4, "warm")  # the step shapes of this batch size, untimed
                runs.append({"prompts": kind, "batch": batch, "config": name, "repeat": rep,
                             **serve(engine, reqs, max_tokens, f"{name}-{rep}")})
            free_engine(engine)
    rows = median_rows(runs)
    for r in rows:  # against plain decoding of the same prompts and batch size
        base = next(b for b in rows if b["config"] == "plain" and (b["prompts"], b["batch"]) == (r["prompts"], r["batch"]))
        overhead = base["t_step_ms"] - base["t_exec_ms"]
        r["predicted"] = (r["tokens_per_seq_step"] / base["tokens_per_seq_step"] * base["t_step_ms"]
                          / (r["t_exec_ms"] + r["t_draft_ms"] + overhead))
        r["measured"] = r["decode_tok_s"] / base["decode_tok_s"]
    print_table(rows, ["prompts", "batch", "config", "tok_s", "decode_tok_s", "tok_s_spread", "acceptance", "tau",
                       "tokens_per_seq_step", "t_step_ms", "t_exec_ms", "t_draft_ms", "predicted", "measured"],
                title=f"speculative decoding (median of {repeats})")
    result = {**info, "repeats": repeats, "rows": rows, "runs": runs}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (prompts, batch, config): the median of every number over the repeats, and the
    spread of decode tok/s ((max - min) / median; 0 for one repeat)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["prompts"], r["batch"], r["config"]), []).append(r)
    rows = []
    for (kind, batch, name), rs in groups.items():
        row = {"prompts": kind, "batch": batch, "config": name}
        for key in rs[0]:
            if key not in row and key != "repeat" and isinstance(rs[0][key], (int, float)):
                row[key] = statistics.median(r[key] for r in rs)
        tok = [r["decode_tok_s"] for r in rs]
        row["tok_s_spread"] = (max(tok) - min(tok)) / row["decode_tok_s"] if row["decode_tok_s"] else 0.0
        rows.append(row)
    return rows


def add_arguments(parser, name: str) -> None:
    from ..spec_decode.config import MAX_SPECULATIVE_TOKENS

    parser.add_argument("--model", default=None, help="a .gguf file, HF folder or hub id (default: embedded)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4],
                        choices=range(1, MAX_SPECULATIVE_TOKENS + 1), metavar="K", help="draft tokens per step")
    parser.add_argument("--draft-layers", type=int, nargs="*", default=[8], help="layer_skip: L' values (none: skip it)")
    parser.add_argument("--draft-model", default=None, help="a draft model sharing the tokenizer")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the adaptive setting: no drafts in steps with more running sequences")
    parser.add_argument("--min-acceptance-rate", type=float, default=None,
                        help="per sequence: pause drafting while its recent acceptance rate is lower")
    parser.add_argument("--medusa", default=None, help="Medusa heads: a folder minillm train-drafter wrote")
    parser.add_argument("--eagle", default=None, help="an EAGLE layer: a folder minillm train-drafter wrote")
    parser.add_argument("--adaptive", action="store_true",
                        help="every speculating configuration chooses k per step (batch size, measured acceptance)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all configurations (median, spread)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
