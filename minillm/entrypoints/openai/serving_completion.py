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

Round 4 of the reliability probe added three bounds: prompts x n (`--max-seqs-per-request`: a 12 KB
body asked for 262,144 sequences); a text longer than the context (or than the request's token limit)
could ever tokenize to, refused by its length before it is tokenized; and tokenizing stops between
prompts once the request's token limit is passed or its client has left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ...outputs import Logprob
from ...tokenizer import EncodeStopped, TooManyTokens
from .cli_args import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_SEQS
from .protocol import (
    BadField,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from .serving_engine import (
    INLINE_TOKENIZE_CHARS,
    APIError,
    OpenAIServing,
    gather,
    new_id,
    usage,
    wait_for_disconnect,
)
from .stream_chunks import ChunkFrame
from .structured import structured_outputs_of

INLINE_CHECK_PROMPTS = 16  # more prompts than this are checked in a worker thread, off the event loop


def check_prompt_limits(num_prompts: int, num_tokens: int | None, max_prompts: int, max_tokens: int,
                        n: int = 1, max_seqs: int | None = None) -> None:
    """A 400 naming the limit when a request holds too many prompts, prompt tokens or sequences."""
    if num_prompts > max_prompts:
        raise APIError(400, f"the request holds {num_prompts} prompts; this server takes at most {max_prompts} per "
                       f"request (--max-prompts-per-request): send them in several requests", param="prompt",
                       code="too_many_prompts")
    if max_seqs is not None and num_prompts * n > max_seqs:
        raise APIError(400, f"the request asks for {num_prompts} prompts x n={n} = {num_prompts * n} sequences; this "
                       f"server runs at most {max_seqs} per request (--max-seqs-per-request): lower n or send fewer "
                       f"prompts", param="n", code="too_many_sequences")
    if num_tokens is not None and num_tokens > max_tokens:
        raise APIError(400, f"the request's prompts hold {num_tokens} tokens in all; this server takes at most "
                       f"{max_tokens} per request (--max-prompt-tokens-per-request)", param="prompt",
                       code="too_many_prompt_tokens")


class _Stopped(Exception):
    """Tokenizing was stopped: the client left."""


class OpenAIServingCompletion(OpenAIServing):
    def __init__(self, *args, max_prompts: int = DEFAULT_MAX_PROMPTS, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                 max_seqs: int = DEFAULT_MAX_SEQS, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_prompts, self.max_prompt_tokens, self.max_seqs = max_prompts, max_prompt_tokens, max_seqs

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        received = time.perf_counter()
        lora = self.check_model(request.model)
        structured = structured_outputs_of(request.response_format, request.structured_outputs)
        params = self.sampling_params(request, structured=structured)
        texts = request.prompts()
        # token ids are counted now; text after tokenizing (it has at least a token per 4 MiB / limit bytes)
        ids_only = sum(len(p) for p in texts if not isinstance(p, str))
        check_prompt_limits(len(texts), ids_only, self.max_prompts, self.max_prompt_tokens, params.n, self.max_seqs)
        self._check_text_lengths(texts)
        prompts = await self._tokenize(texts, raw_request)
        check_prompt_limits(len(prompts), sum(len(p) for p in prompts), self.max_prompts, self.max_prompt_tokens)
        marks = {"received": received, "tokenized": time.perf_counter()}
        request_id, created = new_id("cmpl")
        if len(prompts) > INLINE_CHECK_PROMPTS:  # each prompt's check costs: not on the loop everyone shares
            requests = await asyncio.to_thread(self.check, request_id, prompts, params, "prompt", structured[1], lora)
        else:
            requests = self.check(request_id, prompts, params, "prompt", structured[1], lora)
        if request.stream:
            return StreamingResponse(self._stream(request_id, created, requests, request.include_usage, marks, lora),
                                     media_type="text/event-stream")
        deltas = await self.collect(requests, raw_request, (request_id, marks), lora)

        def build() -> CompletionResponse:
            choices, generated = gather(deltas, requests, params.n)
            return CompletionResponse(
                id=request_id, created=created, model=self.served_name(lora),
                usage=usage([len(ids) for _, ids, _ in requests], generated),
                choices=[CompletionResponseChoice(
                    index=i, text="".join(c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=None if params.logprobs is None else logprobs(c.token_ids, c.logprobs, 0))
                    for i, c in enumerate(choices)])

        return await self.respond(build, deltas, params.logprobs)  # a big one is built off the loop

    def _check_text_lengths(self, texts: list[str | list[int]]) -> None:
        """Texts that could never fit, by their length alone: one longer than the context could hold,
        or all together longer than the request's token limit could."""
        max_len = self.engine.engine.max_model_len
        for i, p in enumerate(texts):
            if isinstance(p, str):
                name = "prompt" if len(texts) == 1 else f"prompt[{i}]"
                self.check_text_length(name, len(p), max_len, "the model's context", "prompt")
        chars = sum(len(p) for p in texts if isinstance(p, str))
        self.check_text_length("the request's text", chars, self.max_prompt_tokens,
                               "--max-prompt-tokens-per-request", "prompt", "too_many_prompt_tokens")

    async def _tokenize(self, texts: list[str | list[int]], raw_request: Request) -> list[list[int]]:
        """Short texts on the loop (a thread hop costs more); long ones in a worker thread that stops
        between prompts if the client leaves (a 499 then), so nobody's work outlives its client."""
        if sum(len(p) for p in texts if isinstance(p, str)) <= INLINE_TOKENIZE_CHARS:
            return self._token_ids(texts)
        stop = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self._token_ids, texts, stop))
        gone = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                stop.set()  # the thread ends after the prompt it is encoding
        if not work.done():
            raise APIError(499, "the client closed the connection before the answer was ready", code="client_closed")
        return work.result()

    def _token_ids(self, prompts: list[str | list[int]], stop: threading.Event | None = None) -> list[list[int]]:
        """Text is tokenized as LLM.generate does (Tokenizer.encode); token ids pass as they are. Stops
        early, with the 400, once the prompts hold more tokens than the request may."""
        for i, p in enumerate(prompts):
            if isinstance(p, list) and not p:
                raise BadField("prompt", f"prompt[{i}] is empty: a prompt needs at least one token")
        out, total = [], 0
        max_len = self.engine.engine.max_model_len
        for i, p in enumerate(prompts):
            if stop is not None and stop.is_set():
                raise _Stopped
            if not isinstance(p, str):
                out.append(p)
            else:
                name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                # BPE stops once the text is known to hold more tokens than either limit allows, after
                # work for about that many tokens ('a' * 400,000 took 4 s to count before the budget)
                budget = min(max_len, self.max_prompt_tokens - total)
                try:
                    out.append(self.tokenizer.encode(p, max_tokens=budget, should_stop=stop and stop.is_set))
                except TooManyTokens:
                    if budget < max_len:  # the request's limit was the nearer one
                        raise APIError(400, f"the request's prompts hold more than {self.max_prompt_tokens} tokens "
                                       f"in all; this server takes at most {self.max_prompt_tokens} per request "
                                       "(--max-prompt-tokens-per-request)", param="prompt",
                                       code="too_many_prompt_tokens") from None
                    raise APIError(400, f"{name} is longer than {max_len} tokens, the model's context "
                                   f"(max_model_len={max_len})", param="prompt",
                                   code="context_length_exceeded") from None
                except EncodeStopped:
                    raise _Stopped from None
                except (ValueError, TypeError) as e:  # a lone surrogate ("\ud800" in the JSON) is not text
                    raise BadField("prompt", f"{name} is not valid Unicode text: {e}") from None
            total += len(out[-1])
            if total > self.max_prompt_tokens:  # the rest cannot change the answer: a 400
                check_prompt_limits(len(prompts), total, self.max_prompts, self.max_prompt_tokens)
        return out

    def _stream(self, request_id: str, created: int, requests, include_usage: bool,
                marks: dict, lora=None) -> AsyncIterator[str]:
        n = requests[0][2].n
        offsets = [0] * (len(requests) * n)  # text_offset of each choice's next token
        name = self.served_name(lora)
        frame = ChunkFrame("text_completion", request_id, created, name)

        def chunk(i: int, out) -> str:
            index, lp = i * n + out.index, None
            if out.logprobs is None:  # the hot path: formatted directly (stream_chunks.py)
                return frame.completion(index, out.text, out.finish_reason, out.stop_reason)
            lp = logprobs(out.token_ids, out.logprobs, offsets[index])
            offsets[index] += sum(len(t) for t in lp.tokens)
            return self._chunk(request_id, created, [CompletionResponseChoice(
                index=index, text=out.text, logprobs=lp, finish_reason=out.finish_reason, stop_reason=out.stop_reason)],
                model=name)

        def last(generated: int) -> str | None:
            prompt_lens = [len(ids) for _, ids, _ in requests]
            return self._chunk(request_id, created, [], usage(prompt_lens, generated), name) if include_usage else None

        return self.sse_stream(requests, chunk, last, timing=(request_id, marks), lora_request=lora)

    def _chunk(self, request_id: str, created: int, choices, usage_info=None, model: str | None = None) -> str:
        return CompletionResponse(id=request_id, created=created, model=model or self.model_name, choices=choices,
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
