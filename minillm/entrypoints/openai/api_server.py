"""`minillm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, as vLLM and SGLang).

    minillm serve --model Qwen/Qwen3-0.6B --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

    GET  /                      the chat page (static/: HTML, JS and CSS, no CDN)
    GET  /health                503 while the model loads and warms up (and once shutdown began), then 200
    GET  /metrics               Prometheus text (metrics.py)
    GET  /debug/timing/{id}     where one recent request's time went (serving_engine.record; notebook 12)
    GET  /v1/models             the model served, and its LoRA adapters (--lora-modules; chapter 16)
    POST /v1/load_lora_adapter  serving_lora.py: with --lora-root only (and /v1/unload_lora_adapter)
    POST /v1/completions        serving_completion.py
    POST /v1/chat/completions   serving_chat.py

The port opens at once; the engine core builds the model and warms it up meanwhile (until then
/health and every /v1 call answer 503). The core runs in a child process (--engine-core process, the
default: vLLM V1's EngineCore) or in a thread of this one (--engine-core thread); see
engine/core_client.py. Every error has OpenAI's body, {"error": {"message", "type",
"param", "code"}}: 400 for a bad request (malformed JSON, a wrong type, a bad value, a prompt longer
than the context; FastAPI's 422 becomes 400, as SGLang does), 401 for a missing or wrong API key,
404 for an unknown model or path, 413 for a body over --max-request-bytes, 503 while not serving.

Shutdown (SIGTERM, Ctrl-C): the listening socket closes, new requests on open connections get 503,
requests in flight get --shutdown-grace seconds to finish and are then aborted (their streams end
with finish_reason "abort" and `data: [DONE]`); then the engine core stops and frees its memory.
uvicorn then re-raises the signal, as a server killed by it would end. A model that fails to load
(or an engine flag that is wrong) ends the server with exit 2 and one line on stderr; an engine core that
fails for good (or whose process dies), with exit 1 (a supervisor restarts it); its streams end with an
error event first.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import logging
import os
import sys
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.async_llm_engine import AsyncLLMEngine, EngineNotReady
from .cli_args import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_SEQS
from .http_limits import http_protocol
from .metrics import ServerMetrics
from .protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_engine import KEEP_TIMINGS, APIError
from .serving_lora import OpenAIServingLoRA

logger = logging.getLogger("minillm.serve")

STATIC = Path(__file__).with_name("static")
# the page runs only its own files and talks only to this server
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'",
                "X-Content-Type-Options": "nosniff"}


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = 4 * 2**20, max_prompts: int = DEFAULT_MAX_PROMPTS,
              max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, max_seqs: int = DEFAULT_MAX_SEQS,
              lora_requests=(), lora_root: str | None = None) -> FastAPI:
    metrics = ServerMetrics(engine)
    engine.on_finished = metrics.request_finished

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(on_dead=lambda: app.state.on_dead())
        ready = asyncio.get_running_loop().create_task(_log_when_ready(engine, model_name))
        yield
        ready.cancel()
        await engine.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.on_dead = lambda: None  # run() makes it stop the server
    app.state.engine, app.state.metrics = engine, metrics
    timings = OrderedDict()  # response id -> its stamps, both endpoints'
    loras = {r.lora_name: r for r in lora_requests}  # the `model` names that pick an adapter
    completions = OpenAIServingCompletion(engine, model_name, timings, max_prompts=max_prompts,
                                          max_prompt_tokens=max_prompt_tokens, max_seqs=max_seqs, lora_modules=loras)
    chat = OpenAIServingChat(engine, model_name, timings, lora_modules=loras)
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, metrics=metrics)
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    async def health():
        engine.check_ready()  # EngineNotReady: a 503 saying why (loading, failed, shutting down)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/debug/timing/{request_id}")
    async def get_timing(request_id: str):
        if request_id not in timings:
            raise APIError(404, f"no timing for {request_id!r}: unknown, or older than the last "
                           f"{KEEP_TIMINGS} requests", param="request_id", code="not_found")
        return timings[request_id]

    def card(name: str = model_name) -> ModelCard:
        built = engine.engine
        return ModelCard(id=name, created=int(app.state.started), root=loras[name].lora_path if name in loras else name,
                         parent=model_name if name in loras else None,
                         max_model_len=built.max_model_len if built is not None else None)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(), *(card(name) for name in loras)])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        completions.check_model(model_id)
        return card(model_id if model_id in loras else model_name)

    if lora_root is not None:  # runtime adapter updates: only when the operator names their folder
        lora = OpenAIServingLoRA(engine, model_name, loras, lora_root)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest):
            return await lora.load(request.lora_name, request.lora_path)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
            return lora.unload(request.lora_name)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create_chat_completion(request, raw_request)

    app.state.started = time.time()
    return app


async def _log_when_ready(engine: AsyncLLMEngine, model_name: str) -> None:
    """One log line once the engine serves (the port opened long before: the model loads meanwhile)."""
    while not engine.ready_event.is_set():
        await asyncio.sleep(0.05)
    if engine.load_error is None and engine.dead is None:
        warm = engine.warm_up_seconds
        logger.info("ready: %s is loaded%s; /health answers 200", model_name,
                    f" and warmed up in {warm:.1f} s" if warm else "")


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type, param, code).body(), status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(BadField)
    async def bad_field(_, e: BadField):
        return _error(400, str(e), param=e.param)

    @app.exception_handler(EngineNotReady)
    async def not_ready(_, e: EngineNotReady):
        return _error(503, str(e), "server_error", code="not_ready")

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):  # FastAPI's 422: OpenAI says 400
        message, param = _describe(e.errors())
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):  # unknown path (404), wrong method (405), ...
        code = "not_found" if e.status_code == 404 else None
        return _error(e.status_code, str(e.detail), param=None, code=code)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):  # what Guard did not catch (an error in Guard itself)
        return _internal_error(request.method, request.url.path, e)


def _internal_error(method: str, path: str, e: Exception) -> JSONResponse:
    # one line per failed request (a traceback each would flood the log); the traceback at debug level
    # backslashreplace: an error that quotes a lone surrogate must still go through a UTF-8 log stream
    text = str(e).encode("utf-8", "backslashreplace").decode("utf-8")
    logger.error("%s %s failed: %s: %s", method, path, type(e).__name__, text, exc_info=logger.isEnabledFor(logging.DEBUG))
    return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors -> one message and the field it concerns (its dotted path)."""
    lines, first = [], None
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
        path = ""
        for part in err.get("loc", ())[1:]:  # ("body", "messages", 0, "content")
            if isinstance(part, int):
                path += f"[{part}]"
            elif part.isidentifier() and part not in _TYPE_NAMES and not part[0].isupper():  # not a union branch
                path += f".{part}" if path else part
        first = first or path or None
        line = f"{path or 'body'}: {err['msg']}"
        if line not in lines:
            lines.append(line)
    return "; ".join(lines[:4]) + ("; ..." if len(lines) > 4 else ""), first


