"""SGLang's runtime under the SGLang engine's front end: the one module of the server's process
that imports SGLang (the scheduler's is ``serve/sglang_models/genrec_tower.py``).

A :class:`Runtime` is one ``sglang.Engine``: its tokenizer manager on an asyncio loop of its own
thread, its scheduler and detokenizer processes. :class:`Runtimes` keeps the active one and,
optionally, a warm standby. What a fault does::

    exception in the model's forward   caught there (genrec_tower): the request at fault fails
                                       alone, INTERNAL; nothing restarts
    a runtime process ends (killed,    its monitor sees it (SIGQUIT, which SGLang's processes send
    or SGLang's scheduler raised)      this process on a fault, only wakes the monitors: handled on
                                       the main thread, never the default "end the process"); the
                                       calls in flight on it fail over to the standby (or fail
                                       UNAVAILABLE naming the cause when none is warm); a new
                                       runtime starts in the background
    a call's deadline passes           its SGLang requests are aborted; DEADLINE_EXCEEDED

Every wait is bounded (the call's deadline, start-up by ``START_TIMEOUT_S``). The SGLang surfaces
used here: ``sglang.Engine`` (constructor, ``async_generate`` with ``rid`` / ``cache_salt`` /
``priority``, ``get_all_child_pids``) and two internals, the tokenizer manager's
``abort_request`` (``Engine`` has no public abort) and ``_subprocess_watchdog`` (stopped: this
module watches the processes itself); see docs/serving.md, SGLang surfaces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import psutil

from genrec.serve import sglang_shim
from genrec.serve.affinity import pin_threads, spawning_on

log = logging.getLogger("genrec.serve.sglang")
START_TIMEOUT_S = 300.0  # an SGLang engine that has not started by then is given up
# a standby is rebuilt this long after it took over: starting a runtime takes a core or more for
# tens of seconds, which would slow the calls it has just taken over (an active runtime that
# failed with no standby warm is replaced at once)
REBUILD_DELAY_S = 10.0
_START_LOCK = threading.Lock()  # one runtime starts at a time (the children's environment is set around it)
_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()  # runtimes whose monitors a SIGQUIT wakes


class RuntimeFailed(RuntimeError):
    """The runtime a call ran on ended under it (the message names the cause)."""


def prepare_environment(device: str) -> None:
    """The explicit install step before SGLang is imported (``SGLangEngine`` calls it): SGLang's
    CPU engine for ``device`` "cpu", genrec's model package, the CPU import shims in this process
    (``serve.sglang_shim``). SGLang's spawned processes get the shims through
    :func:`_children_environment`, around each start only."""
    if device == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "genrec.serve.sglang_models"
    sglang_shim.install()


@contextlib.contextmanager
def _children_environment():  # noqa: ANN202
    """PYTHONPATH with the shims' folder while SGLang spawns its processes, restored after (its
    ``sitecustomize`` chains to the site's own: ``serve/sglang_shim/sitecustomize.py``)."""
    old = os.environ.get("PYTHONPATH")
    rest = [p for p in (old or "").split(os.pathsep) if p and p != sglang_shim.HERE]
    os.environ["PYTHONPATH"] = os.pathsep.join([sglang_shim.HERE, *rest])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _on_sigquit(signum: int, frame: object) -> None:
    """SGLang's processes signal their parent on a fault: wake the monitors (main thread, brief)."""
    for rt in list(_LIVE):
        rt.wake.set()


