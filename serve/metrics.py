"""Prometheus metrics of one server (own registry, so tests can run several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
        self.queue_depth = Gauge("genrec_queue_depth", "Requests waiting for a batch", registry=r)
        self.engine_available = Gauge("genrec_engine_available", "1 while some engine process can answer",
                                      registry=r)
        self.model = Gauge("genrec_model_info", "The served artifact (value 1)", ["version", "engine"], registry=r)

    def on_batch(self, size: int, depth: int) -> None:
        self.batch_size.observe(size)
        self.queue_depth.set(depth)

    def serve_http(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
