"""An engine in its own process, behind the gRPC front-end.

In one process the engine thread and the front-end (asyncio loop, gRPC callbacks, request
decoding and response encoding) share one GIL: every torch op boundary of a batch may wait
for a handler, and every handler for the batch's Python between ops. ``EngineProcess``
moves the engine into a child process with its own interpreter; the front-end keeps
batching (``serve.batcher``) and hands each batch over a pipe::

    front-end process                          engine process (spawned)
    Batcher -> EngineProcess.run(works) --pickle--> engine.run(works)
            <-- results | the engine's exception --

It stands in for the engine object the server holds (name, version, schema, manifest,
tower, stages, ``run``), so batching, deadlines, reload and metrics are unchanged. A batch
costs two pipe transfers of its validated arrays (tens of microseconds). From the event
loop, batches pipeline (``run_async``): the child takes them in order, the next already in
its pipe when one finishes. If the child dies, the batches in flight fail (INTERNAL) and the
next batch starts a new child; with a warm standby (``FailoverEngine``, what
``open_engine_process`` builds by default) a second child of the artifact, loaded and idle,
takes over at once and the batches in flight run again on it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_handles
from typing import Any

from genrec.quant.artifact import Manifest
from genrec.serve.requests import ModelSchema, Work

log = logging.getLogger("genrec.serve")


@dataclass(frozen=True)
class ProcessSettings:
    threads: int = 0  # torch intra-op threads in the child (0: torch's default)
    matmul_precision: str = "highest"
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


def plan_cpus(spec: str, threads: int, available: tuple[int, ...],
              replicas: int = 1) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(CPUs of each engine replica, front-end CPUs) for ``--engine-cpus``; an empty tuple
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
            raise ValueError(f"--engine-cpus: '{spec}' is not auto, none or a list of CPU numbers") from None
        missing = set(engine) - set(cpus)
        if missing:
            raise ValueError(f"--engine-cpus: CPU {sorted(missing)} not available to this process "
                             f"(available: {cpus})")
        if len(engine) % replicas:
            raise ValueError(f"--engine-cpus: {len(engine)} CPUs do not split evenly between {replicas} replicas")
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


def _child(conn: Connection, kind: str, artifact: str, device: str, settings: ProcessSettings) -> None:
    import signal

    _exit_with_parent()  # first: loading (imports included) can take long, and can hang
    if settings.nice:  # a standby loading beside a serving engine: idle priority (threads started
        _background(0)  # later, torch's pool too, inherit it); the CPU's idle time is enough to load

    import torch

    from genrec.serve.engine import run_stamped
    from genrec.serve.server import make_engine, quiet_gc

    # Ctrl-C reaches the whole process group: the front-end drains and then stops this
    # process itself, so the batches it still sends must find it alive.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if settings.cpus:
        os.sched_setaffinity(0, settings.cpus)

    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.set_float32_matmul_precision(settings.matmul_precision)
    try:
        engine = make_engine(kind, artifact, device)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", e))
        return
    quiet_gc()
    conn.send(("ready", {"name": engine.name, "version": engine.version, "schema": engine.schema,
                         "manifest": engine.manifest, "tower": engine.tower, "path": getattr(engine, "path", None)}))
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
    replaces engines itself, :class:`FailoverEngine`)."""

    def __init__(self, kind: str, artifact: str, device: str = "cpu",
                 settings: ProcessSettings | None = None, start: bool = True, restart: bool = True) -> None:
        self.kind, self.artifact, self.device = kind, str(artifact), device
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
        proc = ctx.Process(target=_child, args=(child, self.kind, self.artifact, self.device, self.settings),
                           name=f"genrec-engine-{self.kind}", daemon=True)
        with self._guard:
            if self._closing:
                conn.close()
                child.close()
                raise EngineProcessError(f"engine process for {self.artifact} was closed before it started")
            self.conn, self.proc, self._starting = conn, proc, True
            proc.start()
        child.close()
        try:
            tag, body = self._await_ready()
        except BaseException:
            conn.close()
            raise
        finally:
            with self._guard:
                self._starting = False
        if tag == "error":
            self.proc.join(5)
            raise body
        meta: dict[str, Any] = body
        self.name: str = meta["name"]
        self.version: str = meta["version"]
        self.schema: ModelSchema = meta["schema"]
        self.manifest: Manifest = meta["manifest"]
        self.tower: str = meta["tower"]
        self.path: str | None = meta.get("path")  # how the engine runs the tower (TorchEngine.path)

    def _await_ready(self) -> tuple[str, Any]:
        """The child's first message, within ``start_timeout_s``. A child that exits (or is
        killed by close()) closes its end of the pipe: the wait ends at once on the EOF."""
        timeout = self.settings.start_timeout_s
        if not self.conn.poll(timeout):
            self.proc.kill()
            self.proc.join(5)
            raise EngineProcessError(f"engine process did not load {self.artifact} in {timeout:g}s "
                                     "(start_timeout_s) and was killed")
        try:
            return self.conn.recv()
        except (EOFError, OSError):  # (a reset, not an EOF, when the child died with bytes unread)
            self.proc.join(5)
            if self._closing:
                raise EngineProcessError(f"engine process loading {self.artifact} was stopped: "
                                         "closed while it started") from None
            raise EngineProcessError(f"engine process exited while loading {self.artifact} "
                                     f"(exit code {self.proc.exitcode})") from None

    @property
    def _then(self) -> str:
        return "; the next batch starts a new one" if self.restart else ""

    def _call(self, op: str, payload: Any = None) -> Any:  # noqa: ANN401 - the op's reply
        with self.lock:
            if self.closed:
                raise EngineProcessError("the engine process was closed")
            if not self.proc.is_alive():
                if not self.restart:
                    raise EngineDied(f"engine process died (exit code {self.proc.exitcode})")
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
                self.proc.kill()
                self.proc.join(1)
                raise EngineDied(f"engine process did not answer '{op}' in {timeout:g}s and was killed{self._then}")
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.proc.join(1)
            raise EngineDied(f"engine process died (exit code {self.proc.exitcode}){self._then}") from None

    def run(self, works: list[Work]) -> list:
        return self._call("run", works)

    async def run_async(self, works: list[Work]) -> list:
        """``run`` from the event loop without a thread: the batch is sent from the loop and the
        replies read when the pipe turns readable, which saves the executor thread's two wake-ups
        per batch (~0.5 ms, more in the tail, on the 2-core benchmark machine). Batches pipeline:
        more are sent while one computes (the child takes them in order), so the engine starts
        the next the moment one is done instead of waiting for the front-end to collect those
        results and send more (the batcher's ``max_inflight``). A control call
        holding the pipe, a dead child (restarted in ``run``) or a loop without ``add_reader`` go
        through ``run`` in a thread."""
        loop = asyncio.get_running_loop()
        if self.closed or not self.proc.is_alive():
            if not self.closed and not self.restart:  # nothing for a thread to do but fail
                raise EngineDied(f"engine process died (exit code {self.proc.exitcode})")
            return await loop.run_in_executor(None, self.run, works)
        if not self._pending:  # the pipeline is idle: it takes the pipe until its last reply is in
            if not self.lock.acquire(blocking=False):
                return await loop.run_in_executor(None, self.run, works)
            try:
                loop.add_reader(self.conn.fileno(), self._replies, loop)
            except NotImplementedError:  # e.g. the Windows proactor loop
                self.lock.release()
                return await loop.run_in_executor(None, self.run, works)
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
            self.proc.kill()
            self._died(loop, f"did not answer a batch in {self.settings.hang_s:g}s and was killed")

    def _died(self, loop: asyncio.AbstractEventLoop, why: str = "") -> None:
        """The child went away with batches in flight: they fail, the pipe is free again."""
        if not self._pending:
            return
        self.proc.join(1)
        err = EngineDied(f"engine process {why or f'died (exit code {self.proc.exitcode})'}{self._then}")
        while self._pending:
            reply = self._pending.popleft()
            if not reply.done():
                reply.set_exception(err)
        loop.remove_reader(self.conn.fileno())
        self.lock.release()

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
                self.proc.kill()
        if starting:  # the start owns the pipe until it raises (and reaps the child): wait for the exit only
            self.closed = True
            wait_handles([self.proc.sentinel], timeout)
            return
        got = self.lock.acquire(timeout=timeout)
        try:
            if self.closed:
                return
            self.closed = True
            if self.proc is None:  # never started
                return
            if self.proc.is_alive() and got:
                try:
                    self._last_stages = self._exchange("stages", timeout=timeout)[1]
                    self._exchange("stop", timeout=timeout)
                except EngineProcessError:
                    pass
                self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout)
            if got:  # (else the stuck batch's call still reads it: killing the child ends that read)
                self.conn.close()
        finally:
            if got:
                self.lock.release()


