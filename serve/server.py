"""The gRPC server: genrec.v1.Recommender + Admin, health checking, reflection, metrics.

Seams (each has one job):

    gRPC call (bytes)  [RESOURCE_EXHAUSTED past max_concurrent_rpcs, by gRPC itself]
        --Batcher.admit--> [RESOURCE_EXHAUSTED at once if it could not start within its budget]
        --serve.requests.decode--> Work (validated)  [INVALID_ARGUMENT here; FAILED_PRECONDITION
                                   for what the served model lacks: generative retrieval]
        --Batcher.submit--> queue (bounded)  [RESOURCE_EXHAUSTED when full]
        --batch loop--> engine.run(works) in a worker thread  [DEADLINE_EXCEEDED if expired]
        --> Result --> response proto

Handlers take raw bytes (no generated deserializer), so a truncated or malformed message
is answered INVALID_ARGUMENT by our decoder instead of UNKNOWN by gRPC's; error details are
bounded. The server holds no state but its artifact: replicas scale behind any gRPC load
balancer. The public listener (optionally TLS, ``tls``) serves Recommender, health and
reflection only; Admin has a listener of its own (``admin``: loopback, a bearer token,
optionally TLS / mTLS) and loads artifacts from below one allowed folder only.

Shutdown: health goes NOT_SERVING, new calls are refused, calls in flight finish (up to
``grace_s``), every wait after that is bounded. Reload (Admin.LoadArtifact, or SIGHUP in
``genrec serve``): the new artifact is checked, loads in the background and is swapped in
between batches; no call is dropped.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import math
import multiprocessing as mp
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.quant.artifact import ArtifactError, OutsideRoot, check_artifact
from genrec.serve.admission import CONTENTION_KEY, FairConfig, Shares, caller_of
from genrec.serve.ann import RetrievalConfig
from genrec.serve.batcher import BatchConfig, Batcher, DeadlineExceeded, Overloaded, ShuttingDown
from genrec.serve.contract import Engine, EngineBuilder, InProcessEngine, Result, WorkFailed
from genrec.serve.factory import make_engine, quiet_gc
from genrec.serve.failover import EnginePool, FailoverEngine, open_engine_process
from genrec.serve.frontend import FrontEnd, Health, ThreadListener
from genrec.serve.kvcache import CacheConfig
from genrec.serve.link import LinkListener, serve_link
from genrec.serve.loading import Loading
from genrec.serve.metrics import ServerMetrics
from genrec.serve.proxy import FrontPlan, NativeFront
from genrec.serve.requests import MAX_DETAIL, InvalidRequest, Kind, Limits, decode, parse
from genrec.serve.scoring import ScoringConfig
from genrec.serve.worker import EngineProcess, EngineProcessError, ProcessSettings

# a time remaining past this (a year) is a call without a deadline
NO_DEADLINE_S = 365 * 86400.0
log = logging.getLogger("genrec.serve")
RECOMMENDER = "genrec.v1.Recommender"
ADMIN = "genrec.v1.Admin"
MAX_PATH = 4096


EngineKind = Literal["torch", "sglang"]


@dataclass(frozen=True)
class TLSConfig:
    """A listener's TLS. ``cert`` and ``key`` (PEM files) turn it on; ``client_ca`` (PEM) also
    requires every client to present a certificate it signed (mutual TLS)."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.client_ca)


@dataclass(frozen=True)
class AdminConfig:
    """The Admin service (LoadArtifact, GetModelInfo): its own listener, never the public one.
    Off unless ``token_file`` names a file holding a bearer token; every call must then send
    ``authorization: Bearer <token>`` (and, with ``tls.client_ca``, a client certificate)."""

    host: str = "127.0.0.1"  # loopback: reachable from this host only unless set otherwise
    port: int = 0  # 0: any free port (printed at start)
    token_file: str = ""
    # LoadArtifact takes paths below this folder only ("": the folder holding the served artifact)
    artifact_root: str = ""
    load_timeout_s: float = 300.0  # an artifact check and engine start that take longer fail
    tls: TLSConfig = field(default_factory=TLSConfig)
    # plaintext Admin on a non-loopback host: refused unless this says the network is trusted
    # (the token would cross it in the clear); give admin.tls (or tls) instead where you can
    insecure: bool = False


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 in brackets or not) is this host only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve to any interface


