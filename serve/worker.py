"""An engine in its own process, behind the gRPC front-end.

In one process the engine thread and the front-end (asyncio loop, gRPC callbacks, request
decoding and response encoding) share one GIL: every torch op boundary of a batch may wait
for a handler, and every handler for the batch's Python between ops. ``EngineProcess``
moves the engine into a child process with its own interpreter; the front-end keeps
batching (``serve.batcher``) and hands each batch over a pipe::

    front-end process                          engine process (spawned)
    Batcher -> EngineProcess.run(works) --pickle--> engine.run(works)
            <-- results | the engine's exception --

It stands in for the engine object the server holds (the engine contract,
``serve.contract.Engine``), so batching, deadlines, reload and metrics are unchanged. A batch
costs two pipe transfers of its validated arrays. From the event
loop, batches pipeline (``run_async``): the child takes them in order, the next already in
its pipe when one finishes. If the child dies, the batches in flight fail (INTERNAL) and the
next batch starts a new child; with a warm standby (``serve.failover.FailoverEngine``, what
``open_engine_process`` builds by default) a second child of the artifact, loaded and idle,
takes over at once and the batches in flight run again on it.

This module knows one process; ``serve.failover`` composes several (standby, replicas).
The child builds its engine with ``serve.factory``, never through the server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_handles
from typing import Any, Literal

from genrec.quant.artifact import Manifest
from genrec.serve.ann import RetrievalConfig
from genrec.serve.contract import EngineBuilder, ReplicaState, Result, run_stamped
from genrec.serve.kvcache import CacheConfig
from genrec.serve.requests import ModelSchema, Work
from genrec.serve.scoring import ScoringConfig

log = logging.getLogger("genrec.serve")


@dataclass(frozen=True)
class ProcessSettings:
    threads: int = 0  # torch intra-op threads in the child (0: torch's default)
    # torch.set_float32_matmul_precision, in the engine process and (genrec serve) the front-end.
    # highest (torch's default) for serving on CPU: lower ones hand fp32 GEMMs to oneDNN, which
    # builds a kernel per new shape, and serving batches change shape every call
    matmul_precision: Literal["highest", "high", "medium"] = "highest"
    cpus: tuple[int, ...] = ()  # pin the engine process to these CPUs (empty: the server's)
    # after each request, poll the pipe this long before blocking on it: the next batch finds the
    # process running (no wake-up of an idle CPU) at the price of that CPU's time (0: block at once)
    poll_ms: float = 0.0
    # a batch (or control call) the child has not answered in this long: the child is killed, what
    # it had fails (INTERNAL) and the next batch starts a new one, so a hung engine cannot stall
    # the server for good
    hang_s: float = 30.0
    # a child that has not loaded the artifact in this long (e.g. a hung network file system) is
    # killed and the start fails, so neither a start nor a shutdown waits for it forever
    start_timeout_s: float = 120.0
    # open_engine_process: a second process of the artifact, loaded and idle, takes over at once when
    # the engine dies (FailoverEngine); costs one more engine's memory. EngineProcess ignores it.
    standby: bool = True
    # nonzero: the process starts at idle priority (SCHED_IDLE; a standby loading beside a serving
    # engine, so its load does not slow the calls being served); back to normal when it takes over
    nice: int = 0
    # the engine's K/V cache and history window ([serve.cache], set per process by the server like cpus)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # the catalogue search ([serve.retrieval], set per process by the server like cache)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)  # ([serve.scoring], set like cache)


def plan_cpus(spec: str, threads: int, available: tuple[int, ...],
              replicas: int = 1) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(CPUs of each engine replica, front-end CPUs) for ``serve.engine_cpus``; an empty tuple
    leaves a process where the OS puts it.

    ``auto``: with a fixed thread count per engine, each replica owns ``threads`` CPUs
    taken from the end of ``available``; when CPUs are left over the front-end (asyncio loop,
    gRPC threads, decoding) keeps them, so neither evicts the other's caches or waits behind
    it for a core, else the front-end floats (replicas then still get a CPU each). No
    pinning when the replicas need more CPUs than there are, when one engine would own
    them all, or with torch's default thread count. ``none``: no pinning. A list
    (``1``, ``2,3``): the engines there, split evenly between the replicas, and the
    front-end on the other available CPUs."""
    spec = spec.strip().lower()
    none: tuple[list[tuple[int, ...]], tuple[int, ...]] = ([()] * replicas, ())
    if spec in ("", "none"):
        return none
    cpus = sorted(available)
    if spec == "auto":
        need = replicas * threads
        if threads < 1 or need > len(cpus) or (replicas == 1 and need == len(cpus)):
            return none  # (one engine on every CPU: nothing to separate)
        engine = cpus[len(cpus) - need:]
    else:
        try:
            engine = sorted({int(c) for c in spec.split(",")})
        except ValueError:
            raise ValueError(f"serve.engine_cpus: '{spec}' is not auto, none or a list of CPU numbers") from None
        missing = set(engine) - set(cpus)
        if missing:
            raise ValueError(f"serve.engine_cpus: CPU {sorted(missing)} not available to this process "
                             f"(available: {cpus})")
        if len(engine) % replicas:
            raise ValueError(f"serve.engine_cpus: {len(engine)} CPUs do not split evenly between {replicas} replicas")
    per = len(engine) // replicas
    # the last CPUs go to the first replica: with one replica it owns the last CPUs
    groups = [tuple(engine[len(engine) - (i + 1) * per: len(engine) - i * per]) for i in range(replicas)]
    return groups, tuple(c for c in cpus if c not in engine)