class Guard:
    """Pure ASGI middleware, before any route: counts every response by status, checks the API key on
    /v1, refuses bodies over the limit with 413 before reading them whole, and turns an unexpected
    error into a 500 it sends itself: Starlette's catch-all handler re-raises after answering, and
    uvicorn then drops the keep-alive connection (probe round 4, M1)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.limit, self.metrics = app, api_key, max_request_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        started = [False]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
            await send(message)

        try:
            refusal = self._auth(scope)
            if refusal is None:
                refusal, receive = await self._body(scope, receive)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        except Exception as e:
            if started[0]:  # half a response is out: only closing the connection can tell the client
                raise
            await _internal_error(scope["method"], scope["path"], e)(scope, receive, counted_send)
        finally:
            self.metrics.http_response(scope["path"], status[0])

    def _auth(self, scope) -> JSONResponse | None:
        if self.api_key is None or not scope["path"].startswith("/v1"):
            return None
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return None
        message = ("Incorrect API key provided" if given else
                   "You didn't provide an API key: send it as `Authorization: Bearer YOUR_KEY`")
        return _error(401, message, code="invalid_api_key")

    async def _body(self, scope, receive):
        """Read the body, at most the limit (a 413 past it), and hand it on as one message."""
        too_large = _error(413, f"the request body is larger than {self.limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return too_large, receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return None, _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return too_large, receive
            if not message.get("more_body", False):
                break
        return None, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()  # then disconnects, as they come

    return replayed


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown first stops new requests and, after the grace period, aborts
    those still running (so their streams end, rather than hang until uvicorn cancels them)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None):
        self.engine.accepting = False
        abort = asyncio.get_running_loop().call_later(self.grace, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


def run_server(args) -> int:
    """`minillm serve`: build the app, serve until SIGTERM/Ctrl-C. -> exit status (ValueError: no engine)."""
    from ...engine import EngineConfig
    from ...model_files import embedded_model_path
    from .cli_args import build_llm_engine, check_api_key, engine_kwargs, lora_requests

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.switch_interval_ms is not None:  # how long a thread may hold the GIL while the other waits
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    api_key = args.api_key or os.environ.get("MINILLM_API_KEY") or None
    if api_key is not None and not args.api_key:
        try:
            check_api_key(api_key)
        except ValueError as e:
            raise ValueError(f"$MINILLM_API_KEY {e}") from None
    model_name = args.served_model_name or args.model or embedded_model_path().stem
    EngineConfig(**engine_kwargs(args))  # a bad engine flag: exit 2 now, before the port opens
    loras = lora_requests(args)
    if model_name in {r.lora_name for r in loras}:
        raise ValueError(f"--lora-modules name {model_name!r} is the base model's served name: pick another")
    llm_args = dict(model=args.model, dtype=args.dtype, device=args.device,
                    tensor_parallel_size=args.tensor_parallel_size, **engine_kwargs(args))
    make = partial(build_llm_engine, llm_args, getattr(args, "quantization", None), tuple(loras))
    engine = AsyncLLMEngine(make, warm_up=False if args.no_warm_up else "auto", engine_core=args.engine_core)
    app = build_app(engine, model_name, api_key, args.max_request_bytes, args.max_prompts_per_request,
                    args.max_prompt_tokens_per_request, args.max_seqs_per_request, loras, getattr(args, "lora_root", None))
    loop, http = fast_loop_and_parser()
    protocol, http_kwargs = http_protocol(http, args.max_header_bytes)  # headers bounded before the key is checked
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, loop=loop, http=protocol,
                            access_log=not args.no_access_log, timeout_graceful_shutdown=args.shutdown_grace + 5,
                            **http_kwargs)
    server = _Server(config, engine, args.shutdown_grace)
    app.state.on_dead = lambda: setattr(server, "should_exit", True)
    logger.info("serving %s on http://%s:%d (API key %s; event loop %s, HTTP parser %s)", model_name, args.host,
                args.port, "required" if api_key else "not required", loop, http)
    server.run()
    if engine.load_error is not None:
        raise ValueError(f"the engine could not be built: {engine.load_error}")
    return 0 if engine.dead is None else 1


def fast_loop_and_parser() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools (C, both in minillm[serve]) when
    installed, else asyncio and h11 (pure Python). Every request's intake runs through the parser and
    every SSE write through the loop, on the one thread that also turns the core's rows into chunks."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http
