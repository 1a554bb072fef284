"""`minillm bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does (chapter 12).

    minillm serve &                                              # or vLLM, SGLang, llama.cpp's server, ...
    minillm bench serve --base-url http://127.0.0.1:8000 --request-rate 8 --num-prompts 256 \\
        --slo 500,50 --output-json result.json

Each request streams (SSE) with stream_options.include_usage; the client timestamps every chunk
that carries text and computes TTFT, TPOT, ITL and E2E from those times (serve_metrics.py). It uses
only what the OpenAI API defines, so it measures any compatible server: output tokens come from the
server's usage chunk, or, if none comes, from the number of text chunks. `--ignore-eos` adds vLLM's
`ignore_eos` extra, which a server that does not know it may refuse.

Workloads:
    random   the course's: prompt and output lengths uniform in [min, max], the prompt random token
             ids of --tokenizer (default: the embedded SmolLM2's) decoded to text, or sent as ids
             (--prompt-format ids; /v1/completions only; a server must accept token-id prompts)
    prompts  real questions: a JSONL file (--dataset-path; one {"prompt": ...} per line) or, by
             default, the questions in prompts.txt beside this file; --max-tokens each

Arrivals: --request-rate per second (inf: all at once), gaps from Gamma(--burstiness) (1: Poisson);
--max-concurrency caps the requests in flight. One untimed request first checks the server answers;
a server that cannot be reached, refuses the key or fails it is a ServerError (one line, no traceback).

The client is aiohttp with one session for the run (as vLLM's and SGLang's benchmarks): a burst at
rate inf is on the wire at once, each request on a connection of its own (see `session`). It runs
on uvloop when installed; run_requests_in_process runs it in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .serve_metrics import RequestResult, SSEParser, arrival_times, parse_slo, summarize

PROMPTS_FILE = Path(__file__).with_name("prompts.txt")


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens, when the workload knows them
    max_tokens: int


def random_workload(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                    tokenizer=None, prompt_format: str = "text") -> list[BenchRequest]:
    """Random token ids of the tokenizer's ordinary vocabulary (no special or added tokens)."""
    from ..tokenizer.loaders import load_tokenizer

    tok = load_tokenizer(tokenizer)
    special = set(tok.special_ids) | set(tok.added_tokens.values())
    ordinary = [i for i in range(len(tok.vocab)) if i not in special]
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        p, o = rng.randint(*input_len), rng.randint(*output_len)
        ids = [rng.choice(ordinary) for _ in range(p)]
        out.append(BenchRequest(ids if prompt_format == "ids" else tok.decode(ids), p, o))
    return out


def prompts_workload(num: int, max_tokens: int, seed: int, dataset_path: str | None = None) -> list[BenchRequest]:
    """num prompts drawn (with a seeded shuffle, repeating if needed) from the file."""
    if dataset_path is None:
        prompts = [line for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    else:
        prompts = []
        for i, line in enumerate(Path(dataset_path).read_text().splitlines()):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{dataset_path} line {i + 1}: expected {{\"prompt\": \"...\"}}, got {line[:80]!r}")
                prompts.append(row["prompt"])
        if not prompts:
            raise ValueError(f"{dataset_path} holds no prompts")
    rng = random.Random(seed)
    order = []
    while len(order) < num:
        order += rng.sample(prompts, len(prompts))
    return [BenchRequest(p, None, max_tokens) for p in order[:num]]


def request_body(req: BenchRequest, endpoint: str, model: str, ignore_eos: bool) -> dict:
    body = dict(model=model, max_tokens=req.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
    if endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("endpoint 'chat' takes text prompts; --prompt-format ids needs --endpoint completions")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def _events(response, parser: SSEParser):
    """(arrival time, data) of each event of a streamed response, as its bytes arrive."""
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        for data in parser.feed(chunk):
            yield now, data
    for data in parser.close():  # a last event ended by a bare CR
        yield time.perf_counter(), data


async def send(http, url: str, body: dict, prompt_len: int | None) -> RequestResult:
    """POST one streamed request; timestamp each chunk that carries text; read usage if sent."""
    result = RequestResult(start=time.perf_counter(), prompt_tokens=prompt_len)
    chat = "messages" in body
    try:
        async with http.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:300]}"
                return result
            pieces, done = [], False
            async for now, data in _events(response, SSEParser()):
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {event['error'].get('message', event['error'])}"
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", result.output_tokens)
                    result.prompt_tokens = event["usage"].get("prompt_tokens") or prompt_len
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        result.chunk_times.append(now)
                        pieces.append(text)
            result.text = "".join(pieces)
            result.success = done and bool(result.chunk_times)
            if not result.success:
                result.error = "the stream ended without [DONE]" if not done else "the stream carried no text"
    except Exception as e:  # a refused connection, a timeout, a broken stream: a failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


class ServerError(ValueError):
    """The server cannot be benchmarked: nothing listens at the URL, it refuses our key, it fails the
    test request. A ValueError, so `minillm bench serve` prints it in one line (no traceback)."""


def session(concurrency: int, api_key: str | None, timeout: float):
    """One aiohttp session for the whole run, as `vllm bench serve` and SGLang's bench_serving use.
    Its connector opens a connection for every request that finds none idle, up to `concurrency`: a
    burst goes on the wire at once. (httpx 0.27's pool, which this client used before, assigns every
    queued request to the one idle keep-alive connection, and all but one retry: a burst of 384
    leaves the client over seconds, and the server is measured at the rate the client lets out.)"""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, ttl_dns_cache=300)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(connector=connector, headers=headers, read_bufsize=1 << 18,
                                 timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=30.0))


