"""A request's deltas on the event loop's side (chapter 12): where they wait to be read (Inbox), and
how several steps' worth for one request become one (coalesce).

A stream reads everything delivered since it last looked. When the loop keeps up that is one step's
delta per request; when it fell behind, several, and coalesce merges them, so the server writes one
SSE event per choice instead of one per token per step (vLLM's stream_interval, applied only when
the reader is behind). Put back together, a stream is the same either way.
"""

from __future__ import annotations

import asyncio

from ..outputs import CompletionOutput, RequestOutput


class Inbox:
    """Deltas delivered to some requests and not read yet: a list and at most one waiter. (An
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


def coalesce(batch: list[RequestOutput]) -> list[RequestOutput]:
    """Deltas in step order -> one per request, in order of first appearance: each completion's
    text, token ids and logprobs joined, its finish and the request's end taken from the last (vLLM's
    stream_interval, applied only when the reader is behind). Put back together, the stream is
    the same."""
    merged: dict[str, RequestOutput] = {}
    for d in batch:
        m = merged.get(d.request_id)
        merged[d.request_id] = d if m is None else _merge(m, d)
    return list(merged.values())


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    outs = {o.index: o for o in a.outputs}
    for o in b.outputs:
        p = outs.get(o.index)
        outs[o.index] = o if p is None else CompletionOutput(
            o.index, p.text + o.text, p.token_ids + o.token_ids, o.cumulative_logprob,
            p.logprobs + o.logprobs if p.logprobs is not None and o.logprobs is not None else o.logprobs or p.logprobs,
            o.finish_reason, o.stop_reason)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, list(outs.values()), finished=b.finished,
                         metrics=b.metrics or a.metrics, error=b.error or a.error)
