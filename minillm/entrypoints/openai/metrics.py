"""GET /metrics: the server in Prometheus' text format (prometheus-client), with vLLM's metrics under
minillm_ names.

Counted per request, when it ends (whoever was reading it): requests by finish reason, prompt and
generated tokens, and three latency histograms, measured from the moment the server handed the
request to the engine:

    TTFT  time to first token         first token - arrival
    TPOT  time per output token       (end - first token) / (tokens - 1), of its longest completion
    E2E   end-to-end latency          end - arrival

Read at scrape time from what the engine thread published after its last step (EngineLoad): running
and waiting requests, KV blocks in use and in the pool, preemptions and steps. HTTP responses are
counted by path and status (every 4xx included).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ...engine.async_llm_engine import AsyncLLMEngine, FinishedStats
from ...outputs import RequestOutput

disable_created_metrics()  # no *_created series: a scrape reads as vLLM's does

PATHS = frozenset({"/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                   "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLMEngine):
        self.registry = r = CollectorRegistry()  # the server's own: two servers in one process stay apart
        self.requests = Counter("minillm_requests", "Requests ended, by finish reason (of the request: error or "
                                "abort if any completion ended so, else its first completion's)",
                                ["finish_reason"], registry=r)
        self.http = Counter("minillm_http_requests", "HTTP responses, by path and status code", ["path", "status"],
                            registry=r)
        self.prompt_tokens = Counter("minillm_prompt_tokens", "Prompt tokens of the requests that ended", registry=r)
        self.generation_tokens = Counter("minillm_generation_tokens", "Tokens generated for the requests that "
                                         "ended (all n completions)", registry=r)
        self.ttft = Histogram("minillm_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("minillm_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("minillm_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def request_finished(self, out: RequestOutput) -> None:
        stats: FinishedStats = out.metrics
        self.requests.labels(stats.finish_reason).inc()
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.e2e.observe(stats.finished_time - stats.arrival_time)
        if stats.first_token_time is not None:
            self.ttft.observe(stats.first_token_time - stats.arrival_time)
            longest = max(stats.output_lens)
            if longest > 1:
                self.tpot.observe((stats.finished_time - stats.first_token_time) / (longest - 1))

    def http_response(self, path: str, status: int) -> None:
        self.http.labels(path if path in PATHS else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's state at scrape time, from its thread's last EngineLoad (never the engine itself)."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    def collect(self):
        load, stats = self.engine.load, self.engine.load.stats or {}
        yield GaugeMetricFamily("minillm_num_requests_running", "Requests with a sequence in the running batch",
                                value=load.running)
        yield GaugeMetricFamily("minillm_num_requests_waiting", "Requests with no sequence running: not started yet, or preempted",
                                value=load.waiting)
        yield GaugeMetricFamily("minillm_kv_cache_used_blocks", "KV-cache blocks held by sequences",
                                value=load.used_blocks)
        yield GaugeMetricFamily("minillm_kv_cache_total_blocks", "KV-cache blocks in the pool", value=load.num_blocks)
        yield GaugeMetricFamily("minillm_kv_cache_usage_ratio", "Share of the KV-cache blocks in use",
                                value=load.used_blocks / load.num_blocks if load.num_blocks else 0.0)
        yield CounterMetricFamily("minillm_num_preemptions", "Sequences preempted (recomputed or swapped)",
                                  value=stats.get("num_preemptions", 0))
        yield CounterMetricFamily("minillm_engine_steps", "Engine steps that ran the model",
                                  value=stats.get("num_steps", 0))
        for name, what in (("bytes_saved", "KV bytes a connector saved for another engine (chapter 17)"),
                           ("bytes_loaded", "KV bytes a connector loaded from another engine"),
                           ("seconds_saving", "Seconds from a step's first KV save to its last landing"),
                           ("seconds_loading", "Seconds from a step's KV load start to its last layer landing"),
                           ("transfers_saved", "Prompts whose KV a connector published"),
                           ("transfers_loaded", "Prompts whose KV a connector loaded")):
            yield CounterMetricFamily(f"minillm_kv_{name}", what, value=stats.get(f"kv_{name}", 0))
        for name, what in (("saved_blocks", "Prefix-cache blocks evicted from the GPU copied to the CPU tier (chapter 15)"),
                           ("restored_blocks", "CPU-tier blocks copied back into the GPU pool on a prefix hit"),
                           ("hit_tokens", "Prompt tokens served from the CPU tier (not computed)"),
                           ("dropped_blocks", "CPU-tier copies forgotten, least recently used first"),
                           ("bytes_to_cpu", "KV bytes copied to the CPU tier (one worker's)"),
                           ("bytes_to_gpu", "KV bytes copied back from the CPU tier (one worker's)")):
            yield CounterMetricFamily(f"minillm_kv_offload_{name}", what, value=stats.get(f"offload_{name}", 0))
        yield CounterMetricFamily("minillm_lora_slot_loads", "LoRA adapters copied into a GPU slot (swap-ins)",
                                  value=stats.get("num_lora_slot_loads", 0))
        yield CounterMetricFamily("minillm_lora_disk_loads", "LoRA adapters read from disk into the CPU pool",
                                  value=stats.get("num_lora_disk_loads", 0))
        yield GaugeMetricFamily("minillm_ready", "1 when the engine serves requests (GET /health is 200)",
                                value=1.0 if self.engine.ready else 0.0)
