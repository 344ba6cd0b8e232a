"""Prometheus metrics of one server (own registry, so tests can run several in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from genrec.serve.engine import Result

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("genrec_requests", "Finished calls by method and gRPC status code",
                                ["method", "code"], registry=r)
        self.latency = Histogram("genrec_request_latency_seconds", "Server-side latency of a call",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("genrec_queue_wait_seconds", "Time from decode to the start of its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("genrec_batch_compute_seconds", "Engine time of one batch",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("genrec_batch_size", "Requests per engine batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.refused_callers = Counter("genrec_caller_refused", "Calls refused for being past their caller's share "
                                       "(serve.fair; tenants with a quota by name, the rest as 'other')",
                                       ["tenant"], registry=r)
        self.queue_depth = Gauge("genrec_queue_depth", "Requests waiting for a batch", registry=r)
        self.engine_available = Gauge("genrec_engine_available", "1 while some engine process can answer",
                                      registry=r)
        self.model = Gauge("genrec_model_info", "The served artifact (value 1)", ["version", "engine"], registry=r)
        # the engine's per-user K/V cache (serve.kvcache): counted from each call's result, the
        # gauges from the cache's state after the call's batch (in the engine's process)
        self.cache_history = Counter("genrec_cache_history_tokens", "History tokens of the calls served", registry=r)
        self.cache_cached = Counter("genrec_cache_cached_tokens", "History tokens reused from the K/V cache",
                                    registry=r)
        self.cache_evicted = Counter("genrec_cache_evicted_tokens", "Cached tokens evicted (least recently used "
                                     "users) to keep newer ones", registry=r)
        self.cache_hits = Counter("genrec_cache_hits", "Calls that reused >= 1 cached token", registry=r)
        self.cache_misses = Counter("genrec_cache_misses", "Calls with a user_id that reused no cached token",
                                    registry=r)
        self.cache_used = Gauge("genrec_cache_used_tokens", "Tokens' worth of storage the K/V cache holds (its entries' tokens, their room to grow and block summaries)", registry=r)
        self.cache_capacity = Gauge("genrec_cache_capacity_tokens", "Tokens the K/V cache's budget holds", registry=r)
        self.cache_users = Gauge("genrec_cache_users", "Users in the K/V cache", registry=r)
        self.cache_bytes = Gauge("genrec_cache_bytes", "Bytes of keys, values and events in the K/V cache",
                                 registry=r)

    def on_batch(self, size: int, depth: int) -> None:
        self.batch_size.observe(size)
        self.queue_depth.set(depth)

    def on_result(self, result: Result) -> None:
        """One call's cache accounting (``serve.engine.Result``)."""
        self.cache_history.inc(result.history_tokens)
        self.cache_cached.inc(result.cached_tokens)
        if result.cached_tokens:  # (an engine that reports reuse but not its lookups still counts hits)
            self.cache_hits.inc()
        elif result.cache_lookup:
            self.cache_misses.inc()
        if result.evicted_tokens:
            self.cache_evicted.inc(result.evicted_tokens)
        g = result.cache_gauges
        if g is not None:  # (an engine sets those it can see: SGLang's pool hides its use and its users)
            for key, gauge in (("used_tokens", self.cache_used), ("capacity_tokens", self.cache_capacity),
                               ("users", self.cache_users), ("bytes", self.cache_bytes)):
                if key in g:
                    gauge.set(g[key])

    def serve_http(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