@dataclass(frozen=True)
class ConnectionConfig:
    """Limits of the public listener, enforced by gRPC before a handler runs."""

    # calls being handled at once (each holds a handler slot from arrival to reply); gRPC refuses
    # more at once with RESOURCE_EXHAUSTED ("Concurrent RPC limit exceeded!") before our handler
    # runs. Size it to max QPS x the latency budget with headroom (e.g. 500/s x 30 ms = 15), plus
    # health checks: admission control (serve.batch) decides which of these are served
    max_concurrent_rpcs: int = 32
    # calls gRPC's core holds unaccepted while the front-end is busy (its event loop saturated:
    # the handler slots above turn over only as fast as Python runs). Past it the core refuses a
    # new call itself, in C, in well under a millisecond, with no Python run for it: the status is
    # gRPC's own CANCELLED (its core has no other for it). Unbounded (gRPC's default soft limit is
    # 1000), these calls waited in the core until their deadline: at 4x capacity every call
    # waited ~1 s and most were never served (issue 46). grpc.aio takes calls one at a time, so
    # a burst of calls arriving together is pending until taken even on an idle server: keep the
    # bound above the largest burst a healthy caller sends (8 refused some of a 16-call burst)
    max_pending_calls: int = 32
    # which gRPC server takes the calls: "aio" (grpc.aio: every call, refused or not, runs Python
    # on the event loop, ~250 us of CPU) or "threads" (gRPC's thread-pool server, one thread per
    # handler slot, calls handed to the event loop; past max_concurrent_rpcs gRPC refuses on its
    # polling thread at ~50 us a call: serve.frontend)
    front_end: FrontEnd = "aio"
    # front_end = "native" (serve.proxy): Recommender calls the front end passes to the server at
    # once; past it (or, while others call, past a caller's fair.max_share of it) the front end
    # refuses with RESOURCE_EXHAUSTED in C++. Size it near what the server answers within
    # batch.max_queue_ms: that budget / one call's cost (12 here: ~20 ms / ~1.6 ms)
    max_in_flight: int = 12
    # ... and how long a call past that cap may wait there for a place while the front end is not
    # overloaded: a Poisson load at half of capacity sends bursts past 12 calls now and then,
    # which were refused (issue 46's recovery windows). Once a call past the cap could not wait
    # (the line full, or a wait ran out), calls past it are refused at once until 250 ms pass
    # without one (a flood: the calls answered must not queue behind it). 0: refused at once; at
    # most 100 (a waiting call keeps the judgement of its caller made when it arrived)
    max_wait_ms: float = 10.0
    # ... and its CPU priority, this many nice levels below the server's and the engine's (0-19): where it
    # shares a core with them, under overload its refusals yield to computing answers, and it
    # takes calls in larger bunches. 5: goodput at 4x and 8x capacity 1.09-1.16x against
    # 0.87-1.01x at 0, the answered p99 no higher, refusals ~1 ms later (10: answered p99 past
    # twice the budget; benchmarks/notes/2026-12-07-front-link.md). No effect on a core of its own
    front_nice: int = 5
    max_message_bytes: int = 0
    keepalive_time_s: float = 60.0  # ping an idle connection this often ...
    keepalive_timeout_s: float = 20.0  # ... and close it if the ping goes unanswered this long
    max_connection_idle_s: float = 600.0
    max_connection_age_s: float = 3600.0  # clients reconnect now and then: load rebalances
    max_connection_age_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.front_end not in get_args(FrontEnd):
            raise ValueError(f"serve.connections.front_end = {self.front_end!r}; choose aio, threads or native")
        if self.max_in_flight < 1:
            raise ValueError(f"serve.connections.max_in_flight = {self.max_in_flight}; it must be at least 1")
        if not 0 <= self.max_wait_ms <= 100:
            raise ValueError(f"serve.connections.max_wait_ms = {self.max_wait_ms}; it must be 0 to 100")
        if not 0 <= self.front_nice <= 19:
            raise ValueError(f"serve.connections.front_nice = {self.front_nice}; it must be 0 to 19")


