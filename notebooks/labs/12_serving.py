# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
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
# ## What you built
#
# These are the three functions under every online serving benchmark. `minillm bench serve` sends each
# request at a time drawn from a Poisson (or Gamma) process, reads its stream with an incremental
# parser (`SSEParser.feed`, which also waits when a piece ends in `\r`, since it may be half of a
# `\r\n`), timestamps each chunk with text, and then computes exactly what you wrote. Notebook 12
# uses it to sweep the request rate and find the knee where queueing makes TTFT explode.
