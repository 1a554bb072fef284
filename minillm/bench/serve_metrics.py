"""The arithmetic of `minillm bench serve`, as pure functions (chapter 12; lab 12 checks against them).

Definitions follow `vllm bench serve`. For one streamed request, sent at `start`, whose chunks that
carried text arrived at t_1 <= t_2 <= ... <= t_k, and that generated n tokens:

    TTFT  time to first token     t_1 - start
    E2E   end-to-end latency      t_k - start
    ITL   inter-token latencies   t_2 - t_1, ..., t_k - t_(k-1)   (a chunk may hold several tokens)
    TPOT  time per output token   (E2E - TTFT) / (n - 1), only when n > 1
                                  (summarize: only when k > 1 too; tpot_unmeasured counts the rest)

A chunk that carries no text (chat's first chunk with only the role, a usage chunk, `[DONE]`) is
not a token: counting the role chunk would make TTFT the time to the HTTP headers. n comes from the
server's `usage` (stream_options.include_usage), else from the number of text chunks.

Goodput (DistServe): requests that met every SLO (TTFT <= ttft_ms and TPOT <= tpot_ms; a one-token
request has TPOT 0, as in vLLM) per second of the benchmark.

Arrivals: request i is sent at the sum of i gaps drawn from Gamma(shape=burstiness,
scale=1/(rate*burstiness)): mean 1/rate; burstiness 1 is a Poisson process, below 1 burstier, above
1 more regular. rate = inf sends everything at once.
"""

from __future__ import annotations

import codecs
import math
import random
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One benchmark request as the client saw it; times are time.perf_counter() seconds."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int | None = None  # the server's usage.completion_tokens; None: it sent no usage
    prompt_tokens: int | None = None  # usage.prompt_tokens, else the workload's length
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)


def ttft(start: float, chunk_times: list[float]) -> float:
    if not chunk_times:
        raise ValueError("ttft: the request received no chunk with text")
    return chunk_times[0] - start


def e2e(start: float, chunk_times: list[float]) -> float:
    if not chunk_times:
        raise ValueError("e2e: the request received no chunk with text")
    return chunk_times[-1] - start


def itl(chunk_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def tpot(start: float, chunk_times: list[float], output_tokens: int) -> float | None:
    """(E2E - TTFT) / (output_tokens - 1); None for a request of fewer than two tokens."""
    if output_tokens < 2:
        return None
    return (e2e(start, chunk_times) - ttft(start, chunk_times)) / (output_tokens - 1)


def parse_slo(text: str | None) -> tuple[float, float] | None:
    """"ttft_ms,tpot_ms" -> (ttft_ms, tpot_ms); None stays None."""
    if text is None:
        return None
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"slo must be two positive numbers 'ttft_ms,tpot_ms' (e.g. 500,50), not {text!r}")
    return values


def meets_slo(ttft_s: float, tpot_s: float | None, slo: tuple[float, float]) -> bool:
    """Did a request meet both SLOs (in ms)? A request without a TPOT (one token) counts it as 0."""
    return ttft_s * 1e3 <= slo[0] and (tpot_s or 0.0) * 1e3 <= slo[1]


def goodput(results: list[RequestResult], slo: tuple[float, float], duration: float) -> float:
    """Requests per second that succeeded and met every SLO."""
    good = sum(meets_slo(ttft(r.start, r.chunk_times), tpot(r.start, r.chunk_times, r.num_output_tokens), slo)
               for r in results if r.success)
    return good / duration


def describe(values_s: list[float], name: str) -> dict[str, float]:
    """{mean_NAME_ms, median_NAME_ms, p90_NAME_ms, p99_NAME_ms} of values in seconds (NaN if none)."""
    if not values_s:
        return {f"{k}_{name}_ms": float("nan") for k in ("mean", "median", *(f"p{p}" for p in PERCENTILES))}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.percentile(ms, 50))}
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration: float, slo: tuple[float, float] | None = None) -> dict:
    """The benchmark's numbers: counts, throughputs, and TTFT/TPOT/ITL/E2E statistics in ms."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, not {duration}")
    ok = [r for r in results if r.success]
    ttfts = [ttft(r.start, r.chunk_times) for r in ok]
    # A whole answer of n > 1 tokens in one chunk (a loop that fell behind merges steps) gives TPOT 0 by
    # the formula: no time between tokens was seen, so it is left out of the TPOT statistics and counted.
    tpots = [t for r in ok if len(r.chunk_times) > 1 and (t := tpot(r.start, r.chunk_times, r.num_output_tokens))
             is not None]
    one_chunk = sum(len(r.chunk_times) == 1 and r.num_output_tokens > 1 for r in ok)
    itls = [g for r in ok for g in itl(r.chunk_times)]
    e2es = [e2e(r.start, r.chunk_times) for r in ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    out = dict(completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
               total_input_tokens=input_tokens, total_output_tokens=output_tokens,
               request_throughput=len(ok) / duration, output_throughput=output_tokens / duration,
               total_token_throughput=(input_tokens + output_tokens) / duration, tpot_unmeasured=one_chunk)
    if slo is not None:
        out["goodput"] = goodput(results, slo, duration)
    for values, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (e2es, "e2el")):
        out.update(describe(values, name))
    return out


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of num requests is sent, in seconds after the first; all 0 for rate = inf."""
    if not (rate > 0):
        raise ValueError(f"request_rate must be > 0 (inf: all at once), not {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0 (1: Poisson), not {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))  # mean 1/rate
    return times


class SSEParser:
    """Server-sent events, fed bytes as they arrive (in pieces cut anywhere): -> each event's data.

    The format (WHATWG HTML, "server-sent events"): UTF-8 lines ended by CRLF, LF or CR; `data:`
    lines (one optional space after the colon) of an event are joined with LF; a blank line ends the
    event; lines starting with ':' are comments; other fields (event, id, retry) do not carry data.
    An event with no data line is not dispatched.
    """

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        return self._lines(final=False)

    def close(self) -> list[str]:
        """The end of the stream: a last CR ends its line; an event without its blank line is dropped."""
        self._buffer += self._decoder.decode(b"", final=True)
        events = self._lines(final=True)
        self._buffer, self._data = "", []
        return events

    def _lines(self, final: bool) -> list[str]:
        events = []
        while True:
            cut = min((i for i in (self._buffer.find("\r"), self._buffer.find("\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            if self._buffer[cut] == "\r" and cut + 1 == len(self._buffer) and not final:
                break  # a CR at the end may be half of a CRLF: wait for the next byte
            line = self._buffer[:cut]
            skip = 2 if self._buffer.startswith("\r\n", cut) else 1
            self._buffer = self._buffer[cut + skip:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                self._data = []
                continue
            name, colon, value = line.partition(":")
            if name == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
            elif name == "" and colon:
                continue  # a comment
        return events


def parse_sse(chunks: list[bytes]) -> list[str]:
    """Every event's data in a whole stream given as byte pieces."""
    parser = SSEParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return events + parser.close()
