"""A bounded engine start: what a reload (Admin.LoadArtifact, SIGHUP) has started, and how to
stop it when it overruns ``serve.admin.load_timeout_s``.

``serve.server.open_engine`` reports each step to a :class:`Loading` as it goes: the engines
it made (an engine process, a failover pair, a pool's replicas: their ``close()`` from
another thread cancels a start in progress, killing the child that loads) and the step it is
at, which names what hung. An engine built in this process (the in-process torch engine,
SGLang's front end) is a Python call that nothing can interrupt: its thread is left to end,
the child processes it started meanwhile (SGLang's scheduler and detokenizer) are killed,
which ends a start that waits for them, and whatever it builds in the end is closed the
moment it is handed over. So a load that hangs costs one stuck thread at most, never an
engine, and the next load is not refused as "in progress".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

log = logging.getLogger("genrec.serve")
T = TypeVar("T")


class Closes(Protocol):
    def close(self) -> None: ...


class LoadAbandoned(RuntimeError):
    """The load was abandoned (timed out) while this step ran: what it made was closed."""


def descendants(pid: int) -> set[int]:
    """Process ids of every descendant of ``pid`` (from /proc; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(entry.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
        parents.setdefault(ppid, []).append(int(entry.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


class Loading:
    """One engine start in progress. ``step`` says what it is doing now; :meth:`abandon` (from
    any thread) stops what it made and makes every later step raise :class:`LoadAbandoned`."""

    def __init__(self) -> None:
        self.step = "starting"
        self._mu = threading.Lock()
        self._made: list[Closes] = []
        self._abandoned = False
        self._before: set[int] | None = None  # our descendants when an in-process build began

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def at(self, step: str) -> None:
        """The load goes on to ``step`` (LoadAbandoned if it was abandoned)."""
        if self._abandoned:
            raise LoadAbandoned(f"the load was abandoned before {step}")
        self.step = step

    def building_here(self, step: str) -> None:
        """An engine is about to be built in this process (step ``step``): the child processes
        it starts from now on are its own (killed by :meth:`abandon`)."""
        self.at(step)
        self._before = descendants(os.getpid())

    def made(self, engine: Closes) -> None:
        """``engine`` is part of this load (``abandon`` closes it). When the load was abandoned
        already, it is closed now and LoadAbandoned raised."""
        with self._mu:
            if not self._abandoned:
                self._made.append(engine)
                return
        engine.close()
        raise LoadAbandoned(f"the load was abandoned during {self.step}; what it built was closed")

    def abandon(self) -> None:
        """Stops the load: closes every engine made (cancelling a start in progress), kills the
        processes an in-process build started. Bounded by the engines' close()."""
        with self._mu:
            self._abandoned = True
            made, self._made = self._made, []
        for engine in made:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - stop the rest whatever one does
                log.exception("closing an abandoned engine failed")
        if self._before is not None:
            for pid in descendants(os.getpid()) - self._before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # noqa: ANN401
        """``fn(*args)`` on a daemon thread of its own (a hung build must not hold one of the
        loop's executor workers), as a future of ``loop``."""
        fut: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:  # noqa: ANN401 - fn's result or its exception
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def body() -> None:
            value: Any
            try:
                ok, value = True, fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
                ok, value = False, e
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is closed (the server stopped): nobody waits for it
                if ok and hasattr(value, "close"):
                    value.close()

        threading.Thread(target=body, name="genrec-load", daemon=True).start()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read: no "never retrieved")
        return fut
