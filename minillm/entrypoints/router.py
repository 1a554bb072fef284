"""`minillm router`: one OpenAI endpoint in front of a prefill engine and a decode engine (chapter 17;
vLLM's disaggregated-prefill proxy, DistServe's two pools).

    client -> router --1--> producer  (`minillm serve --kv-role producer`)   the prompt, max_tokens=1
                     --2--> consumer  (`minillm serve --kv-role consumer`)   the request itself, with a handle

Each request gets a fresh transfer id. Phase 1 sends a copy of the body to the producer with one
token to generate, no streaming and kv_transfer_params {"do_remote_decode": true, "transfer_id": ID}:
the producer computes the prompt's K/V and saves them through its connector. Phase 2 sends the
client's own body to the consumer with {"do_remote_prefill": true, "transfer_id": ID}: the consumer
loads those K/V, computes only the prompt's last token, and answers. Its answer (a JSON body or an
SSE stream, the usage in it) goes back to the client byte for byte, and so does any error of
either phase, with its status. A client that goes away mid-stream closes the consumer's stream,
which aborts the request there; a consumer that dies mid-answer gives the client a 502 (or, mid-stream,
an SSE error event and [DONE]) naming the decode server, and the producer, whose transfer nobody
finished, frees its blocks after kv_send_timeout and keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)
PREFILL_ONLY = {"max_tokens": 1, "max_completion_tokens": None, "min_tokens": 0, "n": 1, "stream": False,
                "stream_options": None, "logprobs": None, "top_logprobs": None, "stop": None}


def prefill_body(body: dict, transfer_id: str) -> dict:
    """The producer's copy: compute the prompt, generate one token (thrown away), save the K/V."""
    out = {**body}
    for key, value in PREFILL_ONLY.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


def decode_body(body: dict, transfer_id: str) -> dict:
    return {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id}}


def broke_off(url: str, e: Exception) -> dict:
    return {"error": {"message": f"the decode server {url} broke off its answer ({type(e).__name__}: {e}); the "
                      "producer frees the prompt's KV after its kv_send_timeout", "type": "server_error"}}


def build_router(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="minillm router", lifespan=lifespan)

    def forwarded(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}

    async def two_phase(request: Request, path: str):
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object",
                                           "type": "invalid_request_error"}}, 400)
        tid = uuid.uuid4().hex
        headers = forwarded(request)
        try:  # phase 1: the producer prefills
            first = await client.post(prefill_url + path, json=prefill_body(body, tid),
                                      headers=headers)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"the prefill server {prefill_url} is unreachable: {e}",
                                           "type": "server_error"}}, 502)
        if first.status_code != 200:  # the client's error as the producer gave it (a 400 names the field)
            return Response(first.content, first.status_code, media_type=first.headers.get("content-type"))
        if await request.is_disconnected():  # nobody to decode for (the producer's transfer times out)
            return Response(status_code=499)
        # phase 2: the consumer decodes from the producer's K/V
        upstream = client.build_request("POST", decode_url + path, json=decode_body(body, tid), headers=headers)
        try:
            reply = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"the decode server {decode_url} is unreachable: {e}",
                                           "type": "server_error"}}, 502)
        media = reply.headers.get("content-type")
        if not media or not media.startswith("text/event-stream"):
            try:
                content = await reply.aread()
            except httpx.HTTPError as e:  # the consumer died while it answered
                return JSONResponse(broke_off(decode_url, e), 502)
            finally:
                await reply.aclose()
            return Response(content, reply.status_code, media_type=media)

        async def relay():
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the consumer died mid-stream: say so, and end the stream properly
                yield f"data: {json.dumps(broke_off(decode_url, e))}\n\ndata: [DONE]\n\n".encode()
            finally:  # also when the client went away: closing the stream aborts the request upstream
                await reply.aclose()

        return StreamingResponse(relay(), reply.status_code, media_type=media)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await two_phase(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await two_phase(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        reply = await client.get(decode_url + "/v1/models", headers=forwarded(request))
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    @app.get("/health")
    async def health():
        codes = []
        for url in (prefill_url, decode_url):
            try:
                codes.append((await client.get(url + "/health", timeout=5.0)).status_code)
            except httpx.HTTPError:
                codes.append(None)
        ok = all(c == 200 for c in codes)
        return JSONResponse({"prefill": codes[0], "decode": codes[1]}, 200 if ok else 503)

    return app


def run_router(args) -> int:
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be an http:// or https:// URL, not {url!r}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_router(args.prefill, args.decode)
    logger.info("routing http://%s:%d: prefill on %s, decode on %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
