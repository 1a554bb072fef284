"""POST /v1/chat/completions: a conversation, rendered by the model's chat template, answered.

The template is applied with tokenize=True (Tokenizer.apply_chat_template): a message's content is
encoded as plain text, so a user who types "<|im_end|>" cannot close their turn or forge another
role's. Streamed, each choice first gets a chunk with delta {"role": "assistant", "content": ""},
then its text as it comes, the last chunk with its finish_reason; then the usage chunk (with
stream_options.include_usage) and `data: [DONE]`.

With `tools` and a tool_choice that asks for calls (tool_calls.py), the output follows the tools'
grammar and comes back as message.tool_calls, finish_reason "tool_calls"; streamed, as deltas of
tool_calls. The tools are rendered by the template too (where it has a place for them), so their text,
like a message's, may not spell a control token.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...outputs import Logprob
from ...tokenizer import TooManyTokens
from .hermes_tool_parser import HermesToolParser, parse_all
from .protocol import (
    AssistantMessage,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    DeltaMessage,
    ToolCall,
)
from .serving_engine import MESSAGE_CHARS, APIError, OpenAIServing, gather, new_id, tokenize, usage
from .stream_chunks import ChunkFrame
from .structured import structured_outputs_of
from .tool_calls import ToolCallParser, ToolPlan, finish_reason, tool_plan

# SamplingParams' names for what the chat schema calls otherwise (an error names the request's field)
_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        received = time.perf_counter()
        lora = self.check_model(request.model)
        plan = tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls,
                         self.engine.engine.structured.compiler.check, self._renders_tools)
        structured = structured_outputs_of(request.response_format, request.structured_outputs)
        if plan is not None and plan.params is not None:  # "auto" has no grammar of its own
            if structured[0] is not None:
                raise APIError(400, "tool calls have a grammar of their own: leave out response_format and "
                               "structured_outputs, or set tool_choice to \"none\"", param="tool_choice")
            structured = (plan.params, "tools")
        params = self.sampling_params(request, _RENAMES, structured)
        conversation = request.conversation()
        extra, chars = {}, 0
        if request.tools:  # the template renders them: they count as text to render, and must be safe text
            chars += self._check_no_control_text(request.tools, "tools")
            extra["tools"] = request.tools
        for i, m in enumerate(conversation):
            if "tool_calls" in m:
                chars += self._check_no_control_text(m["tool_calls"], f"messages[{i}].tool_calls")
        chars += sum(len(m["content"]) for m in conversation)
        max_len = self.engine.engine.max_model_len
        self.check_text_length("the conversation", chars, max_len, "the model's context", "messages")
        # the messages count too: 120,000 empty ones took the template 1.25 s (probe round 4, M3)
        try:
            ids = await tokenize(chars + MESSAGE_CHARS * len(conversation), self.tokenizer.apply_chat_template,
                                 conversation, add_generation_prompt=True, tokenize=True, max_tokens=max_len, **extra)
        except TooManyTokens:  # BPE stopped there: the rest could not make it fit
            raise APIError(400, f"the conversation is longer than {max_len} tokens, the model's context "
                           f"(max_model_len={max_len})", param="messages", code="context_length_exceeded") from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None
        marks = {"received": received, "tokenized": time.perf_counter()}
        request_id, created = new_id("chatcmpl")
        requests = self.check(request_id, [ids], params, "messages", structured[1], lora)
        if request.stream:
            return StreamingResponse(self._stream(request_id, created, requests, request.include_usage, marks, plan, lora),
                                     media_type="text/event-stream")
        deltas = await self.collect(requests, raw_request, (request_id, marks), lora)

        def build() -> ChatCompletionResponse:
            choices, generated = gather(deltas, requests, params.n)
            return ChatCompletionResponse(
                id=request_id, created=created, model=self.served_name(lora), usage=usage([len(ids)], generated),
                choices=[ChatCompletionResponseChoice(
                    index=i, message=(message := self._message("".join(c.text), plan)),
                    finish_reason=c.finish_reason if not message.tool_calls else finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason, logprobs=self._logprobs(c.token_ids, c.logprobs, params.logprobs))
                    for i, c in enumerate(choices)])

        return await self.respond(build, deltas, params.logprobs)  # a big one is built off the loop

    @staticmethod
    def _message(text: str, plan: ToolPlan | None) -> AssistantMessage:
        if plan is None:
            return AssistantMessage(content=text)
        if plan.mode == "auto":
            content, calls = parse_all(text)
            return AssistantMessage(content=content, tool_calls=[ToolCall(**{k: c[k] for k in ("id", "type", "function")})
                                                                 for c in calls])
        parser = ToolCallParser(plan)
        parser.feed(text)
        return AssistantMessage(content=None, tool_calls=[ToolCall(**c) for c in parser.tool_calls()])

    def _renders_tools(self) -> bool:
        """Does this model's chat template show tools to the model? (It renders them at all.)"""
        if getattr(self, "_template_tools", None) is None:
            probe = [{"type": "function", "function": {"name": "minillm_probe_tool", "parameters": {}}}]
            try:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe)
            except ValueError:  # no template, or one that fails with tools
                text = ""
            self._template_tools = "minillm_probe_tool" in text
        return self._template_tools

    def _check_no_control_text(self, value, field: str) -> int:
        """A 400 if any text in `value` spells a control token: the template renders it as trusted text.
        -> the length of its JSON text."""
        text = json.dumps(value, ensure_ascii=False)
        control = self.tokenizer._added_splitter(frozenset(self.tokenizer.special_tokens))
        if control is not None and (m := control.search(text)) is not None:
            raise APIError(400, f"{field} contains the control token {m.group()!r}; the chat template renders it as "
                           f"its own markup, so it could end a turn or forge one: remove it", param=field)
        return len(text)

    def _stream(self, request_id: str, created: int, requests, include_usage: bool,
                marks: dict, plan: ToolPlan | None = None, lora=None) -> AsyncIterator[str]:
        [(_, ids, params)] = requests
        name = self.served_name(lora)
        frame = ChunkFrame("chat.completion.chunk", request_id, created, name)
        # the role first, as OpenAI does
        roles = [frame.chat(i, "", None, None, role="assistant") for i in range(params.n)]
        auto = plan is not None and plan.mode == "auto"
        parsers = None if plan is None else [(HermesToolParser if auto else partial(ToolCallParser, plan))()
                                             for _ in range(params.n)]

        def chunk(_: int, out) -> str | None:
            if auto:
                return self._auto_chunk(request_id, created, parsers[out.index], out, params.logprobs, name)
            if parsers is not None:  # tool calls: their deltas, not the text
                calls = parsers[out.index].feed(out.text or "")
                reason = finish_reason(out.finish_reason)
                if not calls and reason is None and out.logprobs is None:
                    return None  # the text so far holds no new part of a call (a call's head is forming)
                return self._chunk(request_id, created, [ChatCompletionStreamChoice(
                    index=out.index, delta=DeltaMessage(tool_calls=calls or None),
                    logprobs=self._logprobs(out.token_ids, out.logprobs, params.logprobs),
                    finish_reason=reason, stop_reason=out.stop_reason)], model=name)
            if out.logprobs is None or params.logprobs is None:  # the hot path (stream_chunks.py)
                return frame.chat(out.index, out.text or None, out.finish_reason, out.stop_reason)
            return self._chunk(request_id, created, [ChatCompletionStreamChoice(
                index=out.index, delta=DeltaMessage(content=out.text or None),
                logprobs=self._logprobs(out.token_ids, out.logprobs, params.logprobs),
                finish_reason=out.finish_reason, stop_reason=out.stop_reason)], model=name)

        def last(generated: int) -> str | None:
            return self._chunk(request_id, created, [], usage([len(ids)], generated), name) if include_usage else None

        return self.sse_stream(requests, chunk, last, first=roles, timing=(request_id, marks), lora_request=lora)

    def _auto_chunk(self, request_id: str, created: int, parser: HermesToolParser, out, top,
                    model: str | None = None) -> str | None:
        """tool_choice "auto": the text as content, but calls (Hermes' blocks) as tool_calls deltas."""
        content, calls = parser.feed(out.text or "")
        reason = out.finish_reason
        if reason is not None:
            rest, _ = parser.finish()
            content += rest
            reason = finish_reason(reason) if parser.num_calls else reason
        if not content and not calls and reason is None and out.logprobs is None:
            return None  # held back: it may be the start of a call
        return self._chunk(request_id, created, [ChatCompletionStreamChoice(
            index=out.index, delta=DeltaMessage(content=content or None, tool_calls=calls or None),
            logprobs=self._logprobs(out.token_ids, out.logprobs, top), finish_reason=reason,
            stop_reason=out.stop_reason)], model=model)

    def _chunk(self, request_id: str, created: int, choices, usage_info=None, model: str | None = None) -> str:
        return ChatCompletionStreamResponse(id=request_id, created=created, model=model or self.model_name,
                                            choices=choices, usage=usage_info).model_dump_json()

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                  top: int | None) -> ChatCompletionLogProbs | None:
        """The chat schema: per token its text, logprob and UTF-8 bytes, and the `top` most likely."""
        if top is None or entries is None:
            return None
        vocab = self.tokenizer.vocab
        # an id past the tokenizer (an embedding padded beyond it) has no bytes, as its text is ""
        item = lambda t, e: dict(token=e.decoded_token, logprob=e.logprob,
                                 bytes=list(vocab[t]) if 0 <= t < len(vocab) else [])
        content = []
        for t, entry in zip(token_ids, entries):
            ranked = sorted((e.rank, tid) for tid, e in entry.items() if e.rank is not None and e.rank <= top)
            content.append(ChatLogProbsContent(**item(t, entry[t]),
                                               top_logprobs=[ChatLogProb(**item(tid, entry[tid])) for _, tid in ranked]))
        return ChatCompletionLogProbs(content=content)
