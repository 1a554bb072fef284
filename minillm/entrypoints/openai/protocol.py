"""The OpenAI API's requests and responses as pydantic models (vLLM's protocol.py, in small).

Requests are strict: a number where a string belongs, a float for an int, or "0.5" for a float is a
400, not a guess. Fields the OpenAI API has and minillm does not implement are refused when they
would change the answer (echo, suffix, best_of, logit_bias) and ignored when they would not (user,
metadata, ...). `response_format` and vLLM's `structured_outputs` constrain the output (structured.py);
`tools` with `tool_choice` make the answer tool calls (tool_calls.py), both on chapter 14's grammars. vLLM's extra sampling fields (top_k, min_p,
ignore_eos, repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens) are accepted too; the openai client sends them with `extra_body={...}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ...sampling import SamplingParams


class BadField(ValueError):
    """A request field minillm cannot honour: 400, naming the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """What both endpoints share: the sampling fields, mapped onto SamplingParams."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras, with vLLM's names
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # chapter 14: what the output must look like (structured.py turns them into StructuredOutputsParams)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # chapter 17: a disaggregated request's handle (vLLM's field; the router sets it)
    kv_transfer_params: dict[str, Any] | None = None

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise BadField("logit_bias", "logit_bias is not supported by minillm")
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "stream_options is only allowed when stream is true")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, structured_outputs=None) -> SamplingParams:
        """-> SamplingParams; its checks raise ValueError/TypeError naming the field."""
        self._refuse_unsupported()
        unset = lambda value, default: default if value is None else value
        return SamplingParams(
            n=self.n, temperature=unset(self.temperature, 1.0), top_p=unset(self.top_p, 1.0),
            top_k=unset(self.top_k, 0), min_p=unset(self.min_p, 0.0),
            repetition_penalty=unset(self.repetition_penalty, 1.0),
            presence_penalty=unset(self.presence_penalty, 0.0),
            frequency_penalty=unset(self.frequency_penalty, 0.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens, structured_outputs=structured_outputs,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top this many tokens at each step (0: the chosen token only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, structured_outputs=None) -> SamplingParams:
        if self.echo:
            raise BadField("echo", "echo is not supported by minillm")
        if self.suffix:
            raise BadField("suffix", "suffix is not supported by minillm")
        if self.best_of is not None and self.best_of != self.n:
            raise BadField("best_of", "best_of is not supported by minillm (leave it out, or equal to n)")
        return self._sampling_params(self.max_tokens, self.logprobs, structured_outputs)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text, or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadField("prompt", "prompt must not be empty")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self, i: int) -> str:
        """The content as plain text: a string, or text parts joined (other kinds are refused). Only an
        assistant turn may have no content (OpenAI's, when it made tool calls): "" then."""
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise BadField(f"messages[{i}].content", f"messages[{i}].content is null; a {self.role!r} message "
                           f"needs its content: a string or a list of text parts")
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise BadField(f"messages[{i}].content[{j}]",
                               f"content parts of type {part.type!r} are not supported (text only)")
            if part.text is None:
                raise BadField(f"messages[{i}].content[{j}].text",
                               f"messages[{i}].content[{j}] is a text part without its text: give "
                               f'{{"type": "text", "text": "..."}}')
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    def to_sampling_params(self, structured_outputs=None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     structured_outputs)

    def conversation(self) -> list[dict]:
        """The messages as the chat template wants them ("developer" is OpenAI's new "system"); an
        assistant turn's tool_calls and a tool turn's tool_call_id go with them, each call's arguments
        as an object (Hugging Face templates read them so; vLLM hands them over the same way)."""
        if not self.messages:
            raise BadField("messages", "messages must hold at least one message")
        out = []
        for i, m in enumerate(self.messages):
            turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.tool_calls:
                turn["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            out.append(turn)
        return out


def _template_call(call: dict, field: str) -> dict:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadField(f"{field}.function", f"{field}.function must be an object with a name and arguments")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise BadField(f"{field}.function.arguments", f"{field}.function.arguments is not valid JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


# ---- responses ------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer
    def _tool_calls_when_any(self) -> dict:  # a plain answer keeps its old shape: no "tool_calls": []
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # tool_calls.ToolCallParser's entries

    @model_serializer
    def _without_nones(self) -> dict:  # OpenAI's deltas leave out what did not change: {} at the end
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minillm"
    root: str | None = None  # vLLM's fields: an adapter's folder, and the base model it adapts
    parent: str | None = None
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body); lora_path is relative to --lora-root (or inside it)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
