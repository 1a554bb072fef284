"""The flags of `minillm serve` (vLLM's cli_args.py): where to listen, who may call, what to limit,
and the engine's own knobs (EngineConfig's fields, vLLM's flag names). Plain argparse: building the
`minillm` parser never imports the server's dependencies. Every flag is checked as it is parsed, so
a bad one is exit 2 with one line naming it, before the model loads or the port opens."""

from __future__ import annotations

import argparse
import math
import os

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 128k-token prompt is about 0.5 MB of text
# the limits of one completions request (serving_completion.py, where they are enforced)
DEFAULT_MAX_PROMPTS = 1024
DEFAULT_MAX_PROMPT_TOKENS = 1 << 18
DEFAULT_MAX_SEQS = 4096  # prompts x n: 1024 prompts x n=256 was 262,144 sequences from a 12 KB body
DEFAULT_MAX_HEADER_BYTES = 16 * 2**10  # h11's limit; httptools (uvicorn's faster parser) has none


def _int_in(low: int, high: int | None, what: str):
    """An argparse type: an int in [low, high], refused naming `what` otherwise."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"must be {what}, not {value!r}")
        return n

    return parse


positive_int = _int_in(1, None, "a positive integer")
_port = _int_in(0, 65535, "a TCP port number (0 to 65535)")


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {value!r}") from None
    if not (math.isfinite(s) and s >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {value!r}")
    return s


def _api_key(value: str) -> str:
    try:
        return check_api_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_api_key(value: str) -> str:
    """A key a client can send: not empty (that would silently turn authentication off), and visible
    ASCII only, as HTTP headers carry it (a non-ASCII key or one with spaces around it could never be
    matched: every request would get a 401)."""
    if not value.strip():
        raise ValueError("is empty; give the key clients must send, or leave the flag out to serve without one")
    if not all("!" <= ch <= "~" for ch in value):
        raise ValueError("must be visible ASCII characters only (no spaces, no accents): an HTTP header carries it, "
                         "and a key no client can send would lock every client out")
    return value


def _prefix_caching(value: str):
    choices = {"off": None, "hash": "hash", "radix": "radix"}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(choices)}, not {value!r}")
    return choices[value]


def _positive_ms(value: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, not {value!r}") from None
    if not ms > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 ms, not {value!r}")
    return ms


# (flag, EngineConfig field, type, help); the default is EngineConfig's
ENGINE_FLAGS = [
    ("--block-size", "block_size", int, "tokens per KV block"),
    ("--num-gpu-blocks", "num_gpu_blocks", int, "KV blocks in the pool (default: what the memory allows)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "share of the GPU's memory to fill"),
    ("--max-model-len", "max_model_len", int, "context length (prompt + output); longer prompts get a 400"),
    ("--max-num-seqs", "max_num_seqs", int, "sequences running at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--enable-prefix-caching", "enable_prefix_caching", _prefix_caching, "off, hash (vLLM) or radix (SGLang)"),
    ("--preemption-mode", "preemption_mode", str, "recompute or swap"),
    ("--swap-space", "swap_space", float, "GiB of CPU memory for swapped-out blocks"),
    ("--cuda-graph-max-batch", "cuda_graph_max_batch", int, "decode batches up to this size replay a CUDA graph"),
    ("--cuda-graph-max-tokens", "cuda_graph_max_tokens", int, "prefill steps up to this many tokens replay one"),
    ("--structured-outputs-backend", "structured_outputs_backend", str, "who compiles response_format and "
     "structured_outputs grammars into token masks: minillm (ours, chapter 14) or xgrammar (the PyPI package)"),
    ("--kv-cache-dtype", "kv_cache_dtype", str, "KV cache storage: auto (the model's dtype), fp8 (e4m3) or int8, "
     "scales calibrated on the tokenizer's text (chapter 08)"),
    ("--max-loras", "max_loras", int, "LoRA adapters in one step: GPU slots (chapter 16)"),
    ("--max-lora-rank", "max_lora_rank", int, "the largest adapter rank served"),
    ("--max-cpu-loras", "max_cpu_loras", int, "adapters kept read on the CPU (default: --max-loras)"),
]
# chapter 15: which KV blocks a sequence gives back (engine/kv_eviction.py); `minillm generate` and `chat` take them too
KV_EVICTION_FLAGS = [
    ("--kv-eviction", "kv_eviction", str, "auto (a model whose every layer slides frees the blocks before its "
     "window), none, sliding, streaming (attention sinks + recent tokens: StreamingLLM), h2o (heavy hitters) or "
     "snapkv (the prompt blocks its last queries attend to)"),
    ("--kv-budget", "kv_budget", int, "KV tokens kept per sequence, for --kv-eviction streaming, h2o and snapkv"),
    ("--snapkv-window", "snapkv_window", int, "snapkv: the prompt's last queries whose attention picks its blocks"),
    ("--sink-tokens", "sink_tokens", int, "streaming: the first tokens, always kept (whole blocks)"),
    ("--kv-positions", "kv_positions", str, "streaming: original (a kept key keeps its position) or cache (its "
     "place among the kept tokens, as the StreamingLLM paper)"),
]
# chapter 15's offload tier (engine/kv_offload.py): evicted prefix-cache blocks spill to pinned CPU memory
KV_OFFLOAD_FLAGS = [
    ("--kv-offload-gb", "kv_offload_gb", float, "GiB of pinned CPU memory per worker that evicted prefix-cache "
     "blocks spill to (least recently used out first) and come back from on a prefix hit; needs prefix caching "
     "(generate and chat turn the hash cache on)"),
    ("--kv-offload-blocks", "kv_offload_blocks", int, "the offload tier's size in KV blocks (overrides --kv-offload-gb)"),
]
ENGINE_FLAGS += KV_EVICTION_FLAGS + KV_OFFLOAD_FLAGS


def add_flags(p, flags: list[tuple]) -> None:
    """(flag, field, type, help) rows as options that are absent from the namespace unless given."""
    for flag, field, kind, text in flags:
        p.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS, help=text)


def given(args: argparse.Namespace, flags: list[tuple]) -> dict:
    """The fields of these rows given on the command line."""
    return {field: getattr(args, field) for _, field, _, _ in flags if hasattr(args, field)}


def add_kv_eviction_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, KV_EVICTION_FLAGS + KV_OFFLOAD_FLAGS)


def kv_eviction_kwargs(args: argparse.Namespace) -> dict:
    """The chapter-15 EngineConfig fields given on the command line (eviction and the offload tier)."""
    return given(args, KV_EVICTION_FLAGS + KV_OFFLOAD_FLAGS)


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path or any(ch.isspace() for ch in name):
        raise argparse.ArgumentTypeError(f"must be NAME=PATH (a PEFT adapter folder), not {value!r}")
    return name, path


def lora_requests(args: argparse.Namespace) -> list:
    """--lora-modules as LoRARequests, ids 1, 2, ... in the order given; a name used twice, or one that
    is the base model's, is a ValueError (the OpenAI `model` field could not tell them apart)."""
    from ...lora.request import LoRARequest

    modules = getattr(args, "lora_modules", None) or []
    if (modules or getattr(args, "lora_root", None)) and not args.enable_lora:
        raise ValueError("--lora-modules and --lora-root need --enable-lora")
    root = getattr(args, "lora_root", None)
    if root is not None and not os.path.isdir(root):
        raise ValueError(f"--lora-root {root!r} is not a folder")
    names = [n for n, _ in modules]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"--lora-modules names must be unique; {', '.join(dup)} given twice")
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules)]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file, HF model folder or hub id (default: embedded SmolLM2)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api-key", type=_api_key, default=None, help="require `Authorization: Bearer KEY` on /v1 "
                   "(also from $MINILLM_API_KEY)")
    p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies get a 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--max-prompts-per-request", type=positive_int, default=DEFAULT_MAX_PROMPTS,
                   help=f"prompts in one /v1/completions request; more get a 400 (default {DEFAULT_MAX_PROMPTS})")
    p.add_argument("--max-prompt-tokens-per-request", type=positive_int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help=f"prompt tokens in one /v1/completions request, all prompts together; more get a 400 "
                   f"(default {DEFAULT_MAX_PROMPT_TOKENS})")
    p.add_argument("--max-seqs-per-request", type=positive_int, default=DEFAULT_MAX_SEQS,
                   help=f"sequences one /v1/completions request may ask for, prompts x n; more get a 400 "
                   f"(default {DEFAULT_MAX_SEQS})")
    p.add_argument("--max-header-bytes", type=positive_int, default=DEFAULT_MAX_HEADER_BYTES,
                   help=f"a request's HTTP headers, before the API key is checked; larger ones get a 431 and the "
                   f"connection closed (default {DEFAULT_MAX_HEADER_BYTES})")
    p.add_argument("--shutdown-grace", type=_seconds, default=10.0, help="seconds in-flight requests get to finish "
                   "after SIGTERM/Ctrl-C; then they are aborted (finish_reason 'abort')")
    p.add_argument("--no-warm-up", action="store_true", help="skip the warm-up (on a GPU it compiles and captures "
                   "before /health says 200)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--switch-interval-ms", type=_positive_ms, default=None,
                   help="Python's GIL switch interval in ms (default: Python's, 5): with --engine-core thread the "
                   "engine thread and the event loop share the GIL, and a thread back from the GPU may wait this long "
                   "for it")
    p.add_argument("--engine-core", choices=["thread", "process"], default="process",
                   help="where the engine runs: process (default; vLLM V1's EngineCore: a child process steps the "
                   "model while this one does HTTP, JSON and SSE, each with its own GIL) or thread (a thread of the "
                   "server's process, sharing one GIL with the HTTP loop)")
    p.add_argument("--quantization", default=None, help="weights in fewer bits: int8, int4, awq, gptq "
                   "(NAME:key=value,... for options), or a folder written by `minillm quantize`")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over N GPUs (or N CPU processes), one worker process each (chapter 11)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model (chapter 16)")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="adapters to serve (PEFT folders); a request's `model` field picks one by NAME")
    p.add_argument("--lora-root", default=None, metavar="DIR",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter at run time, for adapter "
                   "folders inside DIR only (off without it)")
    add_flags(p.add_argument_group("engine"), ENGINE_FLAGS)
    add_kv_transfer_args(p)