def _threads(pid: int) -> list[int]:
    """Thread ids of process ``pid`` (scheduler calls on a pid reach only its main thread)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _pin(pid: int, cpus: tuple[int, ...]) -> None:
    """Moves every thread of process ``pid`` onto ``cpus`` (torch's pool threads included)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def _background(pid: int) -> None:
    """SCHED_IDLE for ``pid`` (0: this thread): it runs only when its CPU has nothing else to do,
    so a standby's load (seconds of CPU on the front-end's CPUs) delays no call being served."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: a lower niceness instead
        os.nice(STANDBY_NICE)


def _foreground(pid: int) -> None:
    """Every thread of ``pid`` back to the normal policy, where permitted (leaving SCHED_IDLE
    needs CAP_SYS_NICE; without it a promoted standby stays idle-priority, which costs nothing on
    CPUs of its own, the case of an engine pinned with --engine-cpus)."""
    for tid in _threads(pid):
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except (OSError, AttributeError):  # not permitted, or a thread that ended meanwhile
            pass


def _exited(engine: EngineProcess) -> bool:
    """Whether the child has exited, from its sentinel (no waitpid: that races a join elsewhere)."""
    return bool(wait_handles([engine.proc.sentinel], 0))


class FailoverEngine:
    """An engine process with a warm standby: one process of the same artifact, loaded and idle
    (blocked on its pipe), takes over the moment the serving one dies, so a crash costs no
    outage and no failed call. The standby costs one more process's memory (~430 MB for ML-1M)
    and, for a few seconds after each start, loading on the CPUs this process may use; it is
    pinned to ``settings.cpus`` (the engine's CPUs) only when it takes over.

    Same interface as :class:`EngineProcess` (name, version, schema, manifest, tower, path,
    artifact, stages, run, run_async, close, restarts), plus ``available`` and :meth:`on_state`.

    * A batch that fails because its engine died (:class:`EngineDied`: a crash, or killed as
      hung) runs once more on the engine that took over, unless every caller's deadline has
      passed. Batches are pure functions of their requests, so a re-run is safe. Once only: a
      batch that kills every engine it runs on costs two processes, not all of them.
    * A watcher thread per process, blocked on its sentinel, notices a death at once even
      with no traffic: the standby is promoted, ``restarts`` counts the replacement a
      background thread then starts (the new standby, or the engine when both died).
    * ``available``: some engine can answer now. False only when both are dead, until a
      replacement has loaded; then calls fail at once with EngineProcessError.
    * ``start=False``: :meth:`start` starts the first engine; :meth:`close` from another
      thread cancels it (or the standby's start) and stops every process."""

    def __init__(self, kind: str, artifact: str, device: str = "cpu",
                 settings: ProcessSettings | None = None, start: bool = True) -> None:
        self.kind, self.artifact, self.device = kind, str(artifact), device
        self.settings = settings or ProcessSettings()
        self.active: EngineProcess | None = None  # answers batches
        self.standby: EngineProcess | None = None  # loaded, idle, takes over when `active` dies
        self.restarts = 0
        self.closed = False
        self._mu = threading.Lock()  # guards the fields above and below (short holds only, no I/O)
        self._changed = threading.Condition(self._mu)
        self._starting: EngineProcess | None = None  # a start in progress, for close() to cancel
        self._filler: threading.Thread | None = None  # starts engines while a slot is empty
        self._due = 0  # engines lost in service and not yet replaced
        self._retired: dict[str, float] = {}  # stages of engines gone
        self._hooks: list[Callable[[bool], None]] = []
        self._reported = False  # `available` as last told to the hooks
        self._notifying = threading.Lock()  # hooks see the changes in order
        self._stop = threading.Event()  # ends the filler's back-off on close
        if start:
            self.start()

    def start(self) -> None:
        """Starts the serving engine (bounded by ``settings.start_timeout_s``), then the
        standby in the background."""
        first = self._launch(self.settings.cpus)
        self.name, self.version, self.schema = first.name, first.version, first.schema
        self.manifest, self.tower, self.path = first.manifest, first.tower, first.path
        if not self._place(first):
            raise EngineProcessError(f"engine for {self.artifact} closed while it started")
        self._refill()

    # ----- what the server reads --------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Some engine process can answer now."""
        return self.active is not None and not self.closed

    def on_state(self, hook: Callable[[bool], None]) -> None:
        """``hook(available)`` on each change of ``available``, in order, from whichever thread
        saw it (a watcher thread, the event loop): keep it short and thread-safe, e.g. a
        ``loop.call_soon_threadsafe``. Not called once closed."""
        self._hooks.append(hook)

    def wait_standby(self, timeout: float) -> bool:
        """Waits until both the serving engine and the standby are up; False after ``timeout``."""
        with self._changed:
            full = self._changed.wait_for(lambda: self.closed or None not in (self.active, self.standby), timeout)
            return bool(full) and not self.closed

    # ----- batches ----------------------------------------------------------------------------
    def _serving(self) -> EngineProcess:
        engine = self.active
        if engine is None:
            raise EngineProcessError("no engine process can answer: " + (
                "closed" if self.closed else f"the engine and its standby died; a new one is loading {self.artifact}"))
        return engine

    def _after(self, engine: EngineProcess, err: EngineProcessError, works: list[Work]) -> EngineProcess:
        """The engine to run a batch again on after ``engine`` failed it with ``err``; raises
        ``err`` when there is none or the batch should not run again."""
        if isinstance(err, EngineDied):
            self._lost(engine)
        nxt = self.active
        # a closed `engine` (not died) was retired by a watcher while the batch was on its way to it
        if nxt is None or nxt is engine or self.closed or not any(w.deadline > time.monotonic() for w in works):
            raise err
        return nxt

    def run(self, works: list[Work]) -> list:
        engine = self._serving()
        try:
            return engine.run(works)
        except EngineProcessError as e:
            nxt = self._after(engine, e, works)
        return nxt.run(works)

    async def run_async(self, works: list[Work]) -> list:
        engine = self._serving()
        try:
            return await engine.run_async(works)
        except EngineProcessError as e:
            nxt = self._after(engine, e, works)
        return await nxt.run_async(works)

    @property
    def stages(self) -> dict[str, float]:
        """Seconds per stage inside the engines, summed over every process that served."""
        total = dict(self._retired)
        engine = self.active
        for k, v in (engine.stages if engine else {}).items():
            total[k] = total.get(k, 0.0) + v
        return total

    # ----- engines coming and going -----------------------------------------------------------
    def _launch(self, cpus: tuple[int, ...], nice: int = 0) -> EngineProcess:
        """A started engine process (restart=False: a dead one is replaced here, not in-line)."""
        engine = EngineProcess(self.kind, self.artifact, self.device,
                               replace(self.settings, cpus=cpus, nice=self.settings.nice + nice),
                               start=False, restart=False)
        with self._mu:
            if self.closed:
                raise EngineProcessError(f"engine for {self.artifact} closed while it started")
            self._starting = engine
        try:
            engine.start()
        finally:
            with self._mu:
                self._starting = None
        return engine

    def _place(self, engine: EngineProcess) -> bool:
        """A started engine takes an empty slot: serving (pinned to the engine CPUs) or standby.
        False (the engine closed) when closed."""
        with self._mu:
            placed = not self.closed and (self.active is None or self.standby is None)
            if placed:
                if self._due:
                    self._due -= 1
                    self.restarts += 1
                if self.active is None:
                    _pin(engine.proc.pid, self.settings.cpus)
                    self.active = engine
                else:
                    self.standby = engine
                self._changed.notify_all()
                log.info("%s engine process %d ready (%s)", "standby" if engine is self.standby else "serving",
                         engine.proc.pid, self.artifact)
        if not placed:
            engine.close()
            return False
        threading.Thread(target=self._watch, args=(engine,), name="genrec-engine-watch", daemon=True).start()
        self._notify()
        return True

    def _watch(self, engine: EngineProcess) -> None:
        wait_handles([engine.proc.sentinel])  # until the process exits
        self._lost(engine)
        engine.close()

    def _lost(self, engine: EngineProcess) -> None:
        """``engine`` died: the standby (if alive) serves in its place, a replacement starts.
        Idempotent (a batch and the watcher may both report it)."""
        with self._mu:
            if engine is self.active:
                nxt, self.standby = self.standby, None
                if nxt is not None and _exited(nxt):  # died too; its watcher will find no slot
                    self._due, nxt = self._due + 1, None
                if nxt is not None:
                    _pin(nxt.proc.pid, self.settings.cpus)  # the dead one's CPUs are free now
                    _foreground(nxt.proc.pid)
                self.active = nxt
            elif engine is self.standby:
                self.standby = None
            else:
                return
            self._due += 1
            for k, v in engine._last_stages.items():
                self._retired[k] = self._retired.get(k, 0.0) + v
            self._changed.notify_all()
        engine.proc.kill()  # (an engine killed as hung is gone already) so its watcher wakes
        self._notify()
        self._refill()

    def _refill(self) -> None:
        """Starts the filler thread if a slot is empty and none runs."""
        with self._mu:
            if self.closed or self._filler is not None or None not in (self.active, self.standby):
                return
            self._filler = threading.Thread(target=self._fill, name="genrec-engine-standby", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        """Starts engines until both slots are full (one thread at a time); a failed start is
        retried with back-off."""
        backoff = 1.0
        while True:
            with self._mu:
                if self.closed or None not in (self.active, self.standby):
                    self._filler = None  # (under the lock: _refill sees either this thread or none)
                    return
            try:
                # on the CPUs of this process, off the serving engine's: pinned when it takes over;
                # niced while another engine serves (the front-end shares these CPUs)
                with self._mu:
                    nice = STANDBY_NICE if self.active is not None else 0
                engine = self._launch((), nice)
                if (engine.version, engine.schema) != (self.version, self.schema):
                    engine.close()
                    raise EngineProcessError(f"{self.artifact} changed on disk ({self.version} -> {engine.version}); "
                                             "not serving it under the old version: load it with a reload")
            except Exception as e:  # noqa: BLE001 - logged, retried: the serving engine may still answer
                if self.closed:  # (the start was cancelled by close())
                    continue
                log.error("starting a standby engine process failed (retry in %gs): %s", backoff, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            backoff = 1.0
            self._place(engine)

    def _notify(self) -> None:
        with self._notifying:
            now = self.available
            if self.closed or now == self._reported:
                return
            self._reported = now
            for hook in list(self._hooks):
                try:
                    hook(now)
                except Exception:  # noqa: BLE001 - a hook's bug must not stop a failover
                    log.exception("engine state hook failed")

    def close(self, timeout: float = 10.0) -> None:
        """Cancels a start in progress, waits for the batch in flight (bounded by ``timeout``),
        stops every engine process. The hooks are not called again."""
        with self._mu:
            if self.closed:
                return
            self.closed = True
            engines = [e for e in (self._starting, self.active, self.standby) if e is not None]
            self.active = self.standby = None
            filler = self._filler
            self._changed.notify_all()
        self._stop.set()
        for engine in engines:  # the starting one first: killed at once
            engine.close(timeout)
            for k, v in engine._last_stages.items():
                self._retired[k] = self._retired.get(k, 0.0) + v
        # an engine the filler started just before: it finds no slot and stops it, before we return
        if filler is not None and filler is not threading.current_thread():
            filler.join(timeout)


def open_engine_process(kind: str, artifact: str, device: str = "cpu",
                        settings: ProcessSettings | None = None) -> EngineProcess | FailoverEngine:
    """The engine process for ``settings``: with a warm standby (``settings.standby``) or one process."""
    settings = settings or ProcessSettings()
    if settings.standby:
        return FailoverEngine(kind, artifact, device, settings)
    return EngineProcess(kind, artifact, device, settings)


class EnginePool:
    """``replicas`` engine processes of one artifact behind one engine interface: a batch
    runs on whichever replica is free, so up to ``len(replicas)`` batches compute at once
    (the server's batcher keeps that many in flight): a burst waits for the next free
    replica instead of behind one ever larger batch. The way to use a large host's cores;
    on the 2-core benchmark machine two replicas (one sharing the front-end's CPU) had a
    worse tail than one pinned engine up to 300 QPS and a better one from 400 QPS
    (benchmarks/RESULTS.md, serving)."""

    def __init__(self, replicas: list[EngineProcess]) -> None:
        if not replicas:
            raise ValueError("EnginePool needs at least one engine")
        self.replicas = replicas
        first = replicas[0]
        self.name, self.version, self.schema = first.name, first.version, first.schema
        self.manifest, self.tower, self.artifact, self.path = first.manifest, first.tower, first.artifact, first.path
        self.idle: queue.SimpleQueue[EngineProcess] = queue.SimpleQueue()
        for r in replicas:
            self.idle.put(r)

    def run(self, works: list[Work]) -> list:
        engine = self.idle.get()
        try:
            return engine.run(works)
        finally:
            self.idle.put(engine)

    async def run_async(self, works: list[Work]) -> list:
        try:
            engine = self.idle.get_nowait()
        except queue.Empty:  # every replica busy: wait for one in a thread
            return await asyncio.get_running_loop().run_in_executor(None, self.run, works)
        try:
            return await engine.run_async(works)
        finally:
            self.idle.put(engine)

    @property
    def restarts(self) -> int:
        return sum(r.restarts for r in self.replicas)

    @property
    def stages(self) -> dict[str, float]:
        """Seconds per stage, summed over the replicas."""
        total: dict[str, float] = {}
        for r in self.replicas:
            for k, v in r.stages.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def close(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.close(timeout)