async def _first_model(http, base: str) -> str:
    """The server's first model (GET /v1/models), or a ServerError that says what went wrong."""
    import aiohttp

    try:
        async with http.get(f"{base}/v1/models") as r:
            if r.status != 200:
                raise ServerError(_refusal(base, r.status, (await r.read()).decode(errors="replace")))
            return (await r.json())["data"][0]["id"]
    except aiohttp.ClientConnectionError as e:
        raise ServerError(f"cannot reach a server at {base} ({e}); is it running, and is --base-url right?") from None


async def open_connections(http, base: str, n: int) -> None:
    """Open n keep-alive connections before the clock starts (a burst's requests then find one each
    idle, as with wrk or k6). Opened inside the burst, the TCP handshakes come after the client has
    built every request: one Python client's own work, ~0.5 ms a request, would hold the whole burst
    off the wire and be measured as the server's (chapter 12)."""

    async def one() -> None:
        async with http.get(f"{base}/health") as r:
            await r.read()  # read to the end: the connection goes back to the pool, open

    await asyncio.gather(*(one() for _ in range(n)))


def _refusal(base: str, status: int, text: str) -> str:
    hint = " (pass --api-key, or set OPENAI_API_KEY, to the key the server was started with)" if status == 401 else ""
    return f"the server at {base} answered HTTP {status}{hint}: {text[:200]}"


async def run_requests(base_url: str, requests: list[BenchRequest], *, endpoint: str = "completions",
                       model: str | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                       max_concurrency: int | None = None, ignore_eos: bool = False, api_key: str | None = None,
                       seed: int = 0, progress: bool = True, timeout: float = 600.0):
    """-> (results in request order, seconds from the first send to the last answer, model name).
    A server that cannot be reached, refuses the key or fails the untimed test request: ServerError."""
    from tqdm.auto import tqdm

    base = base_url.rstrip("/").removesuffix("/v1")
    url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    async with session(max_concurrency or len(requests) + 1, api_key, timeout) as http:
        if model is None:
            model = await _first_model(http, base)
        bodies = [request_body(q, endpoint, model, ignore_eos) for q in requests]
        probe = await send(http, url, {**bodies[0], "max_tokens": min(bodies[0]["max_tokens"], 8)}, None)
        if not probe.success:
            status = probe.error.split(":", 1)[0].removeprefix("HTTP ")
            if status.isdigit():
                raise ServerError(_refusal(base, int(status), probe.error.split(":", 1)[1].strip()))
            raise ServerError(f"the server at {base} did not answer a test request: {probe.error}")
        if math.isinf(request_rate):
            await open_connections(http, base, min(len(requests), max_concurrency or len(requests)))
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=not progress, desc="requests")
        t0 = time.perf_counter()

        async def one(at: float, body: dict, prompt_len: int | None) -> RequestResult:
            if at > 0:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            if gate is None:
                result = await send(http, url, body, prompt_len)
            else:
                async with gate:
                    result = await send(http, url, body, prompt_len)
            bar.update(1)
            return result

        times = arrival_times(len(requests), request_rate, burstiness, seed)
        results = await asyncio.gather(*(one(t, b, q.prompt_len) for t, b, q in zip(times, bodies, requests)))
        duration = time.perf_counter() - t0
        bar.close()
    return list(results), duration, model


