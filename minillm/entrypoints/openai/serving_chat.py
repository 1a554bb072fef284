"""POST /v1/chat/completions: a conversation, rendered by the model's chat template, answered.

The template is applied with tokenize=True (Tokenizer.apply_chat_template): a message's content is
encoded as plain text, so a user who types "<|im_end|>" cannot close their turn or forge another
role's. Streamed, each choice first gets a chunk with delta {"role": "assistant", "content": ""},
then its text as it comes, the last chunk with its finish_reason; then the usage chunk (with
stream_options.include_usage) and `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...outputs import Logprob
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
)
from .serving_engine import MESSAGE_CHARS, APIError, OpenAIServing, gather, new_id, tokenize, usage
from .stream_chunks import ChunkFrame

# SamplingParams' names for what the chat schema calls otherwise (an error names the request's field)
_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        received = time.perf_counter()
        lora = self.check_model(request.model)
        params = self.sampling_params(request, _RENAMES)
        conversation = request.conversation()
        chars = sum(len(m["content"]) for m in conversation)
        self.check_text_length("the conversation", chars, self.engine.engine.max_model_len, "the model's context",
                               "messages")
        # the messages count too: 120,000 empty ones took the template 1.25 s (probe round 4, M3)
        try:
            ids = await tokenize(chars + MESSAGE_CHARS * len(conversation), self.tokenizer.apply_chat_template,
                                 conversation, add_generation_prompt=True, tokenize=True)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None
        marks = {"received": received, "tokenized": time.perf_counter()}
        request_id, created = new_id("chatcmpl")
        requests = self.check(request_id, [ids], params, "messages", lora)
        if request.stream:
            return StreamingResponse(self._stream(request_id, created, requests, request.include_usage, marks, lora),
                                     media_type="text/event-stream")
        choices, generated = gather(await self.collect(requests, raw_request, (request_id, marks), lora), requests,
                                    params.n)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.served_name(lora), usage=usage([len(ids)], generated),
            choices=[ChatCompletionResponseChoice(
                index=i, message=AssistantMessage(content="".join(c.text)), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=self._logprobs(c.token_ids, c.logprobs, params.logprobs))
                for i, c in enumerate(choices)])

    def _stream(self, request_id: str, created: int, requests, include_usage: bool,
                marks: dict, lora=None) -> AsyncIterator[str]:
        [(_, ids, params)] = requests
        name = self.served_name(lora)
        frame = ChunkFrame("chat.completion.chunk", request_id, created, name)
        # the role first, as OpenAI does
        roles = [frame.chat(i, "", None, None, role="assistant") for i in range(params.n)]

        def chunk(_: int, out) -> str:
            if out.logprobs is None or params.logprobs is None:  # the hot path (stream_chunks.py)
                return frame.chat(out.index, out.text or None, out.finish_reason, out.stop_reason)
            return self._chunk(request_id, created, [ChatCompletionStreamChoice(
                index=out.index, delta=DeltaMessage(content=out.text or None),
                logprobs=self._logprobs(out.token_ids, out.logprobs, params.logprobs),
                finish_reason=out.finish_reason, stop_reason=out.stop_reason)], model=name)

        def last(generated: int) -> str | None:
            return self._chunk(request_id, created, [], usage([len(ids)], generated), name) if include_usage else None

        return self.sse_stream(requests, chunk, last, first=roles, timing=(request_id, marks), lora_request=lora)

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