# (flag, KVTransferConfig field, type, help): disaggregated prefill and decode (chapter 17)
KV_FLAGS = [
    ("--kv-connector", "kv_connector", str, "SharedStorageConnector (a file store, push), SharedPoolConnector "
     "(the consumer copies from the producer's shared-memory / CUDA-IPC pool) or CudaIpcConnector (CUDA IPC only: "
     "two processes on one GPU)"),
    ("--kv-role", "kv_role", str, "producer (prefills and saves), consumer (loads and decodes) or both"),
    ("--kv-path", "kv_path", str, "the folder both engines share (under /dev/shm for memory speed)"),
    ("--kv-load-timeout", "kv_load_timeout", _seconds, "a consumer waits this long for a handle's KV"),
    ("--kv-load-failure-policy", "kv_load_failure_policy", str, "fail (the request gets an error) or recompute "
     "(it is prefilled here)"),
    ("--kv-send-timeout", "kv_send_timeout", _seconds, "a producer keeps an untaken transfer this long"),
]


def _json_object(value: str) -> dict:
    import json

    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {value!r}")
    return obj


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated prefill and decode (chapter 17)")
    g.add_argument("--kv-transfer-config", type=_json_object, default=None,
                   help='vLLM\'s form: a JSON object of the fields below, e.g. \'{"kv_connector": '
                   '"SharedStorageConnector", "kv_role": "producer", "kv_path": "/dev/shm/kv"}\'')
    add_flags(g, KV_FLAGS)


