"""The streamed chunks of the common case as JSON text, without building pydantic models.

A streamed answer sends one chunk per token per request: at a few thousand tokens a second, building
CompletionResponse / ChatCompletionStreamResponse (three or four nested models each) and serializing
them is a real share of the event loop's time, and the loop shares the GIL with the engine thread.
A chunk without logprobs is a fixed frame around a handful of values, so it is formatted directly:

    {"id":"cmpl-..","object":"text_completion","created":1700000000,"model":"m","choices":[
     {"index":0,"text":" Paris","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}

byte for byte what protocol.py's models give with model_dump_json() (tests/test_serve_chunks.py
checks that on random values); chunks with logprobs, and the usage chunk, still go through them.
"""

from __future__ import annotations

import json

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # pydantic's JSON: compact, UTF-8


class ChunkFrame:
    """One response's chunk frame: its id, object type, creation time and model are fixed."""

    def __init__(self, object_type: str, response_id: str, created: int, model: str):
        self._head = (f'{{"id":{_encode(response_id)},"object":{_encode(object_type)},"created":{int(created)},'
                      f'"model":{_encode(model)},"choices":[')

    def completion(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        """A text_completion chunk with one choice and no logprobs."""
        return (f'{self._head}{{"index":{int(index)},"text":{_encode(text)},"logprobs":null,'
                f'"finish_reason":{_encode(finish_reason)},"stop_reason":{_encode(stop_reason)}}}],"usage":null}}')

    def chat(self, index: int, content: str | None, finish_reason: str | None, stop_reason: int | str | None,
             role: str | None = None) -> str:
        """A chat.completion.chunk with one choice and no logprobs; the delta leaves out what is None
        (DeltaMessage's serializer)."""
        delta = ",".join(f'"{k}":{_encode(v)}' for k, v in (("role", role), ("content", content)) if v is not None)
        return (f'{self._head}{{"index":{int(index)},"delta":{{{delta}}},"logprobs":null,'
                f'"finish_reason":{_encode(finish_reason)},"stop_reason":{_encode(stop_reason)}}}],"usage":null}}')