def install_sigquit_handler() -> bool:
    """Handles SIGQUIT in this process (the default would end it: the whole gRPC server). Python
    sets handlers on the main thread only: False when called elsewhere and none is installed."""
    if signal.getsignal(signal.SIGQUIT) is _on_sigquit:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGQUIT, _on_sigquit)
    return True


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Runtime:
    """One ``sglang.Engine`` built with ``kwargs`` (``model_path`` among them), on a loop of its
    own; ``on_fault(self)`` is called (from its monitor thread) when one of its processes ends."""

    def __init__(self, kwargs: dict, on_fault: Callable[[Runtime], None], name: str = "sglang",
                 cpus: tuple[int, ...] = ()) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)
        self.thread.start()
        self.dead: cf.Future[str] = cf.Future()  # its result: why the runtime ended
        self.wake = threading.Event()
        self.closed = False
        self.requests = 0  # SGLang requests sent through call() (tests count a work's requests)
        self._count = threading.Lock()
        self.procs: list[psutil.Process] = []
        try:
            self.engine = asyncio.run_coroutine_threadsafe(self._start(kwargs, cpus), self.loop).result(START_TIMEOUT_S)
            self.procs = [psutil.Process(pid) for pid in self.engine.get_all_child_pids()]
        except BaseException:
            self.close()
            raise
        # SGLang's watchdog would SIGQUIT this process when a child ends; the monitor below does the work
        watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        self.names = {p.pid: _name(p) for p in self.procs}
        self._on_fault = on_fault
        _LIVE.add(self)
        self.monitor = threading.Thread(target=self._watch, name=f"{name}-monitor", daemon=True)
        self.monitor.start()

    async def _start(self, kwargs: dict, cpus: tuple[int, ...]):  # noqa: ANN202
        import sglang as sgl

        # its processes start (load the model, warm up) on ``cpus``, not on the front end's
        with _START_LOCK, _children_environment(), spawning_on(cpus):
            return sgl.Engine(**kwargs)

    def _watch(self) -> None:
        while not self.closed:
            self.wake.wait(0.2)
            self.wake.clear()
            gone = [p for p in self.procs if not _alive(p)]
            if gone and not self.closed:
                p = gone[0]
                self.fail(f"SGLang's {self.names.get(p.pid, 'process')} (pid {p.pid}) exited")
                return

    def fail(self, cause: str) -> None:
        """Marks the runtime dead (calls waiting on it raise RuntimeFailed) and reports it."""
        if self.dead.done():
            return
        log.error("SGLang runtime failed: %s", cause)
        self.dead.set_result(cause)
        self._on_fault(self)

    def call(self, make: Callable[[], object], rids: list[str], deadline: float) -> object:
        """Runs the coroutine ``make()`` on this runtime's loop -> its result. Raises TimeoutError
        at ``deadline`` (time.monotonic(); the requests ``rids`` aborted first) and RuntimeFailed
        if the runtime ends meanwhile."""
        if self.dead.done():
            raise RuntimeFailed(self.dead.result())
        with self._count:
            self.requests += len(rids)
        fut: cf.Future = asyncio.run_coroutine_threadsafe(make(), self.loop)  # type: ignore[arg-type]
        cf.wait([fut, self.dead], timeout=max(deadline - time.monotonic(), 0.0), return_when=cf.FIRST_COMPLETED)
        if fut.done():
            return fut.result()
        if self.dead.done():
            fut.cancel()
            raise RuntimeFailed(self.dead.result())
        self.abort(rids)
        fut.cancel()
        raise TimeoutError(f"SGLang did not answer {len(rids)} requests by the call's deadline (aborted)")

    def abort(self, rids: list[str]) -> None:
        """Asks SGLang's scheduler to drop ``rids`` (their pool slots freed, nothing inserted)."""
        tm = self.engine.tokenizer_manager
        for rid in rids:
            self.loop.call_soon_threadsafe(tm.abort_request, rid)

    def close(self) -> None:
        """Stops its processes (this runtime's only) and its loop; bounded."""
        if self.closed:
            return
        self.closed = True
        self.wake.set()
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(self.procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

        async def cancel_all() -> None:
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        if self.loop.is_running():
            with contextlib.suppress(cf.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "process"


class Runtimes:
    """The active runtime and, with ``standby``, a warm one (both started here) that takes over
    when the active one fails; a failed runtime is closed and replaced in the background. ``hook(available)`` is called when
    no runtime can answer (False) and when one can again (True)."""

    def __init__(self, kwargs: dict, standby: bool, workdir: Path) -> None:
        self.kwargs, self.want_standby, self.workdir = kwargs, standby, workdir
        self.cpus: tuple[int, ...] = ()  # where the runtimes' processes run (pin_to); (): where the OS puts them
        self.cond = threading.Condition()
        self.hooks: list[Callable[[bool], object]] = []
        self.closed = False
        self.failovers = 0
        self.last_fault = ""
        self.standby: Runtime | None = None
        self.active: Runtime | None = Runtime(kwargs, self._fault)
        self._replacing = 0
        self._starting: list[threading.Thread] = []
        if standby:  # started before the engine is up: its start would skew the first calls' latency
            try:
                self.standby = self._new()
            except BaseException:
                self.active.close()
                raise

    def _new(self) -> Runtime:
        with self.cond:
            cpus = self.cpus
        rt = Runtime(self.kwargs, self._fault, name="sglang-standby", cpus=cpus)
        with self.cond:
            now = self.cpus
        if now != cpus:  # (pin_to meanwhile: it saw no such runtime)
            for p in rt.procs:
                pin_threads(p.pid, now)
        return rt

    def pin_to(self, cpus: tuple[int, ...]) -> None:
        """Runs the runtimes' processes (the scheduler, where the model computes, and the
        detokenizer) on ``cpus``: the active one, the standby, and every later one from its start."""
        cpus = tuple(cpus)
        with self.cond:
            self.cpus = cpus
            runtimes = [r for r in (self.active, self.standby) if r is not None]
        for rt in runtimes:
            for p in rt.procs:
                pin_threads(p.pid, cpus)

    def _replace(self, delay: float = 0.0) -> None:
        """Starts a runtime in the background (after ``delay`` seconds): the active one if there
        is none by then, else the standby."""
        with self.cond:
            self._replacing += 1

        def start() -> None:
            with self.cond:
                if self.cond.wait_for(lambda: self.closed, timeout=delay):
                    self._replacing -= 1
                    return
            try:
                rt = self._new()
            except Exception:  # noqa: BLE001 - reported; the next fault or call tries again
                log.exception("SGLang runtime: a replacement failed to start")
                rt = None
            with self.cond:
                self._replacing -= 1
                if rt is None or self.closed:
                    pass
                elif self.active is None:
                    self.active = rt
                    rt = None
                    self._tell(True)
                elif self.standby is None and self.want_standby:
                    self.standby = rt
                    rt = None
                self.cond.notify_all()
            if rt is not None:
                rt.close()

        t = threading.Thread(target=start, name="sglang-replace", daemon=True)
        self._starting = [x for x in self._starting if x.is_alive()] + [t]
        t.start()

    def _fault(self, rt: Runtime) -> None:
        with self.cond:
            self.last_fault = rt.dead.result()
            if rt is self.active:
                self.active, self.standby = self.standby, None
                self.failovers += self.active is not None
                if self.active is None:
                    self._tell(False)
            elif rt is self.standby:
                self.standby = None
            self.cond.notify_all()
            again = not self.closed
        threading.Thread(target=rt.close, name="sglang-close", daemon=True).start()
        if again:
            self._replace(0.0 if self.active is None else REBUILD_DELAY_S)

    def _tell(self, available: bool) -> None:
        for hook in list(self.hooks):
            try:
                hook(available)
            except Exception:  # noqa: BLE001 - an observer's fault is not the engine's
                log.exception("SGLang runtime: a state hook failed")

    @property
    def available(self) -> bool:
        return self.active is not None

    def current(self, deadline: float) -> Runtime:
        """The active runtime, waiting (until ``deadline``) while a replacement starts."""
        with self.cond:
            while self.active is None:
                left = deadline - time.monotonic()
                if self.closed or left <= 0 or not self._replacing:
                    raise RuntimeFailed(f"no SGLang runtime is up (last fault: {self.last_fault or 'none'})")
                self.cond.wait(left)
            return self.active

    def close(self) -> None:
        with self.cond:
            self.closed = True
            runtimes = [r for r in (self.active, self.standby) if r is not None]
            self.active = self.standby = None
            self.cond.notify_all()
        for t in self._starting:  # a runtime starting now closes itself when it is up (bounded)
            t.join(START_TIMEOUT_S)
        for rt in runtimes:
            _LIVE.discard(rt)
            rt.close()