@dataclass(frozen=True)
class ServeConfig:
    """``genrec serve``'s config: the ``[serve]`` section of a TOML file (configs/serve.toml lists
    every key with its default), ``--serve.a.b=v`` overrides, and a few flags that are aliases
    of keys (``--artifact``, ``--engine``, ``--host``, ``--port``, ``--threads``: serve.process.threads).
    The defaults are what ``genrec serve`` runs with no file and no flags."""

    artifact: str = ""  # the artifact folder served at start (`genrec quantize --out`)
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 0  # Prometheus HTTP exposition; 0 = off
    engine: EngineKind = "torch"
    device: str = "cpu"
    default_timeout_ms: float = 1000.0  # deadline for calls that set none
    grace_s: float = 10.0
    batch: BatchConfig = field(default_factory=BatchConfig)
    limits: Limits = field(default_factory=Limits)
    tls: TLSConfig = field(default_factory=TLSConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    connections: ConnectionConfig = field(default_factory=ConnectionConfig)
    fair: FairConfig = field(default_factory=FairConfig)  # per-caller shares (serve.admission)
    # the engines' per-user K/V cache and the history window it relies on (serve.kvcache)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # dense retrieval's search: the artifact's ANN index or exact (serve.ann.RetrievalConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    # the precision a call's candidates are scored in (serve.scoring.ScoringConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    # run the torch engine in its own process (serve.worker): no GIL shared with
    # the front-end; the SGLang engine always runs in the server process
    engine_process: bool = True
    process: ProcessSettings = field(default_factory=ProcessSettings)
    engine_replicas: int = 1  # engine processes, each taking whole batches (needs engine_process)
    # CPUs of the engine processes, or of SGLang's scheduler (serve.cli.engine_cpus,
    # serve.worker.plan_cpus): "auto" (with process.threads = N each
    # replica owns N CPUs from the last one down, the front-end keeps the rest), "none", or CPU
    # numbers ([2, 3], split between the replicas; the front-end takes the others). Applied by
    # `genrec serve`, which owns the process's affinity; RecommenderServer takes the result.
    engine_cpus: str | int | tuple[int, ...] = "auto"

    def __post_init__(self) -> None:
        # where each engine process runs is planned from engine_cpus, and its priority by the
        # failover engine: the per-process fields would be overwritten without a word
        if self.process.cpus or self.process.nice:
            raise ValueError("serve.process.cpus / serve.process.nice are set per engine process by the "
                             "server; choose the engine CPUs with serve.engine_cpus")
        if self.process.cache != CacheConfig():
            raise ValueError("serve.process.cache is set per engine process by the server; set the cache in "
                             "[serve.cache]")
        if self.process.retrieval != RetrievalConfig():
            raise ValueError("serve.process.retrieval is set per engine process by the server; set it in "
                             "[serve.retrieval]")
        if self.process.scoring != ScoringConfig():
            raise ValueError("serve.process.scoring is set per engine process by the server; set it in "
                             "[serve.scoring]")
        if self.engine_replicas < 1:
            raise ValueError(f"serve.engine_replicas = {self.engine_replicas}; it must be at least 1")
        a = self.admin
        if a.token_file and a.port and a.port == self.port:
            raise ValueError(f"serve.admin.port = {a.port} is serve.port: Admin has its own listener, never the "
                             "public one; give it another port (0: any free one)")
        if a.token_file and not is_loopback(a.host) and not (a.tls.enabled or self.tls.enabled) and not a.insecure:
            raise ValueError(f"serve.admin.host = {a.host!r} is not loopback and Admin has no TLS: its bearer token "
                             "would cross the network in plaintext. Set serve.admin.tls.cert / .key (or serve.tls), "
                             "bind serve.admin.host = \"127.0.0.1\", or set serve.admin.insecure = true on a "
                             "trusted network")


SGLANG_INFLIGHT = 4  # batches handed to the SGLang engine at once (serve.batch.max_inflight = 0)


def batch_inflight(cfg: ServeConfig, engine: Engine | None = None) -> int:
    """Batches in flight at once: ``batch.max_inflight``, or where that is 0 three for one engine
    process (the next ones wait in its pipe while one computes, serve.worker.EngineProcess.run_async:
    a call that arrives while two batches are out is sent at once instead of waiting for the
    front-end to collect a reply), four for SGLang (its scheduler batches the requests of all
    of them: continuous batching), else one per engine replica (an in-process engine: one).
    ``engine``: the one the server holds, whose ``batches_together`` decides for SGLang whatever
    ``cfg.engine`` names (a server given an engine built elsewhere: one batch at a time made an
    SGLang engine's calls wait a whole batch each, and admission refuse them at half its capacity)."""
    if cfg.batch.max_inflight:
        return cfg.batch.max_inflight
    if cfg.engine == "sglang" or (engine is not None and engine.batches_together):
        return SGLANG_INFLIGHT
    return 3 if cfg.engine_process and cfg.engine_replicas == 1 else cfg.engine_replicas


SGLANG_MAX_BEAM = 256  # SGLangEngine's max_beam, which make_engine leaves at its default


def open_engine(cfg: ServeConfig, artifact: str, replica_cpus: Sequence[tuple[int, ...]] = (),
                build: EngineBuilder | None = None, loading: Loading | None = None) -> Engine:
    """The engine the config asks for: in child processes, or in this one. ``replica_cpus``: the
    CPUs of each engine process (() for each: where the OS puts it); ``build``: makes the engine
    (default: ``serve.factory.make_engine``, the kinds of ``serve.engine``); ``loading``: told
    each step and each engine made, so that whoever bounds the start can stop it
    (``serve.loading``). What a failed start made is closed."""
    loading = loading or Loading()
    if cfg.engine == "sglang" and cfg.limits.max_beam > SGLANG_MAX_BEAM:
        raise ValueError(f"serve.limits.max_beam = {cfg.limits.max_beam}: the sglang engine decodes beams of at most "
                         f"{SGLANG_MAX_BEAM} (its vocabulary carries 2 x that many padding ids)")
    if cfg.engine_process and cfg.engine != "sglang":
        cpus = tuple(replica_cpus) or ((),) * cfg.engine_replicas
        if len(cpus) != cfg.engine_replicas:
            raise ValueError(f"replica_cpus names {len(cpus)} replicas, engine_replicas is {cfg.engine_replicas}")
        # each with a warm standby (ProcessSettings.standby): an engine that dies is replaced at once
        # (replicas stand in for each other: no standby each)
        single = cfg.engine_replicas == 1
        engines: list[EngineProcess | FailoverEngine] = []
        try:
            for i, c in enumerate(cpus):  # one at a time; each must load the model the first did
                engine = open_engine_process(cfg.engine, artifact, cfg.device,
                                             replace(cfg.process, cpus=c, standby=cfg.process.standby and single,
                                                     cache=cfg.cache, retrieval=cfg.retrieval, scoring=cfg.scoring),
                                             build=build, start=False,
                                             expect=engines[0].version if engines else None)
                loading.made(engine)
                loading.at(f"the {cfg.engine} engine process" + ("" if single else f" of replica {i} of {len(cpus)}")
                           + f" loading {artifact}")
                engine.start()
                engines.append(engine)
            return engines[0] if single else EnginePool(engines)
        except BaseException:
            loading.abandon()  # (the ones started, and the one starting)
            raise
    if cfg.engine_replicas != 1:
        raise ValueError("serve.engine_replicas > 1 needs the engine in its own process (serve.engine_process = true)")
    loading.building_here(f"building the {cfg.engine} engine in this process from {artifact}")
    built = (build or make_engine)(cfg.engine, artifact, cfg.device, cfg.cache, cfg.retrieval, cfg.scoring)
    loading.made(built)  # (abandoned meanwhile: closed now, LoadAbandoned)
    if replica_cpus and replica_cpus[0] and isinstance(built, InProcessEngine):  # (not a builder's own kind)
        built.pin_to(tuple(replica_cpus[0]))
    return built


def kill_engine_processes() -> None:
    """Kills every engine child process this process still has (spawned by serve.worker)."""
    for child in mp.active_children():
        if child.name.startswith("genrec-engine"):
            child.kill()
            child.join(5)


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("closing the previous engine failed: %r", fut.exception())


def _scored(result: Result, tasks: tuple[str, ...]) -> list[pb.ScoredItem]:
    out = []
    for j in range(result.item_ids.size):
        item = pb.ScoredItem(item_id=int(result.item_ids[j]), score=float(result.scores[j]))
        # each source's score where that source retrieved the item (NaN: it did not)
        if result.retrieval_scores is not None and not math.isnan(result.retrieval_scores[j]):
            item.retrieval_score = float(result.retrieval_scores[j])
        if result.generative_scores is not None and not math.isnan(result.generative_scores[j]):
            item.generative_log_prob = float(result.generative_scores[j])
        for t in tasks:
            if t in result.tasks:
                item.tasks[t] = float(result.tasks[t][j])
        out.append(item)
    return out


class _TokenGate(grpc.aio.ServerInterceptor):
    """Admin's token, checked on a call's headers. A unary handler runs only once the request
    has arrived: without this, calls that sent headers and then nothing held Admin's 8 slots
    until their deadline and locked the operator out. A call without the token gets a handler
    that refuses at once without reading its request."""

    def __init__(self, server: RecommenderServer) -> None:
        self.server = server

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201 - grpc's interface
        try:
            self.server._check_token(details.invocation_metadata)
        except AdminError as e:
            name = details.method.rsplit("/", 1)[-1]
            name = name if name in self.server.admin_methods() else "unknown"  # (a bounded label)
            self.server.metrics.requests.labels(f"admin_{name}", e.code.name).inc()

            code, msg = e.code, bounded(str(e))

            async def refuse(_requests, context: grpc.aio.ServicerContext) -> bytes:  # noqa: ANN001
                await context.abort(code, msg)
                raise AssertionError("context.abort returned")  # (it raises: not reached)

            return grpc.stream_unary_rpc_method_handler(refuse)
        return await continuation(details)


class AdminError(Exception):
    """An Admin call refused: ``code`` is its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def bounded(message: str, limit: int = MAX_DETAIL) -> str:
    """An error detail of at most ``limit`` characters: details travel in gRPC metadata, whose
    size is capped (8 KB by default); a detail quoting a long request string would turn the
    intended status into RESOURCE_EXHAUSTED."""
    message = message.encode("ascii", "backslashreplace").decode()  # (gRPC percent-encodes the rest, up to 12x)
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _read_token(path: str) -> bytes:
    """The Admin token in ``path``, a file its owner alone may read or write: a token others
    can read is anyone's on this host (and one others can write, theirs to choose)."""
    mode = Path(path).stat().st_mode
    if mode & 0o077:
        raise ValueError(f"admin token file {path} is readable or writable by group or others (mode "
                         f"{stat.S_IMODE(mode):o}): run 'chmod 600 {path}' (serve.admin.token_file)")
    token = Path(path).read_bytes().strip()
    if len(token) < 16:
        raise ValueError(f"admin token file {path}: the token must be at least 16 characters")
    return token


def _credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    if not tls.enabled:
        return None
    if not (tls.cert and tls.key):
        raise ValueError("TLS needs both a certificate and a key (tls.cert, tls.key)")
    ca = Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials([(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


# a Unix socket's path has at most 107 bytes (sun_path)
MAX_SOCKET_PATH = 107


def private_folder() -> str:
    """A new folder (mode 0700) for the server's socket behind the front end: under the user's
    runtime folder where there is one (``$XDG_RUNTIME_DIR``: per user, not aged by /tmp's
    cleaners), else the temp folder, else /tmp where that path would be too long for a socket."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    for base in ([runtime] if runtime and os.path.isdir(runtime) else []) + [tempfile.gettempdir(), "/tmp"]:
        if len(os.fsencode(base)) + len("/genrec-front-XXXXXXXX/server.sock") <= MAX_SOCKET_PATH:
            return tempfile.mkdtemp(prefix="genrec-front-", dir=base)
    raise OSError("no folder short enough for the server's socket behind the front end")


def _bind(server: grpc.aio.Server, host: str, port: int | None, tls: TLSConfig) -> int:
    """Listen on ``host:port``, or on the address ``host`` (``unix:PATH``) where ``port`` is None."""
    creds = _credentials(tls)
    addr = host if port is None else f"{host}:{port}"
    bound = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind {addr}")
    return bound


def _server_options(c: ConnectionConfig, limits: Limits) -> list[tuple[str, int]]:
    """gRPC's options for the public listener. A message limit below what the request limits
    allow would refuse valid requests before they are read: a config error."""
    largest = limits.request_bytes()
    if c.max_message_bytes and c.max_message_bytes < largest:
        raise ValueError(f"serve.connections.max_message_bytes = {c.max_message_bytes} is less than the largest "
                         f"request the limits allow ({largest} bytes): raise it, or set 0 to derive it")
    ms = lambda s: int(s * 1000)  # noqa: E731
    return [("grpc.max_receive_message_length", c.max_message_bytes or largest + 1024),
            ("grpc.keepalive_time_ms", ms(c.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(c.keepalive_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(c.max_connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(c.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(c.max_connection_age_grace_s)),
            # clients may ping every 10 s without data; more often is abuse and closes the connection
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.server.max_pending_requests", c.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", c.max_pending_calls)]


class RecommenderServer:
    """Serves ``artifact`` (default: ``cfg.artifact``) on the engine ``cfg`` asks for, or on
    ``engine`` when one is handed in. ``replica_cpus``: the CPUs of each engine process, as
    ``genrec serve`` planned them from ``cfg.engine_cpus`` (() for each: not pinned); reloads
    keep them. ``build``: makes the engines (default: the kind ``cfg.engine`` names)."""

    def __init__(self, cfg: ServeConfig, artifact: str | Path | None = None, engine: Engine | None = None,
                 replica_cpus: Sequence[tuple[int, ...]] = (), build: EngineBuilder | None = None) -> None:
        artifact = str(artifact or cfg.artifact)
        if not artifact:
            raise ValueError("serve.artifact is empty: name the artifact folder to serve")
        self.cfg, self.artifact, self.replica_cpus, self.build = cfg, artifact, tuple(replica_cpus), build
        # the token first: a config error is refused before an engine starts
        self.admin_token = _read_token(cfg.admin.token_file) if cfg.admin.token_file else None
        if cfg.connections.front_end == "native" and cfg.tls.enabled:
            raise ValueError("serve.connections.front_end = 'native' does not terminate TLS yet: use aio or threads "
                             "with serve.tls, or TLS in a proxy of your own")
        self.engine: Engine = engine if engine is not None else open_engine(cfg, artifact, self.replica_cpus, build)
        self.owns_engine = engine is None  # an engine handed in is closed by whoever made it
        self.metrics = ServerMetrics()
        self.metrics.model.labels(self.engine.version, self.engine.name).set(1)
        self.server: grpc.aio.Server | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.batcher: Batcher | None = None
        self.shares = Shares(cfg.fair, cfg.connections.max_concurrent_rpcs)
        # the listener's kind of health servicer (the server awaits the same two coroutines of either)
        self.health: Health | health.aio.HealthServicer
        if cfg.connections.front_end == "threads":
            self.health = Health()
            self.health_servicer: Any = self.health.servicer
        else:
            self.health = self.health_servicer = health.aio.HealthServicer()
        self.port = self.admin_port = 0
        self.front: NativeFront | None = None  # connections.front_end = "native" (serve.proxy)
        self._private_dir = ""  # the folder of the server's socket behind the front end
        self._watch_front: asyncio.Task | None = None
        self._link: LinkListener | None = None  # the front end's calls (serve.link)
        self.artifact_root = Path(cfg.admin.artifact_root or Path(artifact).resolve().parent).resolve()
        self._reloading = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()  # replaced engines closing after their calls (reload)
        self._stopping = False
        self.stages: dict[str, float] = {"decode": 0.0, "encode_response": 0.0}
        self.served = 0

    # ----- lifecycle ------------------------------------------------------------------------
    async def start(self) -> int:
        batch = replace(self.cfg.batch, max_inflight=batch_inflight(self.cfg, self.engine))
        self.batcher = Batcher(lambda: self.engine, batch, self.metrics.on_batch)
        self.batcher.start()
        conn = self.cfg.connections
        kinds: dict[str, Kind] = {"Recommend": "recommend", "Retrieve": "retrieve", "Rank": "rank"}
        options = _server_options(conn, self.cfg.limits)
        grpc_server: Any  # what the services are registered on: grpc.aio.Server or grpc.Server
        if conn.front_end == "threads":  # (serve.frontend: why)
            listener = ThreadListener(options, conn.max_concurrent_rpcs, asyncio.get_running_loop())
            handlers = {m: grpc.unary_unary_rpc_method_handler(self._threaded(k, listener.loop))
                        for m, k in kinds.items()}
            self.server, grpc_server = cast(grpc.aio.Server, listener), listener.server
        else:
            self.server = grpc_server = grpc.aio.server(options=options,
                                                        maximum_concurrent_rpcs=conn.max_concurrent_rpcs)
            handlers = {m: grpc.unary_unary_rpc_method_handler(self._handler(k)) for m, k in kinds.items()}
        if conn.front_end != "native":  # (behind the native front end its calls come over serve.link alone)
            grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RECOMMENDER, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, grpc_server)
        names = (RECOMMENDER, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, grpc_server)
        try:
            if conn.front_end == "native":  # (serve.proxy) the server on a socket of its own behind it
                upstream = self._bind_private()
                calls = {f"/{RECOMMENDER}/{m}": k for m, k in kinds.items()}
                link = f"{self._private_dir}/calls.sock"  # (serve.link: the Recommender calls it passes on)
                self._link = await serve_link(link, self._outcome, calls)
                self.front = self._front(upstream, link)
            else:
                self.port = _bind(self.server, self.cfg.host, self.cfg.port, self.cfg.tls)
            if self.admin_token is not None:
                await self._start_admin()
            await self.server.start()
            if self.front is not None:
                self.port = await asyncio.get_running_loop().run_in_executor(None, self.front.start)
                self._watch_front = asyncio.get_running_loop().create_task(self._front_watchdog())
        except BaseException:  # (a port taken, a front end that did not listen: nothing left behind)
            if self.front is not None:
                self.front.stop(0)
            if self._link is not None:
                self._link.close()
            self._remove_private_dir()
            raise
        self._observe(self.engine)
        await self._set_health()
        if self.cfg.metrics_port:
            self.metrics.serve_http(self.cfg.metrics_port, self.cfg.host)
        quiet_gc()
        log.info("serving %s (%s engine) on %s:%d", self.engine.version, self.engine.name, self.cfg.host, self.port)
        return self.port

    def _bind_private(self) -> str:
        """The server's listener behind the native front end: a Unix socket in a folder only this
        user can enter. The server trusts the front end's word on each caller (CONTENTION_KEY),
        so nobody else may reach it: on a loopback port any local process could, past the front
        end's caps and with a word of its own."""
        self._private_dir = private_folder()
        address = f"unix:{self._private_dir}/server.sock"
        _bind(self.server, address, None, TLSConfig())
        return address

    def _remove_private_dir(self) -> None:
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = ""

    def _front(self, upstream: str, link: str) -> NativeFront:
        """The native front end on the public host and port, before the server at ``upstream``
        (gRPC: health, reflection) and ``link`` (its Recommender calls, serve.link)."""
        conn, fair = self.cfg.connections, self.cfg.fair
        return NativeFront(FrontPlan(
            host=self.cfg.host, port=self.cfg.port, upstream=upstream, link=link, max_in_flight=conn.max_in_flight,
            max_share=fair.max_share if fair.enabled else 0.0, active_s=fair.active_s, metadata_key=fair.metadata_key,
            max_message_bytes=conn.max_message_bytes or self.cfg.limits.request_bytes() + 1024,
            max_wait_ms=conn.max_wait_ms, nice=conn.front_nice))

    async def _front_watchdog(self) -> None:
        """The front end gone while serving: nothing reaches the server any more, so it stops
        (its supervisor restarts it) instead of reporting SERVING on a port nobody answers."""
        while not self._stopping:
            await asyncio.sleep(0.5)
            if self.front is not None and not self.front.alive and not self._stopping:
                log.error("the native front end exited (status %s): stopping", self.front.proc and
                          self.front.proc.returncode)
                await self.stop(0)
                return

    async def _start_admin(self) -> None:
        a = self.cfg.admin
        # no SO_REUSEPORT: a port another listener holds (the public one) fails here, where gRPC's
        # default would share it and hand public callers to Admin
        self.admin_server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 10),
                                                     ("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=8,
                                            interceptors=[_TokenGate(self)])
        admin = {name: grpc.unary_unary_rpc_method_handler(self._admin(name, method))
                 for name, method in self.admin_methods().items()}
        self.admin_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ADMIN, admin),))
        self.admin_port = _bind(self.admin_server, a.host, a.port, a.tls if a.tls.enabled else self.cfg.tls)
        await self.admin_server.start()
        log.info("admin on %s:%d (token required; loads under %s)", a.host, self.admin_port, self.artifact_root)

    def _observe(self, engine: Engine) -> None:
        """Health follows the engine: an engine with a standby reports when no process of it can
        answer (``available``); hooks come from its threads, so they hop onto the loop."""
        loop = asyncio.get_running_loop()
        engine.on_state(lambda _ok: loop.call_soon_threadsafe(lambda: loop.create_task(self._set_health())))

    async def _set_health(self) -> None:
        if self._stopping:
            return
        ok = self.engine.available  # (the current engine: a hook of a replaced one does no harm)
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        self.metrics.engine_available.set(1 if ok else 0)
        for svc in ("", RECOMMENDER):
            await self.health.set(svc, status)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful and bounded: NOT_SERVING, refuse new calls, let calls in flight finish (up to
        ``grace``), then stop the engines. A load in progress is abandoned (its engine stopped);
        nothing here waits without a limit, so a shutdown always completes."""
        grace = self.cfg.grace_s if grace is None else grace
        self._stopping = True
        await self.health.enter_graceful_shutdown()
        if self.admin_server:
            await self.admin_server.stop(0)
        if self.front is not None:  # it stops taking calls and lets those it passed on finish
            await asyncio.get_running_loop().run_in_executor(None, self.front.stop, grace)
        if self._link is not None:
            self._link.close()
        if self.batcher:
            await self.batcher.drain(grace)
        if self.server:
            await self.server.stop(grace)
        self._remove_private_dir()
        if self.owns_engine:
            try:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.engine.close), grace + 5)
            except TimeoutError:
                log.error("the engine did not close in %.0fs", grace + 5)
        if self.owns_engine:
            kill_engine_processes()  # whatever is left: a load's engine still starting, a stuck child

    async def wait(self) -> None:
        if self.server:
            await self.server.wait_for_termination()

    async def reload(self, path: str, timeout: float | None = None, expect: str | None = None) -> str:
        """Loads ``path`` off the event loop, then swaps it in between batches. One load at a
        time (another is refused, not queued); a load runs to its end even if its caller goes
        away, and a server that stops meanwhile closes the new engine instead of serving it.
        The whole engine start is bounded by ``timeout`` (default ``admin.load_timeout_s``):
        past it, what started is stopped (``serve.loading``) and AdminError DEADLINE_EXCEEDED
        names the step that hung; the next load is taken. The engine replaced keeps the calls
        already validated against its schema, and closes once they are done (``_retire``).
        ``expect``: the model_version the caller checked at ``path``; an engine that loaded
        another (the folder changed between the check and the load) is closed, not served."""
        if self._reloading.locked():
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, "another LoadArtifact is in progress; retry after it")
        async with self._reloading:
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            kind = self.engine.name  # (an engine handed in: the same kind again)
            cfg = replace(self.cfg, engine=cast(EngineKind, kind)) if kind in get_args(EngineKind) else self.cfg
            timeout = self.cfg.admin.load_timeout_s if timeout is None else timeout
            loading = Loading()
            started = loading.run(loop, open_engine, cfg, path, self.replica_cpus, self.build, loading)
            try:
                engine = await asyncio.wait_for(asyncio.shield(started), max(timeout, 0.0))
            except TimeoutError:
                step = loading.step
                await loop.run_in_executor(None, loading.abandon)
                raise AdminError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the load did not finish within serve.admin.load_timeout_s ({self.cfg.admin.load_timeout_s:g} s) "
                                 f"at the step: {step}; it was stopped, {self.engine.version} still serves") from None
            if self._stopping:
                loop.run_in_executor(None, engine.close).add_done_callback(_log_failure)
                raise ShuttingDown("the server is shutting down; the new artifact was not swapped in")
            if expect is not None and engine.version != expect:
                loop.run_in_executor(None, engine.close).add_done_callback(_log_failure)
                raise AdminError(grpc.StatusCode.ABORTED,
                                 f"path: the artifact changed between its check ({expect}) and its load "
                                 f"({engine.version}); not served, {self.engine.version} still serves")
            old, self.engine, self.artifact = self.engine, engine, path
            self._observe(engine)
            await self._set_health()
            self.metrics.model.labels(old.version, old.name).set(0)
            self.metrics.model.labels(engine.version, engine.name).set(1)
            if self.owns_engine:  # e.g. an engine process: stops once the calls validated for it are done
                task = loop.create_task(self._retire(old))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
            self.owns_engine = True
            quiet_gc()
            log.info("loaded %s in %.1fs", engine.version, time.monotonic() - t0)
            return engine.version

    async def _retire(self, old: Engine) -> None:
        """Closes a replaced engine once the batcher holds no call for it: each call runs on the
        engine whose schema it was validated against (the swap's schema race: a call decoded
        for the old model never runs on the new one) and carries that engine's version. Bounded:
        by then every such call has passed its deadline (at most ``limits.max_deadline_ms``)."""
        if self.batcher is not None:
            await self.batcher.retire(old, self.cfg.limits.max_deadline_ms / 1e3 + self.cfg.grace_s)
        await asyncio.get_running_loop().run_in_executor(None, old.close)

    # ----- handlers -------------------------------------------------------------------------
    def _handler(self, kind: Kind):  # noqa: ANN202 - an async gRPC handler
        async def handle(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            code, out = await self._outcome(kind, data, context)
            if code == grpc.StatusCode.OK:
                return out
            await context.abort(code, out)
            raise AssertionError("context.abort returned")  # (it raises: not reached)

        return handle

    async def _outcome(self, kind: Kind, data: bytes, context: Any,
                       caller: str | None = None) -> tuple[grpc.StatusCode, Any]:
        """One call, served: (OK, the response's bytes) or (its status, a bounded message). On
        the event loop, whichever listener took the call (``context``: its servicer context;
        ``caller``: whose share the thread-pool listener took for it)."""
        t0 = time.monotonic()
        code = grpc.StatusCode.OK
        try:
            return code, await self._serve(kind, data, context, t0, caller)
        except InvalidRequest as e:  # INVALID_ARGUMENT, or what the class says (ModelCannot)
            code, msg = grpc.StatusCode[e.status], str(e)
        except Overloaded as e:
            code, msg = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except (DeadlineExceeded, TimeoutError):
            code, msg = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the request was served"
        except (ShuttingDown, EngineProcessError) as e:  # (an engine that died: retry)
            code, msg = grpc.StatusCode.UNAVAILABLE, str(e)
        except WorkFailed as e:  # the engine computed the rest of the batch and goes on
            log.error("%s failed: %s", kind, e)
            code, msg = grpc.StatusCode.INTERNAL, str(e)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            log.exception("%s failed", kind)
            code, msg = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
        finally:
            self.metrics.requests.labels(kind, code.name).inc()
            self.metrics.latency.labels(kind).observe(time.monotonic() - t0)
        return code, bounded(msg)

    async def _serve(self, kind: Kind, data: bytes, context: Any, t0: float, caller: str | None = None) -> bytes:
        remaining = context.time_remaining()
        # no deadline: None on the aio server, ~9e18 s (gRPC's infinite future) on the thread-pool one
        none = remaining is None or not math.isfinite(remaining) or remaining > NO_DEADLINE_S
        budget = self.cfg.default_timeout_ms / 1e3 if none else remaining
        budget = min(budget, self.cfg.limits.max_deadline_ms / 1e3)  # clamped, not refused: we just won't hold it longer
        deadline = t0 + budget
        batcher = self.batcher
        if batcher is None:
            raise ShuttingDown("the server has not started")
        share = caller is None  # (else taken, and released, on the thread-pool listener's handler thread)
        if caller is None:
            caller = self._caller(context)
            self._take_share(caller)  # its share of the server and its quota, then the server's admission
        try:
            # behind the native front end, how the caller stands is the front end's word: it sees
            # every call, the server only those let through (a flood held to its places there
            # looked no heavier than a quiet caller's burst here)
            contended = self._contention(context) if self.front is not None else self.shares.contended(caller)
            # before decoding: a refusal costs next to nothing
            batcher.admit(deadline, caller, contended)
            return await self._run(kind, data, batcher, deadline, caller, t0)
        finally:
            if share:
                self.shares.release(caller)

    def _contention(self, context: Any) -> float | None:
        """Behind the native front end, its judgement of the caller (CONTENTION_KEY) as
        ``Shares.contended`` gives it: ``max_share`` heavy, ``0.0`` light, None alone. Only the
        front end reaches this server (its private socket) and it drops a client's own value."""
        for k, v in context.invocation_metadata() or ():
            if k == CONTENTION_KEY:
                return self.cfg.fair.max_share if v == "heavy" else 0.0 if v == "light" else None
        return None

    def _caller(self, context: Any) -> str:
        return caller_of(context.invocation_metadata(), context.peer(), self.cfg.fair.metadata_key)

    def _take_share(self, caller: str) -> None:
        """The caller's share (serve.admission.Shares), or Overloaded naming it (counted)."""
        try:
            self.shares.acquire(caller)
        except Overloaded:
            self.metrics.refused_callers.labels(self.shares.label(caller)).inc()
            raise

    def _threaded(self, kind: Kind, loop: asyncio.AbstractEventLoop) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """The thread-pool listener's handler (serve.frontend), on one of its threads: a caller
        past its share is refused here, without the event loop (which may be what is busy); the
        others are served by the same coroutine as on the aio listener, on the loop."""
        def handle(data: bytes, context: grpc.ServicerContext) -> bytes:
            caller = self._caller(context)
            try:
                self._take_share(caller)
            except Overloaded as e:
                self.metrics.requests.labels(kind, "RESOURCE_EXHAUSTED").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(str(e)))
            try:
                code, out = asyncio.run_coroutine_threadsafe(self._outcome(kind, data, context, caller), loop).result()
            finally:
                self.shares.release(caller)
            if code == grpc.StatusCode.OK:
                return out
            context.abort(code, out)
            raise AssertionError("context.abort returned")  # (it raises: not reached)

        return handle

    async def _run(self, kind: Kind, data: bytes, batcher: Batcher, deadline: float, caller: str, t0: float) -> bytes:
        engine = self.engine
        work = decode(kind, data, engine.schema, self.cfg.limits)
        decoded = time.monotonic()
        self.stages["decode"] += decoded - t0
        work.deadline = deadline
        self.metrics.queue_depth.set(batcher.depth)
        result = await batcher.submit(work, timeout=max(work.deadline - time.monotonic(), 0), caller=caller,
                                      engine=engine)
        started = result.started or result.sent  # when the engine began the batch
        timing = pb.Timing(queue_ms=(time.monotonic() - t0) * 1e3 - result.compute_ms,
                           compute_ms=result.compute_ms, batch_size=result.batch_size,
                           decode_ms=(decoded - t0) * 1e3, wait_ms=max(started - decoded, 0.0) * 1e3,
                           handoff_ms=max((result.back - started) * 1e3 - result.compute_ms, 0.0))
        self.metrics.compute.observe(result.compute_ms / 1e3)
        self.metrics.on_result(result)
        t1 = time.monotonic()
        items = _scored(result, engine.schema.tasks)
        cls: Any = {"recommend": pb.RecommendResponse, "retrieve": pb.RetrieveResponse, "rank": pb.RankResponse}[kind]
        out = cls(items=items, model_version=engine.version, timing=timing).SerializeToString()
        self.stages["encode_response"] += time.monotonic() - t1
        self.served += 1
        return out

    def profile(self) -> dict[str, object]:
        """Seconds per stage since start (server side + the engine's), and calls served."""
        return {"served": self.served, "stages_s": {**self.stages, **self.engine.stages}}

    # ----- Admin ----------------------------------------------------------------------------
    def admin_methods(self) -> dict[str, Callable]:
        """Admin's methods by name: its handlers, and the metrics' bounded set of labels."""
        return {"LoadArtifact": self._load_artifact, "GetModelInfo": self._model_info}

    def _admin(self, name: str, method):  # noqa: ANN001, ANN202 - an async gRPC handler
        """An Admin method, taking raw bytes (so a malformed message is INVALID_ARGUMENT, not
        gRPC's UNKNOWN) and mapping every failure to a status. The token was checked on the
        call's headers before it got here (_TokenGate, Admin's only way in)."""

        async def handle(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            code, msg = grpc.StatusCode.OK, ""
            try:
                return (await method(data, context)).SerializeToString()
            except AdminError as e:
                code, msg = e.code, str(e)
            except OutsideRoot as e:  # (an ArtifactError: before the catch-all of those)
                code, msg = grpc.StatusCode.PERMISSION_DENIED, f"artifact: {e}"
            except InvalidRequest as e:
                code, msg = grpc.StatusCode.INVALID_ARGUMENT, str(e)
            except ArtifactError as e:
                code, msg = grpc.StatusCode.FAILED_PRECONDITION, f"artifact: {e}"
            except ShuttingDown as e:
                code, msg = grpc.StatusCode.UNAVAILABLE, str(e)
            except (EngineProcessError, OSError) as e:
                code, msg = grpc.StatusCode.FAILED_PRECONDITION, f"the artifact could not be loaded: {e}"
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:  # noqa: BLE001 - a bad artifact must not take the server down
                log.exception("Admin.%s failed", name)
                code, msg = grpc.StatusCode.FAILED_PRECONDITION, f"the artifact could not be loaded: {type(e).__name__}: {e}"
            finally:
                self.metrics.requests.labels(f"admin_{name}", code.name).inc()
            await context.abort(code, bounded(msg))
            raise AssertionError("context.abort returned")  # (it raises: not reached)

        return handle

    def _check_token(self, metadata: Any) -> None:
        """Raises AdminError unless ``metadata`` carries ``authorization: Bearer <the token>``."""
        sent = [v for k, v in (metadata or ()) if k == "authorization"]
        if not sent:
            raise AdminError(grpc.StatusCode.UNAUTHENTICATED, "Admin needs 'authorization: Bearer <token>' metadata")
        value = sent[0].encode() if isinstance(sent[0], str) else sent[0]
        token = self.admin_token
        if token is None or not (value.startswith(b"Bearer ") and hmac.compare_digest(value[7:], token)):
            raise AdminError(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")

    def resolve_artifact(self, path: str) -> Path:
        """``path`` (absolute, or relative to the artifact root) resolved, symlinks and ``..``
        included, and checked to lie below the artifact root."""
        if not path:
            raise InvalidRequest("path: is empty; name an artifact folder")
        if len(path) > MAX_PATH or "\0" in path:
            raise InvalidRequest(f"path: longer than {MAX_PATH} characters or not a path")
        try:
            resolved = (self.artifact_root / path).resolve()
        except (OSError, RuntimeError, ValueError) as e:
            raise InvalidRequest(f"path: cannot be resolved ({type(e).__name__})") from None
        if not resolved.is_relative_to(self.artifact_root):
            raise AdminError(grpc.StatusCode.PERMISSION_DENIED,
                             f"path: outside the artifact root {self.artifact_root}; loads are allowed below it only")
        return resolved

    async def _load_artifact(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.LoadArtifactResponse:
        from genrec.serve.catalogue import version_of

        t0 = time.monotonic()
        req = parse(pb.LoadArtifactRequest, data)
        path = self.resolve_artifact(req.path)
        loop = asyncio.get_running_loop()
        timeout = self.cfg.admin.load_timeout_s
        # the cheap checks (stat calls, a bounded JSON read) before any engine starts: a wrong
        # path costs milliseconds, not an engine process; every file must resolve below the root
        # (a symlinked file is followed: one pointing out of the root is refused)
        try:
            checked = await asyncio.wait_for(loop.run_in_executor(None, check_artifact, path, self.artifact_root),
                                             min(timeout, 30.0))
        except TimeoutError:
            raise AdminError(grpc.StatusCode.DEADLINE_EXCEEDED, "path: the artifact check did not finish in time") from None
        # the engine start gets what is left of load_timeout_s (bounded inside reload); the engine
        # must hold the model checked here (the folder may change after its check: the engine
        # re-opens it, and a model of another content is not served)
        version = await asyncio.shield(self.reload(str(path), timeout - (time.monotonic() - t0), version_of(checked)))
        return pb.LoadArtifactResponse(model_version=version, load_seconds=time.monotonic() - t0)

    async def _model_info(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        parse(pb.GetModelInfoRequest, data)
        e = self.engine
        s = e.schema
        q = e.manifest.quantization
        return pb.ModelInfo(model_version=e.version, artifact_path=self.artifact, tower=e.tower,
                            tasks=list(s.tasks), context_features=list(s.embedding.pooled_features),
                            catalogue_size=s.catalogue_size, max_history=s.max_history, engine=e.name,
                            embeddings=q.get("embeddings", ""), dense=q.get("dense", ""),
                            generative=s.generative, semantic_id_sizes=list(s.sid_sizes), default_beam=s.beam_width,
                            max_beam=self.cfg.limits.max_beam, dense_search=s.dense_search,
                            replicas=[pb.EngineReplica(role=r.role, state=r.state, model_version=r.version, pid=r.pid,
                                                       detail=bounded(r.detail)) for r in e.replica_states()])
