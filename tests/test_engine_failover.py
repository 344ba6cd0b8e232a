"""Start-ups of engine processes that cannot hang the server.

* Every wait of a start is bounded (``start_timeout_s``), a start can be cancelled by
  ``close()`` from another thread, and an engine process ends with its parent, SIGKILL too.

A stopped child (SIGSTOP) stands in for one hung while loading: it never answers, and SIGKILL
still ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from serve.worker import EngineProcess, EngineProcessError, ProcessSettings
from tests.serving_helpers import tiny_ranking_artifact

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tiny_synth, tmp_path_factory) -> Path:
    return tiny_ranking_artifact(tiny_synth, tmp_path_factory.mktemp("failover"), tower="hstu")


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for a reaper that is not us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(cond, timeout: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def start_in_thread(engine) -> tuple[threading.Thread, list]:  # noqa: ANN001
    """engine.start() on a thread; the list gets what it raised (or None)."""
    out: list = []

    def run() -> None:
        try:
            engine.start()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def stop_child(engine: EngineProcess) -> int:
    """SIGSTOP the child of a start in progress: it hangs, as one stuck reading its artifact."""
    assert wait_until(lambda: engine.proc is not None and engine.proc.pid is not None, 30)
    os.kill(engine.proc.pid, signal.SIGSTOP)
    return engine.proc.pid


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_a_start_that_hangs_times_out_and_leaves_no_process(artifact):
    engine = EngineProcess("torch", str(artifact), settings=ProcessSettings(threads=1, start_timeout_s=2),
                           start=False)
    t0 = time.monotonic()
    t, out = start_in_thread(engine)
    pid = stop_child(engine)
    try:
        t.join(30)
        assert out, "the start still waits for a child that never answers"
        assert isinstance(out[0], EngineProcessError) and "did not load" in str(out[0])
        assert time.monotonic() - t0 < 20 and gone(pid)
    finally:
        os.kill(pid, signal.SIGKILL) if not gone(pid) else None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
@pytest.mark.parametrize("cls", [EngineProcess])
def test_close_during_a_start_kills_the_child_and_the_start_raises(artifact, cls):
    """What a shutdown or a cancelled Admin load does to an engine still loading."""
    engine = cls("torch", str(artifact), settings=ProcessSettings(threads=1), start=False)
    t, out = start_in_thread(engine)
    assert wait_until(lambda: getattr(engine, "_starting", None) not in (None, False), 30)
    pid = stop_child(engine if cls is EngineProcess else engine._starting)
    try:
        t0 = time.monotonic()
        engine.close(timeout=30)
        t.join(30)
        assert out and isinstance(out[0], EngineProcessError), out
        assert time.monotonic() - t0 < 5 and gone(pid)
        with pytest.raises(EngineProcessError):
            engine.start()  # closed for good
    finally:
        os.kill(pid, signal.SIGKILL) if not gone(pid) else None


PARENT = textwrap.dedent('''
    import sys, threading, time
    if __name__ == "__mp_main__":  # the engine child: loading hangs, as on a stuck file system
        import serve.server
        def hang(*args, **kwargs):
            print("loading", flush=True)
            threading.Event().wait()
        serve.server.make_engine = hang
    if __name__ == "__main__":
        from serve.worker import EngineProcess, ProcessSettings
        engine = EngineProcess("torch", sys.argv[1], settings=ProcessSettings(threads=1), start=False)
        def report():
            while engine.proc is None or engine.proc.pid is None:
                time.sleep(0.01)
            print(engine.proc.pid, flush=True)
        threading.Thread(target=report).start()
        engine.start()
''')


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_an_engine_process_ends_with_its_parent_even_after_sigkill(artifact, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script), str(artifact)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env)
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline() == "loading\n"  # the child (its stdout is the parent's) hangs
        assert not gone(child)
        parent.kill()
        parent.wait(10)
        assert wait_until(lambda: gone(child), 20), "the engine process outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if child and not gone(child):
            os.kill(child, signal.SIGKILL)
