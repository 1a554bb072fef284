"""What generate() returns, shaped like vLLM's RequestOutput so code moves between the two."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the model's most likely token at that step
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop" (EOS, stop string or stop token), "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: object | None = None  # the engine's RequestMetrics: arrival, first token, finish times
    error: str | None = None  # why the engine ended this request early (finish_reason "error")
    spec: object | None = None  # SpecDecodeMetrics of its sequences (chapter 09); None: no speculation
