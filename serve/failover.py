"""Several engine processes behind one engine interface.

``serve.worker.EngineProcess`` is one engine in one child process; the engines here are made
of several, and the server holds them like any engine (``serve.contract.Engine``; plus
artifact and restarts)::

    FailoverEngine   one serving process + a warm standby that takes over when it dies
    EnginePool       replicas of one artifact; each batch runs on a free one

``open_engine_process`` picks between a FailoverEngine and a bare EngineProcess.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait as wait_handles

from genrec.serve.affinity import pin_threads, thread_ids
from genrec.serve.contract import EngineBuilder, ReplicaState, Result
from genrec.serve.requests import Work
from genrec.serve.worker import (
    STANDBY_NICE,
    EngineDied,
    EngineProcess,
    EngineProcessError,
    ModelChanged,
    ProcessSettings,
)

log = logging.getLogger("genrec.serve")


def _foreground(pid: int | None) -> None:
    """Every thread of ``pid`` back to the normal policy, where permitted (leaving SCHED_IDLE
    needs CAP_SYS_NICE; without it a promoted standby stays idle-priority, which costs nothing on
    CPUs of its own, the case of an engine pinned by serve.engine_cpus)."""
    if pid is None:
        return
    for tid in thread_ids(pid):
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except (OSError, AttributeError):  # not permitted, or a thread that ended meanwhile
            pass


def _exited(engine: EngineProcess) -> bool:
    """Whether the child has exited, from its sentinel (no waitpid: that races a join elsewhere)."""
    return bool(wait_handles([engine.process.sentinel], 0))


class FailoverEngine:
    """An engine process with a warm standby: one process of the same artifact, loaded and idle
    (blocked on its pipe), takes over the moment the serving one dies, so a crash costs no
    outage and no failed call. The standby costs one more process's memory (an engine's: the
    model and its tables) and, for a few seconds after each start, loading on the CPUs this
    process may use; it is pinned to ``settings.cpus`` (the engine's CPUs) only when it takes
    over.

    The engine contract (``serve.contract.Engine``) as :class:`EngineProcess` keeps it (plus
    artifact and restarts), with ``available`` and :meth:`on_state` following its processes.

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
      thread cancels it (or the standby's start) and stops every process.
    * One model per version label: every process after the first must load the model the first
      did (``version``, a hash of the artifact's content; ``expect``: the one the first must
      load too). A standby started after the artifact changed on disk is stopped unused
      (:class:`ModelChanged`, retried with back-off) and reported ``refused``; the engine serves
      the old model while a process of it lives, then nothing until a reload."""

    def __init__(self, kind: str, artifact: str, device: str = "cpu",
                 settings: ProcessSettings | None = None, start: bool = True, build: EngineBuilder | None = None,
                 expect: str | None = None) -> None:
        self.kind, self.artifact, self.device, self.build = kind, str(artifact), device, build
        self.expect = expect
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
        self._hooks: list[Callable[[bool], object]] = []
        self._reported = False  # `available` as last told to the hooks
        self._notifying = threading.Lock()  # hooks see the changes in order
        self._stop = threading.Event()  # ends the filler's back-off on close
        self._refused: ModelChanged | None = None  # the last standby refused (another model), until one is placed
        if start:
            self.start()

    def start(self) -> None:
        """Starts the serving engine (bounded by ``settings.start_timeout_s``), then the
        standby in the background."""
        first = self._launch(self.settings.cpus)
        self.expect = first.version
        self.name, self.version, self.schema = first.name, first.version, first.schema
        self.manifest, self.tower, self.path = first.manifest, first.tower, first.path
        if not self._place(first):
            raise EngineProcessError(f"engine for {self.artifact} closed while it started")
        self._refill()

    # ----- what the server reads --------------------------------------------------------------
    batches_together = False
    parallel = 1  # (the standby idles)

    @property
    def available(self) -> bool:
        """Some engine process can answer now."""
        return self.active is not None and not self.closed

    def on_state(self, hook: Callable[[bool], object]) -> None:
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
    def replica_states(self) -> list[ReplicaState]:
        """The serving process and the standby (``loading``, or ``refused`` when the last one
        started found another model on disk)."""
        with self._mu:
            active, standby, starting, refused = self.active, self.standby, self._starting, self._refused
        out = [active.state("serving") if active is not None
               else ReplicaState("serving", "closed" if self.closed else "dead", "", 0,
                                 "" if self.closed else "the engine and its standby died; a new one is loading")]
        if standby is not None:
            out.append(standby.state("standby"))
        elif refused is not None:
            out.append(ReplicaState("standby", "refused", refused.found, 0, str(refused)))
        elif starting is not None and not self.closed:
            out.append(starting.state("standby"))
        return out

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

    def run(self, works: list[Work]) -> list[Result]:
        engine = self._serving()
        try:
            return engine.run(works)
        except EngineProcessError as e:
            nxt = self._after(engine, e, works)
        return nxt.run(works)

    async def run_async(self, works: list[Work]) -> list[Result]:
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
                               start=False, restart=False, build=self.build, expect=self.expect)
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
                    pin_threads(engine.process.pid, self.settings.cpus)
                    self.active = engine
                else:
                    self.standby = engine
                self._changed.notify_all()
                log.info("%s engine process %d ready (%s)", "standby" if engine is self.standby else "serving",
                         engine.process.pid, self.artifact)
        if not placed:
            engine.close()
            return False
        threading.Thread(target=self._watch, args=(engine,), name="genrec-engine-watch", daemon=True).start()
        self._notify()
        return True

    def _watch(self, engine: EngineProcess) -> None:
        wait_handles([engine.process.sentinel])  # until the process exits
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
                    pin_threads(nxt.process.pid, self.settings.cpus)  # the dead one's CPUs are free now
                    _foreground(nxt.process.pid)
                self.active = nxt
            elif engine is self.standby:
                self.standby = None
            else:
                return
            self._due += 1
            for k, v in engine.last_stages.items():
                self._retired[k] = self._retired.get(k, 0.0) + v
            self._changed.notify_all()
        engine.process.kill()  # (an engine killed as hung is gone already) so its watcher wakes
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
                engine = self._launch((), nice)  # (ModelChanged when the artifact holds another model now)
            except ModelChanged as e:
                with self._mu:
                    self._refused = e
                if self.closed:
                    continue
                log.error("a new engine process was refused (retry in %gs): %s", backoff, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            except Exception as e:  # noqa: BLE001 - logged, retried: the serving engine may still answer
                if self.closed:  # (the start was cancelled by close())
                    continue
                log.error("starting a standby engine process failed (retry in %gs): %s", backoff, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 60.0)
                continue
            backoff = 1.0
            with self._mu:
                self._refused = None
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
            for k, v in engine.last_stages.items():
                self._retired[k] = self._retired.get(k, 0.0) + v
        # an engine the filler started just before: it finds no slot and stops it, before we return
        if filler is not None and filler is not threading.current_thread():
            filler.join(timeout)


def open_engine_process(kind: str, artifact: str, device: str = "cpu", settings: ProcessSettings | None = None,
                        build: EngineBuilder | None = None, start: bool = True,
                        expect: str | None = None) -> EngineProcess | FailoverEngine:
    """The engine process for ``settings``: with a warm standby (``settings.standby``) or one
    process; ``build`` makes the engine in each (default: ``serve.factory.make_engine``);
    ``start=False``: started by its ``start()`` (which ``close()`` from another thread cancels);
    ``expect``: the version it must load (ModelChanged otherwise)."""
    settings = settings or ProcessSettings()
    if settings.standby:
        return FailoverEngine(kind, artifact, device, settings, build=build, start=start, expect=expect)
    return EngineProcess(kind, artifact, device, settings, build=build, start=start, expect=expect)


class EnginePool:
    """``replicas`` engine processes of one artifact behind one engine interface: a batch
    runs on whichever replica is free, so up to ``len(replicas)`` batches compute at once
    (the server's batcher keeps that many in flight): a burst waits for the next free
    replica instead of behind one ever larger batch. The way to use a large host's cores; on
    a host with few, one pinned engine can have the better tail (compare ``torch`` and
    ``torch-replicas2`` in benchmarks/RESULTS.md, serving).

    One model per version label: the replicas (started) must hold one model (else they are
    closed and :class:`ModelChanged` raised), and each checks it again when it restarts a dead
    child (``EngineProcess.expect``): a replica whose restart found another model on disk is
    ``refused`` and takes no batch; with every replica refused, calls fail at once
    (UNAVAILABLE) and ``available`` is False. :meth:`replica_states` reports each."""

    def __init__(self, replicas: list[EngineProcess | FailoverEngine]) -> None:
        if not replicas:
            raise ValueError("EnginePool needs at least one engine")
        self.replicas = replicas
        first = replicas[0]
        other = next((r for r in replicas if r.version != first.version), None)
        if other is not None:
            for r in replicas:
                r.close()
            raise ModelChanged(f"the replicas of {first.artifact} loaded different models ({first.version}, "
                               f"{other.version}): it changed on disk while they started; load it again", other.version)
        self.name, self.version, self.schema = first.name, first.version, first.schema
        self.manifest, self.tower, self.artifact, self.path = first.manifest, first.tower, first.artifact, first.path
        self.idle: queue.SimpleQueue[EngineProcess | FailoverEngine] = queue.SimpleQueue()
        for r in replicas:
            self.idle.put(r)
        self._hooks: list[Callable[[bool], object]] = []
        self._reported = True
        for r in replicas:
            r.on_state(lambda _ok: self._notify())

    # ----- the engine contract (serve.contract.Engine) -----------------------------------------
    batches_together = False

    @property
    def parallel(self) -> int:
        """One batch per replica at once."""
        return len(self.replicas)

    @property
    def available(self) -> bool:
        """Some replica can answer (each replaces a dead child on its next batch)."""
        return any(r.available for r in self.replicas)

    def on_state(self, hook: Callable[[bool], object]) -> None:
        """``hook(available)`` when that changes: the replicas restart their own children; it
        changes when the last replica that could answer is refused (or recovers, a failover one)."""
        self._hooks.append(hook)

    def _notify(self) -> None:
        now = self.available
        if now != self._reported:
            self._reported = now
            for hook in list(self._hooks):
                hook(now)

    def replica_states(self) -> list[ReplicaState]:
        return [replace(st, role=f"replica {i}" + ("" if st.role == "process" else f" {st.role}"))
                for i, r in enumerate(self.replicas) for st in r.replica_states()]

    def _take(self, wait: bool) -> EngineProcess | FailoverEngine | None:
        """A free replica that can answer (None when none is free and not ``wait``); replicas
        that cannot (refused: another model on disk) are passed over. Raises EngineProcessError
        at once when no replica can answer."""
        passed: list[EngineProcess | FailoverEngine] = []
        try:
            while True:
                if not self.available:
                    raise EngineProcessError(f"no replica of {self.artifact} can answer: " + "; ".join(
                        f"{s.role}: {s.state} {s.detail}" for s in self.replica_states()))
                try:  # (a wait wakes now and then: the busy replicas may all have been refused meanwhile)
                    engine = self.idle.get(timeout=0.1) if wait else self.idle.get_nowait()
                except queue.Empty:
                    if wait:
                        continue
                    return None
                if engine.available:
                    return engine
                passed.append(engine)
        finally:
            for e in passed:
                self.idle.put(e)

    @staticmethod
    def _again(err: EngineProcessError, works: list[Work], died: bool) -> bool:
        """Whether a batch that failed with ``err`` on a replica runs on another (taken from the
        head of the idle queue: the failed one went to its end). Batches are pure functions of
        their requests, so a re-run is safe: after :class:`ModelChanged` (the replica was refused
        as it restarted: the batch did not run) always, as a refused replica is never taken
        again; after :class:`EngineDied` once (a batch that kills every replica it runs on costs
        two processes, not all); never once every caller's deadline has passed."""
        if not any(w.deadline > time.monotonic() for w in works):
            return False
        return isinstance(err, ModelChanged) or (isinstance(err, EngineDied) and not died)

    def run(self, works: list[Work], died: bool = False) -> list[Result]:
        engine = self._take(wait=True)
        assert engine is not None
        try:
            return engine.run(works)
        except EngineProcessError as e:
            if not self._again(e, works, died):
                raise
            died = died or isinstance(e, EngineDied)
        finally:
            self.idle.put(engine)
        return self.run(works, died)

    async def run_async(self, works: list[Work], died: bool = False) -> list[Result]:
        engine = self._take(wait=False)
        if engine is None:  # every replica busy: wait for one in a thread
            return await asyncio.get_running_loop().run_in_executor(None, self.run, works, died)
        try:
            return await engine.run_async(works)
        except EngineProcessError as e:
            if not self._again(e, works, died):
                raise
            died = died or isinstance(e, EngineDied)
        finally:
            self.idle.put(engine)
        return await self.run_async(works, died)

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
