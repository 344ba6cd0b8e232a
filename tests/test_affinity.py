"""Where processes and threads run (serve/affinity.py): children started on the engine's CPUs
from their first instruction, the starting process's own threads left where they were."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest

from genrec.serve.affinity import pin_threads, spawning_on, thread_ids

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs CPU affinity and two CPUs")
REPORT = "import os, sys; print(sorted(os.sched_getaffinity(0)), flush=True); sys.stdin.read()"


def _child() -> tuple[subprocess.Popen, list[int]]:
    """A child that reports the CPUs it started on, then waits for its stdin to close."""
    p = subprocess.Popen([sys.executable, "-c", REPORT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, eval(p.stdout.readline())  # noqa: S307 - a list of ints printed by the child


def _end(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(10)


def test_spawning_on_starts_children_there_and_leaves_this_process_where_it_was():
    everywhere = os.sched_getaffinity(0)
    one = (max(everywhere),)
    begun = []
    with spawning_on(one):
        p, started_on = _child()
        t = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
        t.start()
        begun.append(t.native_id)
    try:
        assert started_on == list(one)
        assert os.sched_getaffinity(0) == everywhere  # the calling thread is back
        assert os.sched_getaffinity(begun[0]) == everywhere  # and so is a thread begun meanwhile
        assert os.sched_getaffinity(p.pid) == set(one)  # the child stays
    finally:
        _end(p)
    with spawning_on(()):  # nothing to change
        p, started_on = _child()
    _end(p)
    assert set(started_on) == everywhere


def test_pin_threads_moves_every_thread_of_a_process():
    p = subprocess.Popen([sys.executable, "-c", "import threading, sys; threading.Thread(target=sys.stdin.read)"
                          ".start(); print('up', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()
        one = (min(os.sched_getaffinity(0)),)
        pin_threads(p.pid, one)
        tids = thread_ids(p.pid)
        assert len(tids) >= 2 and all(os.sched_getaffinity(t) == set(one) for t in tids)
    finally:
        _end(p)


class _FakeEngine:
    """sglang.Engine's surfaces that serve.sglang_runtime.Runtime uses, with one child process."""

    started_on: list[list[int]] = []

    def __init__(self, **kwargs: object) -> None:
        self.proc, cpus = _child()
        self.started_on.append(cpus)
        self.tokenizer_manager = types.SimpleNamespace()

    def get_all_child_pids(self) -> list[int]:
        return [self.proc.pid]


def test_a_replacement_runtime_starts_on_the_engines_cpus_not_the_front_ends(monkeypatch, tmp_path):
    """A standby (or a replacement after a fault) started after ``pin_to`` loads its model on the
    engine's CPUs: started on the front end's, its start-up (tens of seconds of a core) would
    slow the calls the front end is serving until it was moved."""
    from genrec.serve.sglang_runtime import Runtimes

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=_FakeEngine))
    _FakeEngine.started_on.clear()
    everywhere = os.sched_getaffinity(0)
    one = (max(everywhere),)
    runtimes = Runtimes({}, standby=False, workdir=tmp_path)
    try:
        runtimes.pin_to(one)
        assert os.sched_getaffinity(runtimes.active.procs[0].pid) == set(one)
        fresh = runtimes._new()
        try:
            assert _FakeEngine.started_on == [sorted(everywhere), list(one)]
            assert os.sched_getaffinity(fresh.thread.native_id) == everywhere  # its loop: the front end's
        finally:
            fresh.close()
    finally:
        runtimes.close()