STANDBY_NICE = 10


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or was closed."""


class EngineDied(EngineProcessError):
    """The engine process died (or was killed as hung) with the batch in it: the batch did not
    fail on its own account, so it may run again on another engine process."""


class ModelChanged(EngineProcessError):
    """An engine process loaded another model (``found``, its version) than the one its engine
    serves under its version label (the artifact changed on disk since): it was stopped, and
    serves nothing."""

    def __init__(self, message: str, found: str = "") -> None:
        super().__init__(message)
        self.found = found


def _exit_with_parent() -> None:
    """Ends this (child) process when its parent process ends, however it ends (SIGKILL too).

    It waits on the parent sentinel multiprocessing gives every spawned child (the read end of a
    pipe whose write end only the parent holds: the kernel closes it when the parent exits), in a
    daemon thread blocked in poll(): no CPU, no periodic wake-up. Not PR_SET_PDEATHSIG: that fires
    when the parent *thread* that spawned the child exits, and engine processes are spawned from
    executor and standby threads that may end long before the server does; it is Linux-only too.
    The price: the thread needs the GIL to exit, so a child stuck in C code holding the GIL
    outlives its parent (the main thread's own EOF on the pipe does not help there either)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def wait() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=wait, name="genrec-exit-with-parent", daemon=True).start()


def _child(conn: Connection, kind: str, artifact: str, device: str, settings: ProcessSettings,
           build: EngineBuilder | None) -> None:
    import signal

    _exit_with_parent()  # first: loading (imports included) can take long, and can hang
    if settings.nice:  # a standby loading beside a serving engine: idle priority (threads started
        _background(0)  # later, torch's pool too, inherit it); the CPU's idle time is enough to load

    import torch

    from genrec.serve.factory import make_engine, quiet_gc

    # Ctrl-C reaches the whole process group: the front-end drains and then stops this
    # process itself, so the batches it still sends must find it alive.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if settings.cpus:
        os.sched_setaffinity(0, settings.cpus)

    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.set_float32_matmul_precision(settings.matmul_precision)
    try:
        engine = (build or make_engine)(kind, artifact, device, settings.cache, settings.retrieval, settings.scoring)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", e))
        return
    quiet_gc()
    conn.send(("ready", {"name": engine.name, "version": engine.version, "schema": engine.schema,
                         "manifest": engine.manifest, "tower": engine.tower, "path": engine.path}))
    poll_s = settings.poll_ms / 1e3
    served = False  # no spinning before the first request: a standby idles blocked on its pipe
    while True:
        if poll_s > 0 and served:  # busy-poll: a blocking recv would let this CPU go idle between batches
            end = time.monotonic() + poll_s
            while not conn.poll(0) and time.monotonic() < end:
                pass
        served = True
        try:
            op, payload = conn.recv()
        except EOFError:  # the parent went away
            return
        if op == "stop":
            conn.send(("ok", None))
            return
        if op == "stages":
            conn.send(("ok", dict(engine.stages)))
            continue
        try:
            conn.send(("ok", run_stamped(engine, payload)))
        except Exception as e:  # noqa: BLE001 - every caller of the batch gets it
            try:
                conn.send(("raise", e))
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                conn.send(("raise", RuntimeError(f"{type(e).__name__}: {e}")))


class EngineProcess:
    """The engine ``kind`` for ``artifact``, run in a spawned child process.

    ``start=False``: the child is started by :meth:`start`, so another thread holding the object
    can cancel a start in progress with :meth:`close`. ``restart=False``: a dead child is not
    replaced by the next batch, which fails with :class:`EngineDied` instead (for an owner that
    replaces engines itself, :class:`FailoverEngine`). ``build``: makes the engine in the child
    (default: ``serve.factory.make_engine``).

    One model per version label: ``expect`` (default: whatever the first start loads) is the
    version every start must load. A start (a restart after a crash too) that finds another
    model at ``artifact`` stops that child and raises :class:`ModelChanged`; the engine is then
    ``refused``: not available, every batch fails at once (UNAVAILABLE), no more restarts,
    until the server loads the new artifact (Admin.LoadArtifact) in its place."""

    def __init__(self, kind: str, artifact: str, device: str = "cpu",
                 settings: ProcessSettings | None = None, start: bool = True, restart: bool = True,
                 build: EngineBuilder | None = None, expect: str | None = None) -> None:
        self.kind, self.artifact, self.device, self.build = kind, str(artifact), device, build
        self.expect = expect
        self.refused = self.found = ""  # why a start was refused (ModelChanged), and the model it found
        self._hooks: list[Callable[[bool], object]] = []
        self.settings = settings or ProcessSettings()
        self.restart = restart
        self.lock = threading.Lock()  # held by a control call, a thread's batch, or the loop's pipelined batches
        self._pending: collections.deque[asyncio.Future] = collections.deque()  # run_async's batches, in send order
        self.restarts = 0
        self.closed = False
        self._last_stages: dict[str, float] = {}
        # close() against a start in progress: _closing stops one about to spawn, _starting says
        # there is a child to kill (whose EOF ends the start's wait); _guard orders the two
        self._guard = threading.Lock()
        self._closing = self._starting = False
        self.proc: mp.process.BaseProcess | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Starts the child and waits (at most ``settings.start_timeout_s``) until it has loaded
        the artifact. Raises EngineProcessError when it could not, timed out (the child is
        killed) or was cancelled by :meth:`close`; the child's own error (a bad artifact) as is."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch thread pools inherited by fork
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, self.kind, self.artifact, self.device, self.settings, self.build),
                           name=f"genrec-engine-{self.kind}", daemon=True)
        with self._guard:
            if self._closing:
                conn.close()
                child.close()
                raise EngineProcessError(f"engine process for {self.artifact} was closed before it started")
            self.conn, self.proc, self._starting = conn, proc, True
            proc.start()
            if self.settings.nice and proc.pid is not None:  # idle from its first instruction: a spawned
                _background(proc.pid)  # child imports torch and unpickles its arguments before _child runs
        child.close()
        try:
            tag, body = self._await_ready()
            if tag == "ready" and self.expect is not None and body["version"] != self.expect:
                self._refuse(body["version"])  # (still "starting": a close() meanwhile kills the child, pipe untouched)
        except BaseException:
            conn.close()
            raise
        finally:
            with self._guard:
                self._starting = False
        if tag == "error":
            self.process.join(5)
            raise body
        meta: dict[str, Any] = body
        self.expect = meta["version"]
        self.name: str = meta["name"]
        self.version: str = meta["version"]
        self.schema: ModelSchema = meta["schema"]
        self.manifest: Manifest = meta["manifest"]
        self.tower: str = meta["tower"]
        self.path: str | None = meta.get("path")  # how the engine runs the tower (TorchEngine.path)

    def _refuse(self, found: str) -> None:
        """The child loaded the model ``found``, not ``expect``: it is stopped (bounded: killed if
        it does not stop), the engine serves nothing more, and ModelChanged raised."""
        self.found = found
        self.refused = (f"{self.artifact} now holds the model {found}, not {self.expect} that this engine serves: "
                        "that process was stopped; load the new artifact with Admin.LoadArtifact")
        try:
            self.conn.send(("stop", None))
            self.process.join(5)
        except (OSError, EOFError):  # (killed meanwhile by close())
            pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        log.error("%s", self.refused)
        for hook in list(self._hooks):
            hook(False)
        raise ModelChanged(self.refused, found)

    @property
    def process(self) -> mp.process.BaseProcess:
        """The child process (:meth:`start` made it; EngineProcessError before)."""
        if self.proc is None:
            raise EngineProcessError(f"the engine process for {self.artifact} was never started")
        return self.proc

    def _await_ready(self) -> tuple[str, Any]:
        """The child's first message, within ``start_timeout_s``. A child that exits (or is
        killed by close()) closes its end of the pipe: the wait ends at once on the EOF."""
        timeout = self.settings.start_timeout_s
        if not self.conn.poll(timeout):
            self.process.kill()
            self.process.join(5)
            raise EngineProcessError(f"engine process did not load {self.artifact} in {timeout:g}s "
                                     "(start_timeout_s) and was killed")
        try:
            return self.conn.recv()
        except (EOFError, OSError):  # (a reset, not an EOF, when the child died with bytes unread)
            self.process.join(5)
            if self._closing:
                raise EngineProcessError(f"engine process loading {self.artifact} was stopped: "
                                         "closed while it started") from None
            raise EngineProcessError(f"engine process exited while loading {self.artifact} "
                                     f"(exit code {self.process.exitcode})") from None

    @property
    def _then(self) -> str:
        return "; the next batch starts a new one" if self.restart else ""

    def _call(self, op: str, payload: Any = None) -> Any:  # noqa: ANN401 - the op's reply
        with self.lock:
            if self.closed:
                raise EngineProcessError("the engine process was closed")
            if self.refused:
                raise ModelChanged(self.refused, self.found)
            if not self.process.is_alive():
                if not self.restart:
                    raise EngineDied(f"engine process died (exit code {self.process.exitcode})")
                self.restarts += 1
                self.start()
            tag, body = self._exchange(op, payload, timeout=self.settings.hang_s)
        if tag == "raise":
            raise body
        return body

    def _exchange(self, op: str, payload: Any = None, timeout: float | None = None) -> tuple[str, Any]:
        """One request and its reply on the pipe (the caller holds the lock); ``timeout``:
        how long to wait for the reply (None: as long as it takes). A child that does not answer
        in time is killed (its late reply would otherwise answer the next request)."""
        try:
            self.conn.send((op, payload))
            if timeout is not None and not self.conn.poll(timeout):
                self.process.kill()
                self.process.join(1)
                raise EngineDied(f"engine process did not answer '{op}' in {timeout:g}s and was killed{self._then}")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join(1)
            raise EngineDied(f"engine process died (exit code {self.process.exitcode}){self._then}") from None

    # ----- the engine contract (serve.contract.Engine) -----------------------------------------
    batches_together = False  # one batch at a time in the child (more wait in its pipe)
    parallel = 1

    @property
    def available(self) -> bool:
        """Open: a dead child is replaced by the next batch (``restart``), so a batch can be
        answered unless the process was closed or a restart found another model (``refused``)."""
        return not self.closed and not self.refused

    def on_state(self, hook: Callable[[bool], object]) -> None:
        """``hook(False)`` when a restart is refused (another model on disk): ``available``
        changes by that and by :meth:`close` only (a FailoverEngine, which replaces processes
        itself, reports its own)."""
        self._hooks.append(hook)

    def run(self, works: list[Work]) -> list[Result]:
        return self._call("run", works)

    def replica_states(self) -> list[ReplicaState]:
        return [self.state("process")]

    def state(self, role: str) -> ReplicaState:
        """This process as GetModelInfo reports it, in ``role``."""
        pid = (self.proc.pid or 0) if self.proc is not None else 0
        if self.refused:
            return ReplicaState(role, "refused", self.found, pid, self.refused)
        if self.closed:
            return ReplicaState(role, "closed", self.expect or "", pid)
        if self._starting or self.proc is None or self.expect is None:
            return ReplicaState(role, "loading", self.expect or "", pid)
        if not self.process.is_alive():
            return ReplicaState(role, "dead", self.expect, pid, f"exit code {self.process.exitcode}"
                                + ("; the next batch starts a new one" if self.restart else ""))
        return ReplicaState(role, "ready", self.expect, pid)

    async def run_async(self, works: list[Work]) -> list[Result]:
        """``run`` from the event loop without a thread: the batch is sent from the loop and the
        replies read when the pipe turns readable, which saves the executor thread's two wake-ups
        per batch. Batches pipeline: more are sent while one computes (the child takes them in
        order), so the engine starts the next the moment one is done instead of waiting for the
        front-end to collect those results and send more (the batcher's ``max_inflight``). A
        control call holding the pipe, a dead child (restarted in ``run``) or a loop without
        ``add_reader`` go through ``run`` in a thread."""
        loop = asyncio.get_running_loop()
        if self.refused:
            raise ModelChanged(self.refused, self.found)
        if self.closed or not self.process.is_alive():
            if not self.closed and not self.restart:  # nothing for a thread to do but fail
                raise EngineDied(f"engine process died (exit code {self.process.exitcode})")
            return await loop.run_in_executor(None, self.run, works)
        if not self._pending:  # the pipeline is idle: it takes the pipe until its last reply is in
            if not self.lock.acquire(blocking=False):
                return await loop.run_in_executor(None, self.run, works)
            try:
                loop.add_reader(self.conn.fileno(), self._replies, loop)
            except NotImplementedError:  # e.g. the Windows proactor loop
                self.lock.release()
                return await loop.run_in_executor(None, self.run, works)
            # uvloop (libuv) turns a watched fd non-blocking and leaves it so; the Connection's
            # reads and writes expect a blocking one: a reply read while the child was still
            # writing it, or a batch larger than the socket's buffer, failed with EAGAIN mid-message
            # (the batch failed as a dead engine, and the stream after it was garbage)
            os.set_blocking(self.conn.fileno(), True)
        reply = loop.create_future()
        self._pending.append(reply)
        try:
            self.conn.send(("run", works))
        except (BrokenPipeError, ConnectionResetError):
            self._died(loop)
        # a caller that gives up (cancelled) leaves its reply to be read and dropped in turn; a
        # reply still unread after hang_s means a hung child
        watchdog = loop.call_later(self.settings.hang_s, self._watchdog, loop, reply)
        try:
            tag, body = await reply
        finally:
            watchdog.cancel()
        if tag == "raise":
            raise body
        return body

    def _replies(self, loop: asyncio.AbstractEventLoop) -> None:
        """The pipe is readable: a reply, for the oldest batch waiting (the loop calls again
        while more is in)."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self._died(loop)
            return
        reply = self._pending.popleft()
        if not reply.done():
            reply.set_result(msg)
        if not self._pending:
            loop.remove_reader(self.conn.fileno())
            self.lock.release()

    def _watchdog(self, loop: asyncio.AbstractEventLoop, reply: asyncio.Future) -> None:
        """``hang_s`` after a batch was sent: if its reply is still to come, the child is killed
        and what it had fails."""
        if reply in self._pending:
            self.process.kill()
            self._died(loop, f"did not answer a batch in {self.settings.hang_s:g}s and was killed")

    def _died(self, loop: asyncio.AbstractEventLoop, why: str = "") -> None:
        """The child went away with batches in flight: they fail, the pipe is free again."""
        if not self._pending:
            return
        self.process.join(1)
        err = EngineDied(f"engine process {why or f'died (exit code {self.process.exitcode})'}{self._then}")
        while self._pending:
            reply = self._pending.popleft()
            if not reply.done():
                reply.set_exception(err)
        loop.remove_reader(self.conn.fileno())
        self.lock.release()

    @property
    def last_stages(self) -> dict[str, float]:
        """:attr:`stages` as last read from the child (no call: for a child that died or closed)."""
        return self._last_stages

    @property
    def stages(self) -> dict[str, float]:
        """Seconds per stage inside the engine (its process), summed over batches."""
        if self.closed:
            return self._last_stages
        try:
            self._last_stages = self._call("stages")
        except EngineProcessError:
            pass
        return self._last_stages

    def close(self, timeout: float = 10.0) -> None:
        """Waits for the batch in flight, then stops the child. Every wait is bounded by
        ``timeout``: a child that does not answer (or a batch that never returns) is killed,
        so a reload or a shutdown never hangs on a stuck engine. From another thread during a
        start (the constructor's, :meth:`start`'s or a restart's), it kills the starting child
        and the start raises EngineProcessError."""
        with self._guard:
            self._closing = True
            starting = self._starting
            if starting:
                self.process.kill()
        if starting:  # the start owns the pipe until it raises (and reaps the child): wait for the exit only
            self.closed = True
            wait_handles([self.process.sentinel], timeout)
            return
        got = self.lock.acquire(timeout=timeout)
        try:
            if self.closed:
                return
            self.closed = True
            if self.proc is None:  # never started
                return
            if self.process.is_alive() and got:
                try:
                    self._last_stages = self._exchange("stages", timeout=timeout)[1]
                    self._exchange("stop", timeout=timeout)
                except EngineProcessError:
                    pass
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)
            if got:  # (else the stuck batch's call still reads it: killing the child ends that read)
                self.conn.close()
        finally:
            if got:
                self.lock.release()


def _background(pid: int) -> None:
    """SCHED_IDLE for ``pid`` (0: this thread): it runs only when its CPU has nothing else to do,
    so a standby's load (seconds of CPU on the front-end's CPUs) delays no call being served."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: a lower niceness instead
        os.nice(STANDBY_NICE)
