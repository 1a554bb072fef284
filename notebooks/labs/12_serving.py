# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 12 · Measuring a server from the client's side
#
# `minillm bench serve` (like `vllm bench serve`) knows nothing of the server's insides: it sends
# streamed requests and writes down when each piece of text arrives. Everything it reports comes from
# those timestamps. Here you write that arithmetic, and the parser of the stream it reads; the checks
# compare your functions with the ones in `minillm/bench/serve_metrics.py` on fresh random requests.

# %%
from minillm.labs import ch12


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch12.hint("request_metrics", 1)`, then 2, then 3. This lists the exercises:

# %%
ch12.hint()

# %% [markdown]
# ## Exercise 1 — `request_metrics`
#
# A request is sent at `start`; the chunks that carried text arrived at $t_1 \le t_2 \le \dots \le t_k$
# (`chunk_times`, seconds); the server's usage says it generated $n$ tokens (`output_tokens`; `None`
# when the server sent no usage: then count one token per chunk). Return `(ttft, tpot, itl, e2e)`:
#
# - TTFT $= t_1 - \text{start}$, the time to the first token;
# - E2E $= t_k - \text{start}$, the whole request;
# - ITL, the list of gaps $t_2 - t_1, \dots, t_k - t_{k-1}$ (a chunk may hold several tokens, so an
#   ITL is not always one token's time);
# - TPOT $= (\text{E2E} - \text{TTFT}) / (n - 1)$: the decode time shared among the tokens after the
#   first; `None` when $n < 2$.

# %%
def request_metrics(start, chunk_times, output_tokens):
    ### BEGIN SOLUTION
    n = len(chunk_times) if output_tokens is None else output_tokens
    ttft = chunk_times[0] - start
    e2e = chunk_times[-1] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    return ttft, tpot, itl, e2e
    ### END SOLUTION


# %% tags=["check"]
ch12.check_request_metrics(request_metrics)

# %% [markdown]
# ## Exercise 2 — `goodput`
#
# Throughput counts every finished request; goodput (DistServe, Zhong et al., 2024) counts only those
# a user would call good: the request succeeded **and** met both service-level objectives,
# TTFT $\le$ `slo_ms[0]` and TPOT $\le$ `slo_ms[1]` (milliseconds; a request without a TPOT, one token,
# counts it as 0). Each request is `(start, chunk_times, output_tokens, success)`; a failed one has no
# chunks. Return the good requests per second of `duration`.

# %%
def goodput(requests, slo_ms, duration):
    ### BEGIN SOLUTION
    good = 0
    for start, chunk_times, output_tokens, success in requests:
        if not success:
            continue
        ttft, tpot, _, _ = request_metrics(start, chunk_times, output_tokens)
        good += ttft * 1e3 <= slo_ms[0] and (tpot or 0.0) * 1e3 <= slo_ms[1]
    return good / duration
    ### END SOLUTION


# %% tags=["check"]
ch12.check_goodput(goodput)

# %% [markdown]
# ## Exercise 3 — `parse_sse`
#
# The tokens reach the client as server-sent events (the WHATWG HTML standard):
#
# ```
# data: {"choices": [{"text": " cat"}]}
#
# data: [DONE]
#
# ```
#
# The stream is UTF-8 text cut into lines by `\r\n`, `\n` or `\r` (all three are allowed, even mixed).
# A `data:` line adds its value (what follows the colon, less one space if there is one) to the
# current event; a line that is just `data` adds an empty value. A blank line ends the event: if it
# had data lines, their values joined with `\n` are its data. A line that starts with `:` is a
# comment (servers send them to keep a connection alive); other fields (`event:`, `id:`, `retry:`)
# carry no data. An event that the stream ends before its blank line is dropped.
#
# The bytes come in pieces cut anywhere, also in the middle of a line or of a UTF-8 character.
# Return every event's data, in order. (`minillm bench serve` parses incrementally, as the pieces
# arrive, so that each token is timed when it comes; here you get all the pieces at once.)

# %%
def parse_sse(chunks):
    ### BEGIN SOLUTION
    import re

    text = b"".join(chunks).decode("utf-8")
    events, data = [], []
    lines = re.split(r"\r\n|\r|\n", text)
    for line in lines[:-1]:  # the last piece has no line end: unfinished
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line == "data" or line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    return events
    ### END SOLUTION


# %% tags=["check"]
ch12.check_parse_sse(parse_sse)

# %% [markdown]
# ## Exercise 4 — `merge_rows`: one output per request, however far behind the reader is
#
# The server's side now. After every step the engine core publishes one **row** per request it
# changed (`minillm/engine/engine_core.py`), only what is new since the last one:
#
# ```
# (request_id, finished, error, metrics, [(index, text, token_ids, cumulative_logprob, logprobs,
#                                          finish_reason, stop_reason), ...])
# ```
#
# with one entry per completion (`n > 1` gives several) that has news. `text` may be `""` while
# `token_ids` is not (the detokenizer holds back what could be the start of a stop string) and the
# reverse (held-back text released); `logprobs` is a list of one dict per token, or `None` when the
# request asked for none; `finish_reason` is `None` until that completion ends. Only a request's last
# row has `finished=True`, and its `metrics` (and `error`, if a step failed).
#
# Each reader (one response stream) finds the rows of its requests in its inbox. When the event loop
# keeps up that is one step's rows; when it fell behind, several steps' worth, interleaved across its
# requests. `deltas.outputs_of` makes **one output per request** of all of them, so the server pays
# for one object, one SSE event and one socket write for $k$ steps' tokens. Write that merge, with
# merged rows as its output: one per request, in the order requests first appear, each shaped like
# a row, its completions in the order they first appear, with
#
# - the texts joined, the token ids and the logprobs (when there are any) concatenated in order;
# - `finished`, and per completion `cumulative_logprob`, `finish_reason` and `stop_reason`, from the
#   last row that has it; `error` and `metrics` the last that is not `None`.
#
# ```
# [("a", False, None, None, [(0, "Hel", [9], None, None, None, None)]),
#  ("b", False, None, None, [(0, "The", [4], None, None, None, None)]),
#  ("a", True, None, stats, [(0, "lo", [17, 2], None, None, "stop", None)])]
# -> [("a", True, None, stats, [(0, "Hello", [9, 17, 2], None, None, "stop", None)]),
#     ("b", False, None, None, [(0, "The", [4], None, None, None, None)])]
# ```
#
# The check simulates an engine: random requests (1–3 completions, logprobs or not, some aborted or
# failed), a few readers, steps that row a random subset of the running requests (some steps row
# nothing), readers that wake after a random number of steps; it hands you what one reader took at
# one wake-up and compares your rows with what `outputs_of` returns.

