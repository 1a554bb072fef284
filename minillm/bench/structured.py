"""Benchmark: structured output (chapter 14), our grammar backend against xgrammar, and its price in
the engine.

    minillm bench structured [--quick] [--model PATH] [--repeats 3] [--batch-sizes 1 64] [--json PATH]

Four tables, every figure a median over `repeats` alternating repeats with its spread (min-max):
  compile   per grammar of the parity set: ms to compile it cold (a fresh compiler) and cached (the
            same spec again: the LRU keyed by the spec's hash), ours and xgrammar's (one thread)
  mask      per grammar: us to fill one token bitmask, p50 and p99 along a random walk that fills
            both backends' masks at every step (which one goes first alternates between repeats) and
            checks they are the same set
  decode    the engine on the model: decode tok/s with every request free vs with the constrained
            ones (batch 1: the request; larger batches: half of them) asking for a JSON list of
            records; the host time the grammar costs per step (bitmask fill + accept), against the step.
            With overlap on (a GPU's default) the constrained steps overlap too: the mask is filled
            while the GPU runs the step's forward pass (scripts/gpu/structured_ablation.py splits
            the rest of the difference)
  validity  every output of the test set's schemas and regexes (and fresh random schemas) checked
            by jsonschema / re.fullmatch; how many steps jump-forward could have skipped (the grammar
            forced the token's bytes), measured on those outputs: jump-forward itself is not built

--quick (the default on a CPU): one grammar of each kind, short walks, batch 1 and 4, 8 new tokens.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

import torch

from ..engine import EngineConfig, LLMEngine
from ..hw import default_device
from ..sampling import SamplingParams
from ..structured_output import GrammarCompiler, StructuredOutputsParams, TokenVocab
from ..structured_output.peer import parity_walk, xgrammar_tokenizer_info
from . import structured_cases as cases_
from .serving_setup import free_engine, header, load_models
from .table import print_table


def _spread(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def _xgrammar():
    try:
        import xgrammar

        return xgrammar
    except ImportError:
        return None


def _xgr_compile(xgr, compiler, kind, spec, ws):
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    return compiler.compile_json_schema(json.dumps(spec), any_whitespace=ws is not None, max_whitespace_cnt=ws)


def _time_ours(vocab, params, ws):
    """-> (compiled, cold ms, cached ms): a fresh compiler, then the same spec again (a cache hit)."""
    c = GrammarCompiler(vocab, max_whitespace=ws, xgrammar_strings=True)
    t0 = time.perf_counter()
    compiled = c.compile(params)
    t1 = time.perf_counter()
    c.compile(params)  # a hit: hashing the spec and a dict lookup
    return compiled, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def _time_xgr(xgr, info, kind, spec, ws):
    """The same for xgrammar: one thread, its own cache on."""
    c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    t0 = time.perf_counter()
    compiled = _xgr_compile(xgr, c, kind, spec, ws)
    t1 = time.perf_counter()
    _xgr_compile(xgr, c, kind, spec, ws)
    return compiled, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


# xgrammar 0.2.9's own mask takes up to ~0.3 s a step on nested lists (tests/test_structured_output_xgrammar.py)
SHORT_WALKS = {"gbnf lists": 200}
PARTS = ("grammars", "decode", "validity")


def grammar_rows(vocab: TokenVocab, cases, repeats: int, walk_steps: int, seed: int) -> list[dict]:
    """The compile and mask tables: one row per grammar, each figure over `repeats` repeats."""
    xgr = _xgrammar()
    info = xgrammar_tokenizer_info(vocab) if xgr else None
    rows = []
    for name, kind, spec, ws in cases:
        params = StructuredOutputsParams(**{kind: spec})
        got = {k: [] for k in ("ours_cold_ms", "ours_cached_ms", "xgr_cold_ms", "xgr_cached_ms", "ours_p50_us",
                               "ours_p99_us", "xgr_p50_us", "xgr_p99_us")}
        equal, steps = True, 0
        for r in range(repeats):
            timed = {}
            for who in (("ours", "xgr") if r % 2 == 0 else ("xgr", "ours")) if xgr else ("ours",):  # alternating
                timed[who] = (_time_ours(vocab, params, ws) if who == "ours"
                              else _time_xgr(xgr, info, kind, spec, ws))
            got["ours_cold_ms"].append(timed["ours"][1])
            got["ours_cached_ms"].append(timed["ours"][2])
            if not xgr:
                continue
            got["xgr_cold_ms"].append(timed["xgr"][1])
            got["xgr_cached_ms"].append(timed["xgr"][2])
            w = parity_walk(timed["ours"][0], timed["xgr"][0], min(walk_steps, SHORT_WALKS.get(name, walk_steps)),
                            random.Random(seed + r),
                            theirs_first=r % 2 == 1)
            equal &= not w.mismatches
            steps += w.steps
            for who, key in (("ours", "ours_us"), ("xgr", "theirs_us")):
                got[f"{who}_p50_us"].append(w.p(key, 50))
                got[f"{who}_p99_us"].append(w.p(key, 99))
        row = {"grammar": name, "kind": kind, "masks_equal": equal if xgr else None, "walk_steps": steps}
        for k, v in got.items():
            row[k] = statistics.median(v) if v else None
        row["spread"] = {k: [min(v), max(v)] for k, v in got.items() if v}
        row["per_repeat"] = {k: v for k, v in got.items() if v}
        rows.append(row)
    return rows


class _GrammarClock:
    """Times the engine's grammar work on the host: filling the step's bitmask and accepting tokens."""

    def __init__(self, manager):
        self.manager, self.seconds = manager, 0.0
        for name in ("bitmask", "accept"):
            fn = getattr(manager, name)

            def timed(*a, _fn=fn, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0
            setattr(manager, name, timed)

    def close(self):
        del self.manager.bitmask, self.manager.accept  # the instance attributes over the methods


def _decode_run(engine: LLMEngine, prompt: list[int], batch: int, constrained: int, max_tokens: int, tag: str) -> dict:
    """`batch` requests at once, the first `constrained` of them asking for PEOPLE_SCHEMA; every step timed."""
    so = StructuredOutputsParams(json=cases_.PEOPLE_SCHEMA)
    for i in range(batch):
        sp = (SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so) if i < constrained
              else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, sp)
    clock, steps = _GrammarClock(engine.structured), []
    try:
        while engine.has_unfinished_requests():
            s = engine.scheduler
            decode = not s.waiting and all(q.num_tokens - q.num_computed_tokens == 1 for q in s.running)
            running, tokens, g0 = len(s.running), engine.engine_stats.num_generation_tokens, clock.seconds
            t0 = time.perf_counter()
            engine.step(unfinished_outputs=False)
            steps.append((decode, time.perf_counter() - t0, engine.engine_stats.num_generation_tokens - tokens,
                          running, clock.seconds - g0))
    finally:
        clock.close()
    dec = [x for x in steps if x[0] and x[2]] or steps
    full = [x for x in dec if x[3] == batch] or dec  # while no request has finished: the batch it was asked
    return {"decode_tok_s": sum(x[2] for x in dec) / sum(x[1] for x in dec),
            "full_batch_tok_s": sum(x[2] for x in full) / sum(x[1] for x in full), "full_batch_steps": len(full),
            "step_ms": 1e3 * statistics.median(x[1] for x in full),
            "grammar_ms": 1e3 * statistics.median(x[4] for x in full), "steps": len(steps)}


def decode_rows(engine, tok, batch_sizes, max_tokens: int, repeats: int) -> tuple[list[dict], dict]:
    prompt = cases_.chat_ids(tok, cases_.PEOPLE_PROMPT)
    rows, ratios = [], {}
    for b in batch_sizes:
        _decode_run(engine, prompt, b, 0, 2, "warm")  # this batch's step shapes, untimed
        constrained = 1 if b == 1 else b // 2
        per = {"free": [], "constrained": []}
        for r in range(repeats):  # alternating: neither mode always runs second on a warmer machine
            for mode in (("free", "constrained") if r % 2 == 0 else ("constrained", "free")):
                res = _decode_run(engine, prompt, b, constrained if mode == "constrained" else 0, max_tokens, f"{mode}{r}")
                per[mode].append(res)
                rows.append({"batch": b, "mode": mode, "constrained": constrained if mode == "constrained" else 0,
                             "repeat": r, **res})
        ratios[f"batch{b}"] = _spread([c["full_batch_tok_s"] / f["full_batch_tok_s"]
                                       for c, f in zip(per["constrained"], per["free"])])
    return rows, ratios


def apply_rows(vocab_size: int, batch_sizes, device: torch.device, repeats: int) -> list[dict]:
    """ms to apply a [B, ceil(V/32)] bitmask to [B, V] logits at the worker's mask point (plain PyTorch, as
    the worker runs it) and with the Triton kernel (kernels/token_bitmask.py; on a GPU only: the
    interpreter's time means nothing). Device time: synchronised around `repeats` x 10 applications."""
    from ..sampling.token_mask import apply_token_masks

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for b in batch_sizes:
        g = torch.Generator().manual_seed(b)
        logits = torch.randn(b, vocab_size, generator=g).to(device)
        mask = torch.randint(-(1 << 31), 1 << 31, (b, (vocab_size + 31) // 32), generator=g, dtype=torch.int64)
        mask = mask.to(torch.int32).to(device)

        def timed(fn, logits=logits, mask=mask):
            fn(logits, mask)  # warm-up (and Triton's compile)
            out = []
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn(logits, mask)
                sync()
                out.append((time.perf_counter() - t0) * 100)  # ms per application
            return statistics.median(out)

        row = {"batch": b, "torch_ms": timed(lambda x, m: apply_token_masks(x, bitmask=m)), "triton_ms": None}
        if device.type == "cuda":
            from ..kernels.token_bitmask import apply_token_bitmask_triton

            row["triton_ms"] = timed(lambda x, m: apply_token_bitmask_triton(x.clone(), m))
        rows.append(row)
    return rows


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("minillm", "triton", "transformers", "xgrammar", "jsonschema", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _grammar_part(vocab, quick, repeats, walk_steps, seed, summary) -> list[dict]:
    grammars = grammar_rows(vocab, cases_.timing_cases(quick), repeats, walk_steps, seed)
    print_table(grammars, ["grammar", "ours_cold_ms", "xgr_cold_ms", "ours_cached_ms", "xgr_cached_ms"],
                title="compile ms (median of repeats)")
    print_table(grammars, ["grammar", "ours_p50_us", "xgr_p50_us", "ours_p99_us", "xgr_p99_us", "masks_equal"],
                title="mask us per token along random walks (median of repeats)")
    def per_repeat(f):  # the median over grammars of f(grammar, repeat), one value per repeat
        return _spread([statistics.median(f(g, r) for g in grammars) for r in range(repeats)])

    pr = [g["per_repeat"] for g in grammars]
    summary["ours_mask_p50_us"] = per_repeat(lambda g, r: g["per_repeat"]["ours_p50_us"][r])
    summary["ours_compile_cold_ms"] = per_repeat(lambda g, r: g["per_repeat"]["ours_cold_ms"][r])
    if all("xgr_p50_us" in p for p in pr):  # ours / xgrammar per grammar and repeat; the median over grammars
        summary["mask_p50_ratio"] = per_repeat(lambda g, r: g["per_repeat"]["ours_p50_us"][r] / g["per_repeat"]["xgr_p50_us"][r])
        summary["compile_cold_ratio"] = per_repeat(
            lambda g, r: g["per_repeat"]["ours_cold_ms"][r] / g["per_repeat"]["xgr_cold_ms"][r])
        summary["all_masks_equal"] = all(g["masks_equal"] for g in grammars)
    else:
        summary["xgrammar"] = "not installed"
    return grammars


def run(model=None, *, tokenizer=None, quick=None, repeats=3, walk_steps=None, batch_sizes=None, max_tokens=None,
        validity_max_tokens=None, num_random_schemas=None, parts=PARTS, device=None, seed=0, json_path=None,
        **engine_args) -> dict:
    """parts: which of "grammars" (compile, mask, apply), "decode" and "validity" to run."""
    from ..notebook import describe_device, git_commit

    device = default_device() if device is None else torch.device(device)
    quick = device.type != "cuda" if quick is None else quick
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    parts = tuple(parts)
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"parts must name some of {', '.join(PARTS)}; got {parts}")
    walk_steps = walk_steps or (20 if quick else 1000)
    batch_sizes = list(batch_sizes or ([1, 4] if quick else [1, 64]))
    max_tokens = max_tokens or (8 if quick else 128)
    validity_max_tokens = validity_max_tokens or (24 if quick else 256)
    num_random = (2 if quick else 40) if num_random_schemas is None else num_random_schemas
    models = load_models(model, device)
    tok = tokenizer if tokenizer is not None else models.tokenizer
    if not hasattr(tok, "vocab"):
        raise ValueError("bench structured needs a model with a tokenizer (the grammar meets its vocabulary); "
                         "pass tokenizer= with dummy weights")
    info = header(f"structured: {models.label}; {repeats} repeats, walks of {walk_steps} steps, "
                  f"batch sizes {batch_sizes}, {max_tokens} new tokens{' (quick)' if quick else ''}")
    result = {**info, "versions": versions(), "device": describe_device(device), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%d"), "quick": quick, "repeats": repeats, "model": models.label,
              "backend": engine_args.get("structured_outputs_backend", "minillm")}

    summary = {}
    if "grammars" in parts:
        result["grammars"] = _grammar_part(TokenVocab.from_tokenizer(tok), quick, repeats, walk_steps, seed, summary)
        result["apply"] = apply_rows(models.config.vocab_size, batch_sizes, device, repeats)
        print_table(result["apply"], title="applying the bitmask to the logits, ms per step")
    if "decode" in parts or "validity" in parts:
        engine = LLMEngine(models.model, tok, sorted(set(models.config.eos_token_ids or [tok.eos_token_id])),
                           EngineConfig(**engine_args), progress=False)
        if device.type == "cuda":  # Triton's compiles and the CUDA graphs' captures, outside the timed steps
            engine.warm_up(max_prompt_len=256)
        if "decode" in parts:
            result["async_scheduling"] = engine.async_scheduling  # constrained requests overlap too (chapter 14)
            result["decode"], ratios = decode_rows(engine, tok, batch_sizes, max_tokens, repeats)
            print_table(result["decode"], ["batch", "mode", "constrained", "repeat", "full_batch_tok_s", "decode_tok_s",
                                           "step_ms", "grammar_ms", "full_batch_steps"], title="decode: constrained vs free")
            summary |= {f"constrained_vs_free_{k}": v for k, v in ratios.items()}
        if "validity" in parts:
            v = result["validity"] = cases_.validity_rows(engine, tok, cases_.validity_cases(quick, num_random, seed),
                                                          validity_max_tokens, seed)
            print_table([{k: x for k, x in v.items() if k != "invalid"}], title="validity")
            summary |= {"valid_pct_of_finished": v["valid_pct_of_finished"], "finished_pct": v["finished_pct"]}
        free_engine(engine)
    print_table([{"figure": k, "median": v["median"], "min": v["min"], "max": v["max"]}
                 for k, v in summary.items() if isinstance(v, dict)], title="headline (median, spread)")
    result["summary"] = summary
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file, HF folder or hub id (default: embedded)")
    parser.add_argument("--quick", action="store_true", default=None,
                        help="small settings (the default on a CPU): one grammar of each kind, batch 1 and 4")
    parser.add_argument("--full", dest="quick", action="store_false", help="the full set, also on a CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--walk-steps", type=int, default=None, help="random-walk steps per grammar and repeat")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per decode-speed request")
    parser.add_argument("--num-random-schemas", type=int, default=None, help="fresh random schemas in validity")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which tables to run")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--structured-outputs-backend", choices=["minillm", "xgrammar"], default="minillm",
                        help="whose matcher fills the engine's bitmask in the decode and validity parts")
