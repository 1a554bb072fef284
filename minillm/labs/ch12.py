"""Checks for lab 12: a serving benchmark's arithmetic, the stream it reads, the server's merged
deltas and the client's arrivals.

The references are the functions minillm itself uses: `minillm bench serve`'s (minillm/bench/
serve_metrics.py) for TTFT, TPOT, ITL and E2E of one request from its chunk timestamps, goodput under
two SLOs, and the server-sent-events parser; the server's deltas.outputs_of for merging the engine
core's rows (ch12_deltas.py); serve_metrics.arrival_times for the Poisson/Gamma arrival process
(ch12_arrivals.py, a statistical check). Each check draws fresh random requests, streams and rows.
"""

from __future__ import annotations

import math
import random

from ..bench import serve_metrics as sm
from .ch12_arrivals import check_arrival_times
from .ch12_deltas import check_merge_rows
from .checker import check
from .hints import Hints

__all__ = ["check_arrival_times", "check_goodput", "check_merge_rows", "check_parse_sse", "check_request_metrics",
           "hint"]


def _close(got, want) -> bool:
    """Equal, floats to 1e-9 (relative), through tuples and lists; None only equals None."""
    if want is None or isinstance(want, (str, bool)):
        return got == want
    if isinstance(want, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=1e-9,
                                                                                           abs_tol=1e-12)
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(_close, got, want))
    return got == want


def _request(rng: random.Random):
    """(start, chunk_times, output_tokens): chunks may hold several tokens; the usage may be missing."""
    start = rng.uniform(0, 1000)
    times, t = [], start + rng.expovariate(1 / 0.2)  # TTFT
    for _ in range(rng.choice([1, 1, 2, rng.randint(3, 30)])):
        times.append(t)
        t += rng.expovariate(1 / 0.02)
    tokens = rng.choice([None, len(times), len(times) + rng.randint(0, 3 * len(times))])
    return start, times, tokens


def reference_request_metrics(start, chunk_times, output_tokens):
    n = len(chunk_times) if output_tokens is None else output_tokens
    return (sm.ttft(start, chunk_times), sm.tpot(start, chunk_times, n), sm.itl(chunk_times),
            sm.e2e(start, chunk_times))


def check_request_metrics(fn, cases: int = 300):
    """fn(start, chunk_times, output_tokens) -> (ttft, tpot, itl, e2e) in seconds: tpot None below two
    tokens; itl a list; output_tokens None means the server sent no usage (count the chunks)."""
    return check("request_metrics", lambda *c: _tuple(fn(*c)), reference_request_metrics,
                 lambda rng: _request(rng), cases=cases, equal=_close)


def _tuple(out):
    return tuple(list(x) if isinstance(x, (list, tuple)) else x for x in out) if isinstance(out, (tuple, list)) \
        else out


def _goodput_case(rng: random.Random):
    requests = []
    for _ in range(rng.randint(1, 12)):
        start, times, tokens = _request(rng)
        ok = rng.random() < 0.85
        requests.append((start, times if ok else [], tokens if ok else None, ok))
    slo = (rng.choice([50.0, 150.0, 300.0, 1000.0]), rng.choice([5.0, 15.0, 25.0, 100.0]))
    return requests, slo, rng.uniform(1, 100)


def reference_goodput(requests, slo_ms, duration):
    results = [sm.RequestResult(start, list(times), tokens, success=ok) for start, times, tokens, ok in requests]
    return sm.goodput(results, tuple(slo_ms), duration)


def check_goodput(fn, cases: int = 300):
    """fn(requests, slo_ms, duration) -> good requests per second; requests are (start, chunk_times,
    output_tokens, success), slo_ms is (ttft_ms, tpot_ms)."""
    return check("goodput", fn, reference_goodput, _goodput_case, cases=cases, equal=_close)


_TEXT = "ab {}\":,é😀 [DONE]"


def _sse_case(rng: random.Random):
    """A stream of events (data of one or more lines, comments, other fields, the three line ends),
    maybe ending in an unfinished event, cut into random byte pieces (through UTF-8 characters too)."""
    lines = []
    for _ in range(rng.randint(1, 6)):
        block = []
        if rng.random() < 0.2:
            block.append(": keep-alive")
        if rng.random() < 0.2:
            block.append(rng.choice(["event: message", "id: 7", "retry: 1000"]))
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            value = "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 10)))
            block.append(rng.choice(["data: ", "data:", "data:  "]) + value if value or rng.random() < 0.7 else "data")
        lines.append(block)
    eol = rng.choice(["\n", "\r\n", "\r", None])  # None: a mix
    text = ""
    for block in lines:
        for line in [*block, ""]:
            text += line + (eol or rng.choice(["\n", "\r\n", "\r"]))
    if rng.random() < 0.2:
        text += "data: never finished"
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 8)))) if len(data) > 1 else []
    return ([data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])],)


