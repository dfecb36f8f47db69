"""Prometheus metrics of the server, in a registry of its own (no process-global state).

Two sources feed it:
- the engine thread updates the counters and histograms below as outputs arrive
  (prometheus_client metrics are thread-safe);
- ``engine_snapshot`` is the latest ``engine.metrics()`` dict, replaced (never mutated) by the
  engine thread after every step and every batch of commands; a custom collector turns it
  into gauges (pages, queue) and counters (preemptions, fp8 saturation, NaN) at scrape time,
  so /metrics never calls into the engine from the event loop.

Prefix caching (as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``): ``queries`` counts
the prompt tokens looked up at admissions (readmissions after preemption included), ``hits``
those whose K/V was reused; the hit rate since start is hits / queries, also exported as a
gauge. ``prefix_cache_pages`` are the pages registered now (in use or evictable),
``prefix_cache_evictions`` the cached pages handed out again. ``prompt_tokens_cached`` is
per request (its first admission, the API's ``cached_tokens``), next to ``prompt_tokens``.
Models with a per-sequence state (hybrid, DeepSeek-V4) reuse a prefix through a state
snapshot: ``state_snapshot_hits`` counts admissions that restored one, ``saves`` and
``evictions`` the snapshots registered and dropped, and the gauges the ones held now and
their bytes beside the snapshot slots' (``engine.snapshot_policy``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jfp8kv.engine.stats import compile_count

# Latency buckets in seconds: fine at the low end for ITL, up to minutes for TTFT under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# engine.metrics() key -> (metric name, help, kind)
_ENGINE_METRICS = {
    "pages_used": ("jfp8kv_kv_cache_pages_used", "KV cache pages held by requests", "gauge"),
    "pages_total": ("jfp8kv_kv_cache_pages_total", "KV cache pages usable by requests", "gauge"),
    "num_waiting": ("jfp8kv_queue_length", "Requests waiting to be scheduled", "gauge"),
    "num_running": ("jfp8kv_num_requests_running", "Requests being decoded or prefilled", "gauge"),
    "num_preemptions_total": ("jfp8kv_preemptions", "Requests preempted for KV pages", "counter"),
    "kv_saturated_total": ("jfp8kv_kv_cache_saturated",
                           "K/V values clipped to the fp8 range on store", "counter"),
    "kv_nan_total": ("jfp8kv_kv_cache_nan", "NaN K/V values seen on store", "counter"),
    "prefix_cache_queries_total": ("jfp8kv_prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache", "counter"),
    "prefix_cache_hits_total": ("jfp8kv_prefix_cache_hits",
                                "Prompt tokens whose K/V came from the prefix cache", "counter"),
    "prefix_cache_pages": ("jfp8kv_prefix_cache_pages",
                           "KV cache pages registered in the prefix cache", "gauge"),
    "prefix_cache_evictions_total": ("jfp8kv_prefix_cache_evictions",
                                     "Cached pages evicted to be reused", "counter"),
    "snapshot_hits_total": ("jfp8kv_state_snapshot_hits",
                            "Admissions that restored a state snapshot", "counter"),
    "snapshot_saves_total": ("jfp8kv_state_snapshot_saves", "State snapshots registered",
                             "counter"),
    "snapshot_evictions_total": ("jfp8kv_state_snapshot_evictions",
                                 "State snapshots dropped (for a free slot, or with their "
                                 "page)", "counter"),
    "snapshots_cached": ("jfp8kv_state_snapshots", "State snapshots registered now", "gauge"),
    "snapshot_bytes": ("jfp8kv_state_snapshot_bytes",
                       "Bytes of the state snapshots registered now", "gauge"),
    "snapshot_pool_bytes": ("jfp8kv_state_snapshot_pool_bytes",
                            "Bytes of the pools' state snapshot slots", "gauge"),
}


class _EngineCollector:
    def __init__(self, owner: "ServerMetrics"):
        self._owner = owner

    def collect(self):
        snapshot = self._owner.engine_snapshot
        for key, (name, doc, kind) in _ENGINE_METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(snapshot.get(key, 0)))
        plan = GaugeMetricFamily(
            "jfp8kv_memory_plan_bytes", "The bytes the cache pools were sized by at start-up "
            "(capacity, in_use: the weights, peak: the step's measured temporaries, margin, "
            "pool_budget, total: the device's memory)", labels=["part"])
        for part in ("capacity", "in_use", "peak", "margin", "pool_budget", "total"):
            if f"memory_plan_{part}" in snapshot:
                plan.add_metric([part], float(snapshot[f"memory_plan_{part}"]))
        yield plan
        device = GaugeMetricFamily("jfp8kv_device_memory_bytes", "The device allocator's "
                                   "counts (GPU): bytes_in_use, peak_bytes_in_use, bytes_limit",
                                   labels=["kind"])
        for kind in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if f"device_{kind}" in snapshot:
                device.add_metric([kind], float(snapshot[f"device_{kind}"]))
        yield device
        queries = snapshot.get("prefix_cache_queries_total", 0)
        yield GaugeMetricFamily(
            "jfp8kv_prefix_cache_hit_rate", "Prefix cache hits / queries (tokens) since start",
            value=snapshot.get("prefix_cache_hits_total", 0) / queries if queries else 0.0)
        yield CounterMetricFamily(  # flat after start-up: every shape compiles before /health
            "jfp8kv_xla_compiles", "XLA compilations since the metrics were set up, after "
            "the start-up compiles (persistent-cache loads included)",
            value=float(compile_count()[0]))


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jfp8kv_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.generated_tokens = Counter("jfp8kv_generated_tokens", "Tokens generated",
                                        registry=r)
        self.prompt_tokens = Counter("jfp8kv_prompt_tokens", "Prompt tokens of requests",
                                     registry=r)
        self.prompt_tokens_cached = Counter(
            "jfp8kv_prompt_tokens_cached", "Prompt tokens of requests served from the prefix "
            "cache", registry=r)
        self.ttft = Histogram("jfp8kv_time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("jfp8kv_inter_token_latency_seconds",
                             "Gap between consecutive generated tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("jfp8kv_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_E2E_BUCKETS, registry=r)
        self.rejected = Counter(
            "jfp8kv_requests_rejected", "Requests refused with 503 before reaching the engine "
            "(server_overloaded: the waiting queue at --max-queued-requests)", ["reason"],
            registry=r)
        self.timeouts = Counter("jfp8kv_requests_timed_out",
                                "Requests aborted at --request-timeout", registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(finish_reason=reason)  # export zeros from the start
        for reason in ("server_overloaded", "shutting_down", "unhealthy"):
            self.rejected.labels(reason=reason)
        self.engine_snapshot: dict = {}
        compile_count()  # installs the counting listener (counts from here on)
        r.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)
