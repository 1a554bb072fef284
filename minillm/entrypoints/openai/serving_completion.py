"""POST /v1/completions: a prompt (text or token ids, one or a list) continued.

Choice i * n + j is completion j of prompt i. Streamed, every chunk is a `text_completion` object
holding one choice's new text; the last chunk of a choice carries its finish_reason; with
stream_options.include_usage one more chunk, with no choices, carries the usage; then `data: [DONE]`.

A request may hold at most `max_prompts` prompts and `max_prompt_tokens` prompt tokens in all
(`minillm serve --max-prompts-per-request`, `--max-prompt-tokens-per-request`): past either it is a
400 naming the limit, refused before anything is tokenized or queued. Every prompt becomes an engine
request, and one client's 20,000 prompts would otherwise be 20,000 entries to check, queue, step past
and abort. A request of many prompts is checked in a worker thread, so the event loop keeps answering
everyone else (/health included) meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...outputs import Logprob
from .cli_args import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_PROMPTS
from .protocol import (
    BadField,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from .serving_engine import APIError, OpenAIServing, gather, new_id, tokenize, usage
from .stream_chunks import ChunkFrame

INLINE_CHECK_PROMPTS = 16  # more prompts than this are checked in a worker thread, off the event loop


def check_prompt_limits(num_prompts: int, num_tokens: int | None, max_prompts: int, max_tokens: int) -> None:
    """A 400 naming the limit when a request holds too many prompts or prompt tokens."""
    if num_prompts > max_prompts:
        raise APIError(400, f"the request holds {num_prompts} prompts; this server takes at most {max_prompts} per "
                       f"request (--max-prompts-per-request): send them in several requests", param="prompt",
                       code="too_many_prompts")
    if num_tokens is not None and num_tokens > max_tokens:
        raise APIError(400, f"the request's prompts hold {num_tokens} tokens in all; this server takes at most "
                       f"{max_tokens} per request (--max-prompt-tokens-per-request)", param="prompt",
                       code="too_many_prompt_tokens")


class OpenAIServingCompletion(OpenAIServing):
    def __init__(self, *args, max_prompts: int = DEFAULT_MAX_PROMPTS, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.max_prompts, self.max_prompt_tokens = max_prompts, max_prompt_tokens

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        received = time.perf_counter()
        self.check_model(request.model)
        params = self.sampling_params(request)
        texts = request.prompts()
        # token ids are counted now; text after tokenizing (it has at least a token per 4 MiB / limit bytes)
        ids_only = sum(len(p) for p in texts if not isinstance(p, str))
        check_prompt_limits(len(texts), ids_only, self.max_prompts, self.max_prompt_tokens)
        prompts = await tokenize(sum(len(p) for p in texts if isinstance(p, str)), self._token_ids, texts)
        check_prompt_limits(len(prompts), sum(len(p) for p in prompts), self.max_prompts, self.max_prompt_tokens)
        marks = {"received": received, "tokenized": time.perf_counter()}
        request_id, created = new_id("cmpl")
        if len(prompts) > INLINE_CHECK_PROMPTS:  # each prompt's check costs: not on the loop everyone shares
            requests = await asyncio.to_thread(self.check, request_id, prompts, params, "prompt")
        else:
            requests = self.check(request_id, prompts, params, "prompt")
        if request.stream:
            return StreamingResponse(self._stream(request_id, created, requests, request.include_usage, marks),
                                     media_type="text/event-stream")
        choices, generated = gather(await self.collect(requests, raw_request, (request_id, marks)), requests,
                                    params.n)
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name,
            usage=usage([len(ids) for _, ids, _ in requests], generated),
            choices=[CompletionResponseChoice(
                index=i, text="".join(c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=None if params.logprobs is None else logprobs(c.token_ids, c.logprobs, 0))
                for i, c in enumerate(choices)])

    def _token_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Text is tokenized as LLM.generate does (Tokenizer.encode); token ids pass as they are."""
        for i, p in enumerate(prompts):
            if isinstance(p, list) and not p:
                raise BadField("prompt", f"prompt[{i}] is empty: a prompt needs at least one token")
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                out.append(p)
                continue
            try:
                out.append(self.tokenizer.encode(p))
            except (ValueError, TypeError) as e:  # a lone surrogate ("\ud800" in the JSON) is not text
                name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise BadField("prompt", f"{name} is not valid Unicode text: {e}") from None
        return out

    def _stream(self, request_id: str, created: int, requests, include_usage: bool,
                marks: dict) -> AsyncIterator[str]:
        n = requests[0][2].n
        offsets = [0] * (len(requests) * n)  # text_offset of each choice's next token
        frame = ChunkFrame("text_completion", request_id, created, self.model_name)

        def chunk(i: int, out) -> str:
            index, lp = i * n + out.index, None
            if out.logprobs is None:  # the hot path: formatted directly (stream_chunks.py)
                return frame.completion(index, out.text, out.finish_reason, out.stop_reason)
            lp = logprobs(out.token_ids, out.logprobs, offsets[index])
            offsets[index] += sum(len(t) for t in lp.tokens)
            return self._chunk(request_id, created, [CompletionResponseChoice(
                index=index, text=out.text, logprobs=lp, finish_reason=out.finish_reason, stop_reason=out.stop_reason)])

        def last(generated: int) -> str | None:
            prompt_lens = [len(ids) for _, ids, _ in requests]
            return self._chunk(request_id, created, [], usage(prompt_lens, generated)) if include_usage else None

        return self.sse_stream(requests, chunk, last, timing=(request_id, marks))

    def _chunk(self, request_id: str, created: int, choices, usage_info=None) -> str:
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=usage_info).model_dump_json()


def logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> CompletionLogProbs:
    """The completions schema: each token's text, its logprob, the top ones (the chosen one among them,
    as vLLM does) and where it starts in the completion's text."""
    lp = CompletionLogProbs()
    for t, entry in zip(token_ids, entries):
        chosen = entry[t]
        lp.tokens.append(chosen.decoded_token)
        lp.token_logprobs.append(chosen.logprob)
        lp.top_logprobs.append({e.decoded_token: e.logprob for e in entry.values()})
        lp.text_offset.append(offset)
        offset += len(chosen.decoded_token)
    return lp