def check_parse_sse(fn, cases: int = 300):
    """fn(chunks: list[bytes]) -> list[str]: every event's data, in order."""
    return check("parse_sse", fn, sm.parse_sse, _sse_case, cases=cases)


hint = Hints("12", {
    "request_metrics": (
        "TTFT is the first chunk's arrival minus the request's start; E2E the last chunk's.",
        'ITL: the gaps between consecutive chunks. TPOT spreads the time after the first token over the other n - 1 tokens, n from usage (output_tokens) or, without usage, the number of chunks; None when n < 2.',
        'n = len(chunk_times) if output_tokens is None else output_tokens\nttft = chunk_times[0] - start; e2e = chunk_times[-1] - start\nitl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]\ntpot = (e2e - ttft) / (n - 1) if n > 1 else None',
    ),
    "goodput": (
        'Goodput counts only successful requests that met both latency targets, per second of the run.',
        'Use request_metrics on each successful request; it is good when ttft (ms) <= slo_ms[0] and tpot (ms, 0 when None) <= slo_ms[1]. Divide the count by duration.',
        'for start, times, n, ok in requests:\n    if not ok: continue\n    ttft, tpot, _, _ = request_metrics(start, times, n)\n    good += ttft * 1e3 <= slo_ms[0] and (tpot or 0.0) * 1e3 <= slo_ms[1]\nreturn good / duration',
    ),
    "parse_sse": (
        'Chunks are cut anywhere, even inside a line: join the bytes first, then split into lines.',
        "Lines end with \\r\\n, \\r or \\n; the last piece has no end and is unfinished (drop it). A blank line ends an event; 'data:' lines (one optional space after the colon) add a line to the event's data; other fields are ignored; an event without data lines sends nothing.",
        "for line in re.split(r'\\r\\n|\\r|\\n', text)[:-1]:\n    if line == '':\n        if data: events.append('\\n'.join(data))\n        data = []\n    elif line == 'data' or line.startswith('data:'):\n        v = line[5:]; data.append(v[1:] if v.startswith(' ') else v)",
    ),
    "merge_rows": (
        "Walk the rows once, in order, keeping one entry per request id (a dict keeps the order in which ids first "
        "appear); inside it, one entry per completion index.",
        "What accumulates: the text pieces (join them once at the end) and the token ids, and the logprobs when a "
        "row has them. What the last row says wins: finished, and per completion the cumulative logprob, "
        "finish_reason and stop_reason. error and metrics: the last that is not None (only a request's last row has "
        "them).",
        "merged = {}\nfor rid, finished, error, metrics, outs in rows:\n    m = merged.setdefault(rid, [finished, error, "
        "metrics, {}])\n    m[0], m[1], m[2] = finished, error or m[1], metrics or m[2]\n    for i, text, ids, cum, lps, "
        "fin, stop in outs:\n        c = m[3].setdefault(i, [[], [], None, None, None, None])\n        c[0].append(text); "
        "c[1] += ids\n        if lps is not None: c[3] = (c[3] or []) + list(lps)\n        c[2], c[4], c[5] = cum, "
        "fin, stop\nreturn [(rid, f, e, mt, [(i, ''.join(t), ids, cum, lps, fin, stop) for i, (t, ids, cum, lps, fin, "
        "stop) in cs.items()]) for rid, (f, e, mt, cs) in merged.items()]",
    ),
    "arrival_times": (
        "A Poisson process of rate λ has independent exponential gaps of mean 1/λ; Gamma gaps of shape k and the same "
        "mean generalize it. The times are the running sum of the gaps, starting at 0.",
        "Gamma(shape k, scale θ) has mean kθ: for mean 1/λ take θ = 1/(kλ). random.Random(seed).gammavariate(k, θ) "
        "draws one gap (expovariate takes the rate λ, not the mean). Refuse a rate that is not > 0 (`not rate > 0` "
        "also catches NaN) and a burstiness outside (0, inf) with ValueError; rate inf: every time 0.0.",
        "if not rate > 0: raise ValueError(...)\nif not (burstiness > 0 and math.isfinite(burstiness)): raise "
        "ValueError(...)\nif math.isinf(rate): return [0.0] * num\nrng, t, times = random.Random(seed), 0.0, []\n"
        "for _ in range(num):\n    times.append(t)\n    t += rng.gammavariate(burstiness, 1 / (rate * burstiness))",
    ),
})
