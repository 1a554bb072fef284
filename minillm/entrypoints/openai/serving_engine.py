"""What both endpoints share (vLLM's OpenAIServing): the model check, turning a request into checked
engine requests, errors in OpenAI's shape, SSE framing, and waiting for a result while watching for
the client to leave.

A request is checked whole before any of it is queued (LLMEngine.check_request for each prompt), so
a bad one is a 400 with nothing left behind in the engine. Errors carry OpenAI's body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing

from fastapi.responses import Response

from ...engine.async_llm_engine import AsyncLLMEngine
from ...inputs import check_length
from ...outputs import CompletionOutput, RequestOutput
from ...sampling import SamplingParams
from .protocol import BadField, ErrorInfo, ErrorResponse, UsageInfo
from .structured import request_field

logger = logging.getLogger("minillm.serve")


class APIError(Exception):
    """An error with its HTTP status and OpenAI's error fields; the server renders it."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        # backslashreplace: a message that quotes a lone surrogate must still encode as UTF-8 JSON
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return ErrorResponse(error=ErrorInfo(message=message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def sse(payload: str) -> str:
    """One server-sent event: `data: ...` and a blank line."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(error: APIError) -> str:
    """An error after the stream began (its status was sent already): an event the openai client raises."""
    return sse(json.dumps(error.body()))


INLINE_TOKENIZE_CHARS = 1024  # text up to this long is tokenized on the loop: a thread hop costs more
# What one chat message costs the template renderer, in characters the tokenizer would read in the
# same time: 120,000 empty messages took 1.25 s to render on the loop (probe round 4, M3).
MESSAGE_CHARS = 16


async def tokenize(chars: int, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) for `chars` characters of text: on the event loop when short (a hop to a
    worker thread and back costs more than BPE on a short text, and sits in every request's TTFT), in a
    worker thread when long (a long prompt would stall every stream while it is encoded)."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


# A non-streamed answer of more logprob entries than this (tokens x (1 + top_logprobs)) is built and
# serialized in a worker thread: n=128 x 64 tokens x top-20 logprobs (12.5 MB of JSON) held the event
# loop, and /health with it, for 6.5 s (probe round 4, m4). Smaller ones stay on the loop (a thread hop
# costs more than they do).
INLINE_RESPONSE_ENTRIES = 1024


KEEP_TIMINGS = 1024  # the most recent requests whose path in time GET /debug/timing/{id} can show


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, timings: OrderedDict | None = None,
                 lora_modules: dict | None = None):
        self.engine, self.model_name = engine, model_name
        # `model` name -> LoRARequest (chapter 16); shared by the endpoints, so a runtime load shows in all
        self.lora_modules = {} if lora_modules is None else lora_modules
        self.timings = OrderedDict() if timings is None else timings  # response id -> record()'s dict

    def record(self, request_id: str, marks: dict[str, float], final: RequestOutput | None) -> None:
        """Keep where the request's time went (its first prompt's), as time.perf_counter() stamps: the
        machine's monotonic clock, which a client on the same machine reads too (notebook 12 splits a
        request's latency with them). marks: the handler's own stamps (received, tokenized)."""
        stats = getattr(final, "metrics", None)
        if stats is None:
            return
        self.timings[request_id] = dict(
            marks, queued=stats.arrival_time, scheduled=stats.scheduled_time, first_token=stats.first_token_time,
            engine_done=stats.finished_time, sent=time.perf_counter(), prompt_tokens=stats.num_prompt_tokens,
            output_tokens=stats.output_lens[0], finish_reason=stats.finish_reason)
        while len(self.timings) > KEEP_TIMINGS:
            self.timings.popitem(last=False)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def check_model(self, model: str | None):
        """Is the engine serving, and is `model` its model or one of its adapters? (503 / 404 otherwise)
        -> the adapter's LoRARequest, or None for the base model."""
        self.engine.check_ready()
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"`{n}`" for n in (self.model_name, *self.lora_modules))
        # ascii(): a lone surrogate cannot be UTF-8 encoded
        raise APIError(404, f"The model {model!a} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def served_name(self, lora_request) -> str:
        """The `model` an answer names: the adapter's, when the request picked one (as vLLM answers)."""
        return self.model_name if lora_request is None else lora_request.lora_name

    async def respond(self, build: Callable, deltas: list[RequestOutput], top: int | None):
        """build() -> the pydantic answer of these deltas: returned as it is when it holds few logprob
        entries (FastAPI serializes it on the loop), else built and serialized to JSON in a worker
        thread, so that the loop only writes the bytes."""
        tokens = sum(len(out.token_ids) for d in deltas for out in d.outputs)
        if top is None or tokens * (1 + top) <= INLINE_RESPONSE_ENTRIES:
            return build()
        body = await asyncio.to_thread(lambda: build().model_dump_json().encode())
        return Response(body, media_type="application/json")

    def max_chars(self, tokens: int) -> int | None:
        """The most characters a text of `tokens` tokens can have (None: no such bound): no token covers
        more characters than it has bytes, so a longer text is refused before it is tokenized (a 4 MB
        prompt took 24 s to tokenize before it was refused, probe round 4, M4). A tokenizer that fuses
        runs of unknown characters into one token has no such bound."""
        if getattr(self, "_token_bytes", None) is None:
            tok = self.tokenizer
            fused = getattr(tok, "fuse_unk", False) and getattr(tok, "unk_token_id", None) is not None
            vocab = getattr(tok, "vocab", None)
            added = getattr(tok, "added_tokens", {}) or {}
            longest = max([len(b) for b in vocab or ()] + [len(t) for t in added] + [1])
            self._token_bytes = 0 if fused or not vocab else longest
        return None if not self._token_bytes else tokens * self._token_bytes

    def check_text_length(self, name: str, chars: int, tokens: int, why: str, param: str,
                          code: str = "context_length_exceeded") -> None:
        """A 400 when `chars` characters cannot fit in `tokens` tokens (max_chars), before tokenizing."""
        limit = self.max_chars(tokens)
        if limit is not None and chars > limit:
            raise APIError(400, f"{name} is {chars} characters long, more than {tokens} tokens ({why}) can hold: at "
                           f"most {limit} characters ({self._token_bytes} per token, this tokenizer's longest)",
                           param=param, code=code)

    def sampling_params(self, request, renames: dict[str, str] | None = None, structured=(None, None)) -> SamplingParams:
        """request -> SamplingParams; a value SamplingParams refuses is a 400 naming its field (under
        the request's name for it: renames maps SamplingParams' names to the endpoint's). structured:
        (StructuredOutputsParams, the request field it came from) or (None, None) (structured.py)."""
        so, field = structured
        try:
            return request.to_sampling_params(so)
        except BadField:
            raise
        except (ValueError, TypeError) as e:
            param = _param_of(str(e))
            renames = {**(renames or {}), **({"structured_outputs": field} if field else {})}
            raise APIError(400, str(e), param=renames.get(param, param)) from None

    def check(self, request_id: str, prompts: list[list[int]], params: SamplingParams, what: str,
              structured_field: str | None = None, lora_request=None) -> list[tuple[str, list[int], SamplingParams]]:
        """-> engine requests (id, ids, checked params), one per prompt; or a 400 for the first bad one.
        structured_field: the request field params.structured_outputs came from; a bad grammar's 400
        names it, with the compiler's reason and position. lora_request: the adapter the `model` field
        picked (check_model), for every prompt."""
        out = []
        for i, ids in enumerate(prompts):
            name = what if len(prompts) == 1 else f"{what}[{i}]"
            try:
                check_length(name, len(ids), params, self.engine.engine.max_model_len)
            except ValueError as e:
                raise APIError(400, str(e), param=what, code="context_length_exceeded") from None
            rid = f"{request_id}-{i}"
            try:
                _, ids, checked = self.engine.check(rid, {"prompt_token_ids": ids}, params, lora_request)
            except (ValueError, TypeError) as e:
                message = str(e).replace(f"request {rid!r}", name)
                param = "n" if " n=" in message else _param_of(message)
                if params.structured_outputs is not None:
                    message, field = request_field(message, params.structured_outputs, structured_field)
                    param = field or param
                raise APIError(400, message, param=param) from None
            if out:  # one stop list for all the prompts, not a copy each (the check copies the params)
                checked.stop = out[0][2].stop
            out.append((rid, ids, checked))
        return out

    async def collect(self, requests, raw_request, timing: tuple[str, dict] | None = None,
                      lora_request=None) -> list[RequestOutput]:
        """Run requests to the end and return every delta, in order. If the client disconnects first,
        abort them (no one would read the answer) and answer 499 (nginx's "client closed request").
        timing: (response id, the handler's marks) to record."""
        async def run():
            async with aclosing(self.engine.stream(requests, lora_request)) as deltas:
                return [d async for d in deltas]

        task = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler itself is cancelled
            gone.cancel()
            if not task.done():
                task.cancel()  # the stream's finally aborts what is left
        if task.cancelled() or not task.done():
            raise APIError(499, "the client closed the connection before the answer was ready", code="client_closed")
        deltas = task.result()
        if timing is not None:
            self.record(*timing, next((d for d in deltas if d.finished and d.request_id == requests[0][0]), None))
        return deltas

    def stream(self, requests, lora_request=None):
        """The requests' deltas as they come, in lists (AsyncLLMEngine.stream_batches; use under
        contextlib.aclosing: closing it aborts the rest)."""
        return self.engine.stream_batches(requests, lora_request)

    def sse_stream(self, requests, chunk: Callable[[int, CompletionOutput], str | None],
                   last: Callable[[int], str | None], first: Iterable[str] = (),
                   timing: tuple[str, dict] | None = None, lora_request=None) -> AsyncIterator[str]:
        """The SSE body of a streamed answer: the `first` chunks, then chunk(prompt index, output) for every
        output with something to show, then last(tokens generated) (the usage chunk, or None), then
        [DONE]. If the engine fails a request, an error event and [DONE] end the stream (the 200 is sent
        already), and the other prompts are aborted as the stream closes. timing: (response id, the
        handler's marks), recorded once [DONE] is sent.

        Each string yielded is one write to the socket: the events of every delta that has arrived
        (one step's when the loop keeps up, several when it fell behind). A write costs the loop far
        more than an event (ASGI middlewares, HTTP framing, the transport), so under load fewer
        writes is what keeps the loop from holding the GIL the engine thread needs.

        The requests are queued for the engine now, before the response's headers go out (the
        body is read only after the handler returns): its prefill runs while they are sent."""
        return self._sse(requests, self.stream(requests, lora_request), chunk, last, first, timing)

    async def _sse(self, requests, stream, chunk, last, first, timing) -> AsyncIterator[str]:
        where = {rid: i for i, (rid, _, _) in enumerate(requests)}
        generated, final = 0, None
        if opening := "".join(sse(payload) for payload in first):
            yield opening
        events = []
        try:
            async with aclosing(stream) as batches:
                async for batch in batches:
                    for delta in batch:
                        if (error := failed(delta)) is not None:
                            raise error
                        if delta.finished and where[delta.request_id] == 0:
                            final = delta
                        for out in delta.outputs:
                            generated += len(out.token_ids)
                            # nothing to show yet: a stop string may be forming, or half a character
                            if out.text or out.finish_reason is not None or out.logprobs:
                                if (payload := chunk(where[delta.request_id], out)) is not None:  # None: nothing new
                                    events.append(sse(payload))
                    if events:
                        yield "".join(events)
                        events = []
        except APIError as error:
            events.append(sse_error(error))  # after the events of the deltas before it
            yield "".join(events)
        except Exception as e:  # a bug while making a chunk: the client still gets an error event and [DONE]
            text = str(e).encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate logs as \\ud800
            logger.error("a stream failed: %s: %s", type(e).__name__, text, exc_info=logger.isEnabledFor(logging.DEBUG))
            events.append(sse_error(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
            yield "".join(events)
        else:
            if (payload := last(generated)) is not None:
                yield sse(payload)
        yield SSE_DONE
        if timing is not None:
            self.record(*timing, final)


async def wait_for_disconnect(raw_request) -> None:
    """Returns when the client has closed the connection (its body was read already)."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def new_id(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


class Gathered:
    """One completion put back together from its deltas (a non-streamed answer)."""

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


def gather(deltas: list[RequestOutput], requests, n: int) -> tuple[list[Gathered], int]:
    """-> each choice (index = prompt index * n + completion index) and the tokens generated; a 500 if
    the engine failed one of the requests."""
    where = {rid: i for i, (rid, _, _) in enumerate(requests)}
    choices = [Gathered() for _ in range(len(requests) * n)]
    for delta in deltas:
        if (error := failed(delta)) is not None:
            raise error
        for out in delta.outputs:
            c = choices[where[delta.request_id] * n + out.index]
            c.text.append(out.text)
            c.token_ids += out.token_ids
            c.logprobs += out.logprobs or []
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
    return choices, sum(len(c.token_ids) for c in choices)


def usage(prompt_lens: list[int], completion_tokens: int) -> UsageInfo:
    prompt = sum(prompt_lens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens,
                     total_tokens=prompt + completion_tokens)


def failed(delta: RequestOutput) -> APIError | None:
    """The engine ended this request with an error: a 500 for the client."""
    if delta.error is None:
        return None
    return APIError(500, f"the request failed in the engine: {delta.error}", type="server_error",
                    code="engine_error")


def _param_of(message: str) -> str | None:
    """The request field a SamplingParams error names ("top_p must be ..." -> "top_p")."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.isidentifier() and head.islower() else None
