"""The streamed chunks formatted directly (stream_chunks.py) equal protocol.py's models serialized by
pydantic, byte for byte, on random values: ids, texts with quotes, backslashes, control characters
and non-ASCII, finish and stop reasons of every type."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")

from minillm.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
)
from minillm.entrypoints.openai.stream_chunks import ChunkFrame

ALPHABET = [chr(c) for c in range(0, 0x80)] + list("éß中文🙂\u2028\u2029\ufeff\u00a0\u007f\u0085")


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))


def random_case(rng: random.Random) -> dict:
    return dict(index=rng.randint(0, 40), text=random_text(rng),
                finish_reason=rng.choice([None, "stop", "length", "abort", random_text(rng)]),
                stop_reason=rng.choice([None, rng.randint(0, 50000), random_text(rng)]))


@pytest.mark.parametrize("seed", range(4))
def test_completion_chunks_equal_pydantic(seed):
    rng = random.Random(seed)
    rid, created, model = f"cmpl-{random_text(rng)}", rng.randint(0, 2**33), random_text(rng) or "m"
    frame = ChunkFrame("text_completion", rid, created, model)
    for _ in range(200):
        c = random_case(rng)
        want = CompletionResponse(id=rid, created=created, model=model,
                                  choices=[CompletionResponseChoice(**c)]).model_dump_json()
        got = frame.completion(c["index"], c["text"], c["finish_reason"], c["stop_reason"])
        assert got == want
        assert json.loads(got)["choices"][0]["text"] == c["text"]


@pytest.mark.parametrize("seed", range(4))
def test_chat_chunks_equal_pydantic(seed):
    rng = random.Random(100 + seed)
    rid, created, model = f"chatcmpl-{random_text(rng)}", rng.randint(0, 2**33), random_text(rng) or "m"
    frame = ChunkFrame("chat.completion.chunk", rid, created, model)
    for _ in range(200):
        c = random_case(rng)
        content = rng.choice([None, "", c["text"]])
        role = rng.choice([None, "assistant"])
        want = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[ChatCompletionStreamChoice(
            index=c["index"], delta=DeltaMessage(role=role, content=content), finish_reason=c["finish_reason"],
            stop_reason=c["stop_reason"])]).model_dump_json()
        assert frame.chat(c["index"], content, c["finish_reason"], c["stop_reason"], role=role) == want