def _run_requests_here(base_url: str, requests: list[BenchRequest], kwargs: dict, report_cpu: bool = False):
    """run_requests on a fresh event loop (uvloop's when installed, as the server's); report_cpu: this
    process's CPU seconds for it too, as a fourth value."""
    cpu = time.process_time()
    try:
        import uvloop
    except ImportError:
        out = asyncio.run(run_requests(base_url, requests, **kwargs))
    else:
        out = uvloop.run(run_requests(base_url, requests, **kwargs))
    return (*out, time.process_time() - cpu) if report_cpu else out


def run_requests_in_process(base_url: str, requests: list[BenchRequest], report_cpu: bool = False, **kwargs):
    """run_requests in a process of its own (spawned): the client's CPU never competes with the
    caller's (a benchmark driver, an offline engine, a notebook kernel) for a GIL. Same result, plus
    the client's CPU seconds if report_cpu."""
    import concurrent.futures
    import multiprocessing as mp

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_run_requests_here, base_url, requests, kwargs, report_cpu).result()


def add_arguments(p, name: str) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="the model to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY, if set)")
    p.add_argument("--workload", choices=["random", "prompts"], default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--tokenizer", default=None, help="random workload: whose token ids (default: embedded SmolLM2)")
    p.add_argument("--prompt-format", choices=["text", "ids"], default="text")
    p.add_argument("--dataset-path", default=None, help="prompts workload: a JSONL file of {\"prompt\": ...}")
    p.add_argument("--max-tokens", type=int, default=256, help="prompts workload: tokens per answer")
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos extra")
    p.add_argument("--slo", default=None, help="ttft_ms,tpot_ms: report goodput under these SLOs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-progress", action="store_true")


def run(base_url: str, endpoint: str = "completions", model: str | None = None, api_key: str | None = None,
        workload: str = "random", num_prompts: int = 256, request_rate: float = math.inf, burstiness: float = 1.0,
        max_concurrency: int | None = None, min_input_len: int = 100, max_input_len: int = 1024,
        min_output_len: int = 100, max_output_len: int = 1024, tokenizer: str | None = None,
        prompt_format: str = "text", dataset_path: str | None = None, max_tokens: int = 256,
        ignore_eos: bool = False, slo: str | None = None, seed: int = 0, output_json: str | None = None,
        no_progress: bool = False) -> dict:
    """Run the benchmark, print its table, return (and optionally write) its numbers."""
    from ..checks import check_int
    from .serving_setup import check_range
    from .table import print_table

    check_int("num_prompts", num_prompts)
    if max_concurrency is not None:
        check_int("max_concurrency", max_concurrency)
    slo_ms = parse_slo(slo)
    arrival_times(1, request_rate, burstiness)  # a bad rate or burstiness fails before any work
    if workload == "random":
        check_range("input_len", min_input_len, max_input_len)
        check_range("output_len", min_output_len, max_output_len)
        requests = random_workload(num_prompts, (min_input_len, max_input_len), (min_output_len, max_output_len),
                                   seed, tokenizer, prompt_format)
    elif workload == "prompts":
        check_int("max_tokens", max_tokens)
        requests = prompts_workload(num_prompts, max_tokens, seed, dataset_path)
    else:
        raise ValueError(f"workload must be 'random' or 'prompts', not {workload!r}")
    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', not {endpoint!r}")
    results, duration, model = _run_requests_here(base_url, requests, dict(
        endpoint=endpoint, model=model, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, ignore_eos=ignore_eos, api_key=api_key or os.environ.get("OPENAI_API_KEY"),
        seed=seed, progress=not no_progress))
    out = dict(base_url=base_url, endpoint=endpoint, model=model, workload=workload, num_prompts=num_prompts,
               request_rate=request_rate if math.isfinite(request_rate) else "inf", burstiness=burstiness, max_concurrency=max_concurrency, slo_ms=slo_ms,
               **summarize(results, duration, slo_ms))
    out["errors"] = sorted({r.error for r in results if not r.success})[:5]
    shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items() if k != "errors"}
    print_table([{"metric": k, "value": v} for k, v in shown.items()], title="serving benchmark")
    for error in out["errors"]:
        print(f"failed: {error}")
    if output_json:  # strict JSON: a statistic of no values (NaN) is null
        clean = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}
        Path(output_json).write_text(json.dumps(clean, indent=2, default=str, allow_nan=False) + "\n")
    return out
