"""Where a process's threads run: pinning every thread (the scheduler's calls on a pid reach only
its main thread) and starting children on given CPUs.

A leaf of ``serve/``: the engine processes (``serve.failover``) and SGLang's runtime
(``serve.sglang_runtime``) both pin with it, and it imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def thread_ids(pid: int) -> list[int]:
    """Thread ids of process ``pid`` (just ``[pid]`` where /proc cannot be read)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def pin_threads(pid: int | None, cpus: tuple[int, ...]) -> None:
    """Moves every thread of process ``pid`` onto ``cpus`` (torch's pool threads included)."""
    if not cpus or pid is None or not hasattr(os, "sched_setaffinity"):
        return
    for tid in thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def spawning_on(cpus: tuple[int, ...]) -> Iterator[None]:
    """Processes started inside run on ``cpus`` from their first instruction: the calling thread
    is moved there meanwhile (a child inherits its parent thread's CPUs). After, it and every
    thread of this process begun meanwhile go back to where the calling thread was: only the
    children stay. ``()``: nothing changes."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    existing = set(thread_ids(os.getpid()))
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        for tid in set(thread_ids(os.getpid())) - existing:
            try:
                os.sched_setaffinity(tid, before)
            except OSError:  # a thread that ended meanwhile
                pass