# %%
def merge_rows(rows):
    ### BEGIN SOLUTION
    merged = {}  # request id -> [finished, error, metrics, {index: [texts, ids, cumulative, logprobs, finish, stop]}]
    for rid, finished, error, metrics, outs in rows:
        m = merged.setdefault(rid, [finished, error, metrics, {}])
        m[0], m[1], m[2] = finished, error or m[1], metrics or m[2]
        for index, text, ids, cumulative, logprobs, finish, stop in outs:
            c = m[3].setdefault(index, [[], [], None, None, None, None])
            c[0].append(text)
            c[1].extend(ids)
            if logprobs is not None:
                c[3] = (c[3] or []) + list(logprobs)
            c[2], c[4], c[5] = cumulative, finish, stop
    return [(rid, finished, error, metrics,
             [(i, "".join(texts), ids, cum, lps, finish, stop) for i, (texts, ids, cum, lps, finish, stop) in
              choices.items()])
            for rid, (finished, error, metrics, choices) in merged.items()]
    ### END SOLUTION


# %% tags=["check"]
ch12.check_merge_rows(merge_rows)

# %% [markdown]
# ## Exercise 5 — `arrival_times`: an open-loop Poisson (or Gamma) process
#
# A benchmark client that waits for one answer before it sends the next (a *closed loop*) lets the
# server set the pace: a slow server gets fewer requests and looks fine. `minillm bench serve
# --request-rate λ` is *open-loop*: it decides every send time in advance, whatever the server does,
# as independent users would. Users arriving independently at rate $λ$ form a **Poisson process**:
# the gaps between arrivals are independent and exponential with mean $1/λ$. `--burstiness k`
# draws the gaps from a Gamma distribution of shape $k$ and scale $θ = 1/(kλ)$ instead: the same
# mean $kθ = 1/λ$, variance $kθ^2 = 1/(kλ^2)$, so $k = 1$ is Poisson, $k < 1$ comes in bursts and
# $k > 1$ is more regular.
#
# Write `arrival_times(num, rate, burstiness=1.0, seed=0)`: the send times of `num` requests, in
# seconds after the first (so the first is `0.0`, then the running sum of the gaps), drawn from a
# generator seeded with `seed` (the same seed, the same times). `rate = math.inf` sends everything at
# once (all `0.0`); a rate that is not $> 0$ or a burstiness outside $(0, ∞)$ is a `ValueError`.
#
# Random numbers cannot be compared one by one, so the check tests what the process must be, on
# 20,000 arrivals per $(λ, k)$ with a fixed seed, each test with a bound that a correct generator
# exceeds with probability about $10^{-6}$ whatever the seed:
#
# - **the rate**: the mean of $n$ gaps has standard deviation $1/(λ\sqrt{kn})$, so
#   $|\bar g λ - 1|\sqrt{kn} \le 5$;
# - **the gaps' distribution**, by a Kolmogorov–Smirnov test against the Gamma CDF: the empirical CDF
#   of $n$ draws is farther than $ε$ from the true one with probability at most $2e^{-2nε^2}$
#   (the Dvoretzky–Kiefer–Wolfowitz inequality), which sets $ε$;
# - **independence**: consecutive gaps uncorrelated, lag-1 correlation within $5/\sqrt n$;
# - **minillm's generator**: your gaps' CDF within $2ε$ of those of `serve_metrics.arrival_times`.

# %%
import itertools
import math
import random


def arrival_times(num, rate, burstiness=1.0, seed=0):
    ### BEGIN SOLUTION
    if not rate > 0:  # (NaN fails every comparison: `rate <= 0` would let it through)
        raise ValueError(f"arrival_times: rate must be > 0 requests/s (inf: all at once), got {rate}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"arrival_times: burstiness (the gaps' Gamma shape) must be in (0, inf), got {burstiness}")
    if num == 0 or math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # Gamma(k, θ) has mean kθ = 1/rate
    gaps = [rng.gammavariate(burstiness, scale) for _ in range(num - 1)]
    return [0.0, *itertools.accumulate(gaps)]
    ### END SOLUTION


# %% tags=["check"]
ch12.check_arrival_times(arrival_times)

# %% [markdown]
# ## What you built
#
# These are the functions under every online serving benchmark and the server it measures.
# `minillm bench serve` sends each request at a time from an arrival process like yours, reads its stream with
# an incremental parser (`SSEParser.feed`, which also waits when a piece ends in `\r`, since it may be
# half of a `\r\n`), timestamps each chunk with text, and then computes exactly what you wrote; on the
# other side, the server merges each reader's rows as you did, so a loop under load pays less per token
# instead of falling further behind. Notebook 12 uses the client to sweep the request rate and find the
# knee where queueing makes TTFT explode.
