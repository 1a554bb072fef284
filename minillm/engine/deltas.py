"""A request's deltas on the event loop's side (chapter 12): their text made of the token ids the
core sent (RequestDetokenizer), where the rows wait to be read (Inbox), and how every row a reader
finds becomes one RequestOutput per request (outputs_of).

The core sends rows, plain tuples (engine_core.py), one per request it changed, once per step. The
loop does not turn them into objects when they arrive: it drops each row into its request's Inbox,
a list append. The reader, when it wakes up, takes all the rows since its last look and builds one
RequestOutput per request from them in one pass: the texts joined once, the token ids extended.
When the loop keeps up that is one row per request; when it fell behind, several, and the cost of
a wake-up (one object, one SSE event per choice, one socket write) is shared by all their tokens:
under load the loop's cost per token falls instead of the backlog growing (vLLM's
RequestOutputCollector and its stream_interval, applied only when the reader is behind). Put back
together, a stream is the same either way.

The core makes text only for sequences with stop strings (it must match them as the text grows);
every other row arrives with text None and its token ids, and AsyncLLMEngine.deliver fills the text
in as the row arrives, before anyone reads it (vLLM V1's OutputProcessor and its per-request
IncrementalDetokenizer): the decoding runs in the API process, not in the one that drives the GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..outputs import CompletionOutput, RequestOutput
from ..tokenizer import IncrementalDetokenizer


class RequestDetokenizer:
    """The text of one request's completions, made of the token ids its rows carry: one
    IncrementalDetokenizer per completion, the one Sequence.text runs, with the request's own
    skip_special_tokens, so a completion's pieces join to the same string LLM.generate returns."""

    __slots__ = ("detoks", "skip_special_tokens", "tokenizer")

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.detoks: dict[int, IncrementalDetokenizer] = {}  # completion index -> its detokenizer, while it runs

    def fill(self, row: tuple) -> tuple:
        """The row with every completion's text None replaced by the text its new ids add; a completion
        that ends is flushed (an unfinished character at the end becomes U+FFFD, as in Sequence.text) and
        forgotten. Texts the core sent (stop strings, errors) pass as they are."""
        rid, finished, error, metrics, outs = row
        filled = []
        for o in outs:
            if o[1] is None:
                index, ids, end = o[0], o[2], o[5]
                detok = self.detoks.get(index)
                if detok is None:
                    detok = self.detoks[index] = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
                step = detok.step
                text = "".join([step(t) for t in ids])
                if end is not None:  # the completion's last row
                    text += detok.flush()
                    del self.detoks[index]
                o = (index, text, *o[2:])
            filled.append(o)
        return rid, finished, error, metrics, filled


class Inbox:
    """Rows delivered to some requests and not read yet: a list and at most one waiter. (An
    asyncio.Queue does the same with a future per get and a wake-up per put: per token, on the loop.)"""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: list = []
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list:
        """Everything delivered so far, waiting for the first if there is none."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def outputs_of(rows: list[tuple], prompt_ids: Callable[[str], list[int] | None]) -> list[RequestOutput]:
    """Rows in step order -> one RequestOutput per request, in order of first appearance: each
    completion's texts joined, token ids and logprobs in order, its finish and the request's end,
    error and metrics from its last row. prompt_ids(request id): the prompt, which rows do not carry."""
    if len(rows) == 1:  # a reader that keeps up: nothing to merge
        (rid, finished, error, metrics, outs), = rows
        return [RequestOutput(rid, None, prompt_ids(rid), [CompletionOutput(*o) for o in outs], finished=finished,
                              metrics=metrics, error=error)]
    merged: dict[str, list] = {}  # request id -> [finished, error, metrics, {index: [texts, ids, cum, lps, end, why]}]
    for rid, finished, error, metrics, outs in rows:
        m = merged.get(rid)
        if m is None:
            m = merged[rid] = [finished, error, metrics, {}]
        else:
            m[0], m[1], m[2] = finished, error or m[1], metrics or m[2]
        choices = m[3]
        for index, text, ids, cumulative, logprobs, finish, stop in outs:
            c = choices.get(index)
            if c is None:
                choices[index] = [[text], list(ids), cumulative, None if logprobs is None else list(logprobs), finish,
                                  stop]
                continue
            c[0].append(text)
            c[1] += ids
            if logprobs is not None:
                c[3] = list(logprobs) if c[3] is None else c[3] + logprobs
            c[2], c[4], c[5] = cumulative, finish, stop
    return [RequestOutput(rid, None, prompt_ids(rid),
                          [CompletionOutput(i, "".join(c[0]), c[1], c[2], c[3], c[4], c[5]) for i, c in choices.items()],
                          finished=finished, metrics=metrics, error=error)
            for rid, (finished, error, metrics, choices) in merged.items()]
