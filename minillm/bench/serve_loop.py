"""What the server's event loop spends per streamed token, with nothing else running (chapter 12).

    python -m minillm.bench.serve_loop                 # 128 streams x 200 tokens, 1, 4 and 16 steps behind
    python -m minillm.bench.serve_loop --streams 256 --tokens 100 --behind 1 2 8

No model, no HTTP, no engine core: this process plays the core's part. It pickles each step's rows
(one per stream, one token each, the shape engine_core.py publishes), then on one event loop does
what the API process does when the core's pipe wakes it: unpickle, deliver the rows to the
streams, and let every stream's reader make its SSE events (OpenAIServing's streaming path with
the completions endpoint's chunk format), as Starlette would pull them. "k steps behind": the loop
wakes up once per k steps (it was busy), and finds k messages waiting. The figure is the loop's CPU
time per token. When the loop falls behind, a wake-up's fixed costs (one output, one event, one
write per stream) are shared by k tokens, so the cost per token should fall with k: that is what
keeps a loaded server from falling further behind.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import sys
import time
from types import SimpleNamespace

from ..engine import engine_core
from ..engine.async_llm_engine import AsyncLLMEngine
from ..entrypoints.openai.serving_engine import OpenAIServing
from ..entrypoints.openai.stream_chunks import ChunkFrame
from ..sampling import SamplingParams
from .table import print_table


class _NoCore:
    """Where the commands would go: nowhere (this benchmark plays the core)."""

    def send(self, cmd) -> None:
        pass

    def send_many(self, cmds) -> None:
        pass


def _front() -> AsyncLLMEngine:
    engine = AsyncLLMEngine(lambda: None)
    engine.core, engine.engine = _NoCore(), SimpleNamespace(max_model_len=1 << 20, tokenizer=None)  # rows bring text
    engine.ready_event.set()
    return engine


def _messages(rids: list[str], tokens: int, behind: int) -> list[bytes]:
    """One pickled ("out", rows, load) per step, grouped by the wake-up that reads them."""
    stats = engine_core.FinishedStats(0.0, 0.0, 0.0, 8, (tokens,), "length")
    steps = []
    for t in range(tokens):
        last = t == tokens - 1
        rows = [(rid, last, None, stats if last else None,
                 [(0, " word", [1000 + t], None, None, "length" if last else None, None)]) for rid in rids]
        steps.append(pickle.dumps(("out", rows, None), protocol=pickle.HIGHEST_PROTOCOL))
    return [steps[i : i + behind] for i in range(0, tokens, behind)]


async def _one(streams: int, tokens: int, behind: int) -> float:
    """-> the loop's CPU seconds for streams x tokens tokens, read `behind` steps per wake-up."""
    engine = _front()
    serving = OpenAIServing(engine, "m")
    wakeups = _messages([f"r{i}-0" for i in range(streams)], tokens, behind)
    # Before this chapter's second pass, rows became RequestOutputs as they arrived (engine_core.decode):
    # the same benchmark measures that code too, for the before/after.
    decode = getattr(engine_core, "decode", None)
    bodies = []
    for i in range(streams):
        frame = ChunkFrame("text_completion", f"r{i}", 0, "m")
        requests = [(f"r{i}-0", [1, 2, 3], SamplingParams(max_tokens=tokens))]
        bodies.append(serving.sse_stream(requests, lambda j, out, f=frame: f.completion(j, out.text, out.finish_reason,
                                                                                        out.stop_reason),
                                         lambda generated: None))

    async def drain(body) -> int:
        """The stream's tokens, counted in its SSE events' text."""
        return "".join([piece async for piece in body]).count(" word")

    readers = [asyncio.ensure_future(drain(b)) for b in bodies]
    await asyncio.sleep(0)  # every reader waits on its stream
    cpu = time.process_time()
    for wakeup in wakeups:
        rows = []
        for data in wakeup:
            rows += pickle.loads(data)[1]
        engine.deliver(decode(rows, lambda rid: [1, 2, 3]) if decode is not None else rows)
        await asyncio.sleep(0)  # the readers run: one output and one write each
    written = await asyncio.gather(*readers)
    cpu = time.process_time() - cpu
    assert written == [tokens] * streams, "a stream lost or doubled tokens"
    return cpu


def run(streams: int = 128, tokens: int = 200, behind: tuple[int, ...] = (1, 4, 16), repeat: int = 3) -> list[dict]:
    rows = []
    for k in behind:
        best = min(asyncio.run(_one(streams, tokens, k)) for _ in range(repeat))  # the least disturbed run
        rows.append({"steps behind": k, "streams": streams, "tokens": streams * tokens,
                     "loop CPU us/token": round(1e6 * best / (streams * tokens), 2)})
    print_table(rows, title=f"the API loop's CPU per streamed token (no HTTP; best of {repeat})")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--behind", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    run(args.streams, args.tokens, tuple(args.behind), args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
