"""A request's deltas on the event loop's side (chapter 12): where the core's rows wait to be read
(Inbox), and how every row a reader finds becomes one RequestOutput per request (outputs_of).

The core sends rows, plain tuples (engine_core.py), one per request it changed, once per step. The
loop does not turn them into objects when they arrive: it drops each row into its request's Inbox,
a list append. The reader, when it wakes up, takes all the rows since its last look and builds one
RequestOutput per request from them in one pass: the texts joined once, the token ids extended.
When the loop keeps up that is one row per request; when it fell behind, several, and the cost of
a wake-up (one object, one SSE event per choice, one socket write) is shared by all their tokens:
under load the loop's cost per token falls instead of the backlog growing (vLLM's
RequestOutputCollector and its stream_interval, applied only when the reader is behind). Put back
together, a stream is the same either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..outputs import CompletionOutput, RequestOutput


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
