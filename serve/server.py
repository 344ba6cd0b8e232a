"""The gRPC server: genrec.v1.Recommender + Admin, health checking, reflection, metrics.

Seams (each has one job):

    gRPC call (bytes) --serve.requests.decode--> Work (validated)  [INVALID_ARGUMENT here]
        --Batcher.submit--> queue (bounded)  [RESOURCE_EXHAUSTED when full]
        --batch loop--> engine.run(works) in a worker thread  [DEADLINE_EXCEEDED if expired]
        --> Result --> response proto

Handlers take raw bytes (no generated deserializer), so a truncated or malformed message
is answered INVALID_ARGUMENT by our decoder instead of INTERNAL by gRPC's. The server
holds no state but its artifact: replicas scale behind any gRPC load balancer.

Shutdown: health goes NOT_SERVING, new calls are refused, calls in flight finish (up to
``grace_s``). Reload (Admin.LoadArtifact, or SIGHUP in ``genrec serve``): the new
artifact loads in the background and is swapped in between batches; no call is dropped.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.genrec.v1 import recommender_pb2 as pb
from serve.batcher import BatchConfig, Batcher, DeadlineExceeded, Overloaded, ShuttingDown
from serve.engine import Result
from serve.metrics import ServerMetrics
from serve.requests import InvalidRequest, Kind, Limits, decode
from serve.worker import EnginePool, EngineProcess, ProcessSettings

log = logging.getLogger("genrec.serve")
RECOMMENDER = "genrec.v1.Recommender"
ADMIN = "genrec.v1.Admin"


@dataclass(frozen=True)
class ServeConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 0  # Prometheus HTTP exposition; 0 = off
    engine: Literal["torch", "naive", "sglang"] = "torch"
    device: str = "cpu"
    default_timeout_ms: float = 1000.0  # deadline for calls that set none
    grace_s: float = 10.0
    batch: BatchConfig = field(default_factory=BatchConfig)
    limits: Limits = field(default_factory=Limits)
    # run the torch / naive engine in its own process (serve.worker): no GIL shared with
    # the front-end; the SGLang engine always runs in the server process
    engine_process: bool = False
    process: ProcessSettings = field(default_factory=ProcessSettings)
    engine_replicas: int = 1  # engine processes, each taking whole batches (needs engine_process)
    replica_cpus: tuple[tuple[int, ...], ...] = ()  # CPUs of each replica (serve.worker.plan_cpus); () = any


def make_engine(kind: str, artifact: str, device: str):  # noqa: ANN201 - an engine
    if kind == "sglang":
        from serve.sglang_engine import SGLangEngine

        return SGLangEngine(artifact, device=device)
    from serve.engine import NaiveTorchEngine, TorchEngine

    return (NaiveTorchEngine if kind == "naive" else TorchEngine)(artifact, device=device)


def open_engine(cfg: ServeConfig, artifact: str):  # noqa: ANN201 - an engine
    """The engine the config asks for: in a child process, or in this one."""
    if cfg.engine_process and cfg.engine != "sglang":
        cpus = cfg.replica_cpus or ((),) * cfg.engine_replicas
        if len(cpus) != cfg.engine_replicas:
            raise ValueError(f"replica_cpus names {len(cpus)} replicas, engine_replicas is {cfg.engine_replicas}")
        engines = [EngineProcess(cfg.engine, artifact, cfg.device, replace(cfg.process, cpus=c)) for c in cpus]
        return engines[0] if len(engines) == 1 else EnginePool(engines)
    if cfg.engine_replicas != 1:
        raise ValueError("engine replicas need the engine in its own process (--engine-process)")
    return make_engine(cfg.engine, artifact, cfg.device)


def quiet_gc() -> None:
    """Moves every object alive now (torch, grpc, the model: ~350k objects) into the
    collector's permanent generation. Otherwise a full collection, which Python starts now
    and then as requests allocate, walks them all: ~170 ms with the process stalled, which
    at 300 QPS is 50 calls past any p99 budget. Called once a process has loaded what it
    keeps; garbage made later is still collected."""
    gc.collect()
    gc.freeze()


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("closing the previous engine failed: %r", fut.exception())


def _scored(result: Result, tasks: tuple[str, ...]) -> list[pb.ScoredItem]:
    out = []
    for j in range(result.item_ids.size):
        item = pb.ScoredItem(item_id=int(result.item_ids[j]), score=float(result.scores[j]))
        if result.retrieval_scores is not None:
            item.retrieval_score = float(result.retrieval_scores[j])
        for t in tasks:
            if t in result.tasks:
                item.tasks[t] = float(result.tasks[t][j])
        out.append(item)
    return out


class RecommenderServer:
    def __init__(self, cfg: ServeConfig, artifact: str, engine=None) -> None:  # noqa: ANN001
        self.cfg, self.artifact = cfg, artifact
        self.engine = engine if engine is not None else open_engine(cfg, artifact)
        self.owns_engine = engine is None  # an engine handed in is closed by whoever made it
        self.metrics = ServerMetrics()
        self.metrics.model.labels(self.engine.version, self.engine.name).set(1)
        self.server: grpc.aio.Server | None = None
        self.batcher: Batcher | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._reloading = asyncio.Lock()
        self.stages: dict[str, float] = {"decode": 0.0, "encode_response": 0.0}
        self.served = 0

    # ----- lifecycle ------------------------------------------------------------------------
    async def start(self) -> int:
        self.batcher = Batcher(lambda: self.engine, self.cfg.batch, self.metrics.on_batch)
        self.batcher.start()
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
        handlers = {m: grpc.unary_unary_rpc_method_handler(self._handler(k))
                    for m, k in (("Recommend", "recommend"), ("Retrieve", "retrieve"), ("Rank", "rank"))}
        admin = {
            "LoadArtifact": grpc.unary_unary_rpc_method_handler(
                self._load_artifact, pb.LoadArtifactRequest.FromString, pb.LoadArtifactResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._model_info, pb.GetModelInfoRequest.FromString, pb.ModelInfo.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RECOMMENDER, handlers),
                                              grpc.method_handlers_generic_handler(ADMIN, admin)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (RECOMMENDER, ADMIN, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.cfg.host}:{self.cfg.port}")
        await self.server.start()
        for svc in ("", RECOMMENDER):
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if self.cfg.metrics_port:
            self.metrics.serve_http(self.cfg.metrics_port, self.cfg.host)
        quiet_gc()
        log.info("serving %s (%s engine) on %s:%d", self.engine.version, self.engine.name, self.cfg.host, self.port)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: NOT_SERVING, refuse new calls, let calls in flight finish."""
        grace = self.cfg.grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self.batcher:
            await self.batcher.drain(grace)
        if self.server:
            await self.server.stop(grace)
        if self.owns_engine and hasattr(self.engine, "close"):
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    async def wait(self) -> None:
        if self.server:
            await self.server.wait_for_termination()

    async def reload(self, path: str) -> str:
        """Loads ``path`` off the event loop, then swaps it in between batches."""
        async with self._reloading:
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            engine = await loop.run_in_executor(None, open_engine, replace(self.cfg, engine=self.engine.name), path)
            old, self.engine, self.artifact = self.engine, engine, path
            self.metrics.model.labels(old.version, old.name).set(0)
            self.metrics.model.labels(engine.version, engine.name).set(1)
            if self.owns_engine and hasattr(old, "close"):  # e.g. an engine process: stops after its batch in flight
                loop.run_in_executor(None, old.close).add_done_callback(_log_failure)
            self.owns_engine = True
            quiet_gc()
            log.info("loaded %s in %.1fs", engine.version, time.monotonic() - t0)
            return engine.version

    # ----- handlers -------------------------------------------------------------------------
    def _handler(self, kind: Kind):  # noqa: ANN202 - an async gRPC handler
        async def handle(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            t0 = time.monotonic()
            code = grpc.StatusCode.OK
            try:
                return await self._serve(kind, data, context, t0)
            except InvalidRequest as e:
                code, msg = grpc.StatusCode.INVALID_ARGUMENT, str(e)
            except Overloaded as e:
                code, msg = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
            except (DeadlineExceeded, TimeoutError):
                code, msg = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request was served"
            except ShuttingDown as e:
                code, msg = grpc.StatusCode.UNAVAILABLE, str(e)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:  # noqa: BLE001 - a bug must not take the server down
                log.exception("%s failed", kind)
                code, msg = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
            finally:
                self.metrics.requests.labels(kind, code.name).inc()
                self.metrics.latency.labels(kind).observe(time.monotonic() - t0)
            await context.abort(code, msg)

        return handle

    async def _serve(self, kind: Kind, data: bytes, context: grpc.aio.ServicerContext, t0: float) -> bytes:
        engine = self.engine
        work = decode(kind, data, engine.schema, self.cfg.limits)
        decoded = time.monotonic()
        self.stages["decode"] += decoded - t0
        remaining = context.time_remaining()
        budget = self.cfg.default_timeout_ms / 1e3 if remaining is None or math.isinf(remaining) else remaining
        work.deadline = t0 + budget
        self.metrics.queue_depth.set(self.batcher.depth)
        result = await self.batcher.submit(work, timeout=max(work.deadline - time.monotonic(), 0))
        started = result.started or result.sent  # when the engine began the batch
        timing = pb.Timing(queue_ms=(time.monotonic() - t0) * 1e3 - result.compute_ms,
                           compute_ms=result.compute_ms, batch_size=result.batch_size,
                           decode_ms=(decoded - t0) * 1e3, wait_ms=max(started - decoded, 0.0) * 1e3,
                           handoff_ms=max((result.back - started) * 1e3 - result.compute_ms, 0.0))
        self.metrics.compute.observe(result.compute_ms / 1e3)
        t1 = time.monotonic()
        items = _scored(result, engine.schema.tasks)
        cls = {"recommend": pb.RecommendResponse, "retrieve": pb.RetrieveResponse, "rank": pb.RankResponse}[kind]
        out = cls(items=items, model_version=engine.version, timing=timing).SerializeToString()
        self.stages["encode_response"] += time.monotonic() - t1
        self.served += 1
        return out

    def profile(self) -> dict[str, object]:
        """Seconds per stage since start (server side + the engine's), and calls served."""
        return {"served": self.served, "stages_s": {**self.stages, **getattr(self.engine, "stages", {})}}

    async def _load_artifact(self, req: pb.LoadArtifactRequest, context: grpc.aio.ServicerContext) -> pb.LoadArtifactResponse:
        t0 = time.monotonic()
        try:
            version = await self.reload(req.path)
        except (ValueError, FileNotFoundError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"path: {e}")
        return pb.LoadArtifactResponse(model_version=version, load_seconds=time.monotonic() - t0)

    async def _model_info(self, req: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        e = self.engine
        s = e.schema
        q = e.manifest.quantization
        return pb.ModelInfo(model_version=e.version, artifact_path=self.artifact, tower=e.tower,
                            tasks=list(s.tasks), context_features=list(s.embedding.pooled_features),
                            catalogue_size=s.catalogue_size, max_history=s.max_history, engine=e.name,
                            embeddings=q.get("embeddings", ""), dense=q.get("dense", ""))