def kv_transfer_config(args: argparse.Namespace) -> dict | None:
    """--kv-transfer-config, with the single flags on top; None when neither was given."""
    config = dict(getattr(args, "kv_transfer_config", None) or {})
    config.update(given(args, KV_FLAGS))
    return config or None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (the others keep EngineConfig's defaults)."""
    kwargs = given(args, ENGINE_FLAGS)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if (kv := kv_transfer_config(args)) is not None:
        kwargs["kv_transfer_config"] = kv
    if getattr(args, "enable_lora", False):
        kwargs["enable_lora"] = True
    return kwargs


def build_llm_engine(llm_args: dict, quantization: str | None = None, lora_requests: tuple = ()):
    """The server's LLMEngine: LLM(**llm_args).engine, --quantization parsed here, every --lora-modules
    adapter read and checked (a bad one fails the start, naming it). A module-level function, so
    `functools.partial(build_llm_engine, ...)` travels to an engine core process."""
    from ...llm import LLM

    if quantization is not None:  # chapter 08: a name, NAME:opts or a saved folder
        from ...quantize import parse_quantization

        llm_args = {**llm_args, "quantization": parse_quantization(quantization)}
    engine = LLM(**llm_args).engine
    for request in lora_requests:
        engine.lora.check(request)
    return engine



def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="the producer's base URL (minillm serve --kv-role producer)")
    p.add_argument("--decode", required=True, help="the consumer's base URL (minillm serve --kv-role consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
