"""Engine processes that fail without an outage, and start-ups that cannot hang the server.

* Every wait of a start is bounded (``start_timeout_s``), a start can be cancelled by
  ``close()`` from another thread, and an engine process ends with its parent, SIGKILL too.
* ``FailoverEngine``: a warm standby takes over when the engine dies; the batches in flight
  run again on it; a new standby loads in the background; with both dead, calls fail at once
  and ``available`` says so until a replacement has loaded.

A stopped child (SIGSTOP) stands in for one hung while loading: it never answers, and SIGKILL
still ends it."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from genrec.loadtest.client import RecommenderClient, user
from genrec.serve.batcher import BatchConfig
from genrec.serve.failover import FailoverEngine
from genrec.serve.requests import Limits, Work, decode_user
from genrec.serve.server import ServeConfig
from genrec.serve.worker import EngineProcess, EngineProcessError, ProcessSettings
from tests.serving_helpers import (
    ThreadedServer,
    local_config,
    tiny_ranking_artifact,
    untrained_artifact,
)

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000


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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_standby_loads_at_idle_priority_from_its_first_instruction(artifact):
    """A standby (``settings.nice``) loads on the CPUs of an engine that serves: from the moment
    its process exists it runs at SCHED_IDLE. (Set only inside the child, the seconds of a
    spawned interpreter's imports and unpickling before it ran normal: 8% of calls refused for
    ~8 s after an engine kill at half capacity, benchmarks/notes/2026-12-05-native-front.md.)"""
    engine = EngineProcess("torch", str(artifact), settings=ProcessSettings(threads=1, nice=10), start=False)
    t, out = start_in_thread(engine)
    try:
        assert wait_until(lambda: engine.proc is not None and engine.proc.pid is not None, 30)
        time.sleep(0.05)  # (past the parent's own call right after the spawn; the imports take seconds)
        seen = set()
        while not out:  # the child's policy while it loads
            try:
                seen.add(os.sched_getscheduler(engine.proc.pid))
            except OSError:
                break
            time.sleep(0.005)
        t.join(120)
        assert out == [None], out
        assert seen == {os.SCHED_IDLE}, seen
    finally:
        engine.close()


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
@pytest.mark.parametrize("cls", [EngineProcess, FailoverEngine])
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


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_close_waits_for_a_standby_that_loaded_but_has_no_slot_yet(artifact, monkeypatch):
    """A standby that finished loading just as close() ran (between its start and its slot) is
    stopped before close() returns: no engine process outlives the engine that started it."""
    placing, place = threading.Event(), FailoverEngine._place

    def slow_place(self, engine):  # noqa: ANN001, ANN202 - the standby's start is done, its slot not taken
        if self.active is not None:
            placing.set()
            time.sleep(1.0)
        return place(self, engine)

    monkeypatch.setattr(FailoverEngine, "_place", slow_place)
    engine = FailoverEngine("torch", str(artifact), settings=ProcessSettings(threads=1))
    assert placing.wait(60)
    engine.close(timeout=30)
    assert not [c for c in mp.active_children() if c.name.startswith("genrec-engine")]


PARENT = textwrap.dedent('''
    import sys, threading, time
    if __name__ == "__mp_main__":  # the engine child: loading hangs, as on a stuck file system
        import genrec.serve.factory
        def hang(*args, **kwargs):
            print("loading", flush=True)
            threading.Event().wait()
        genrec.serve.factory.make_engine = hang
    if __name__ == "__main__":
        from genrec.serve.worker import EngineProcess, ProcessSettings
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


# ----- failover ------------------------------------------------------------------------------

def history(n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(1, 600)), T0 + 60 * i, int(rng.choice([1, 3, 7]))) for i in range(n)]


@pytest.fixture(scope="module")
def failover(artifact):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    engine = FailoverEngine("torch", str(artifact), settings=ProcessSettings(threads=1, cpus=(cpu,)))
    states: list[bool] = []
    engine.on_state(states.append)
    engine.states = states  # what the hook was told, for the tests
    yield engine
    pids = [e.proc.pid for e in (engine.active, engine.standby) if e is not None]
    engine.close()  # (a replacement may be loading: cancelled)
    assert all(gone(p) for p in pids)
    assert not [c for c in mp.active_children() if c.name.startswith("genrec-engine")]


def batches(engine: FailoverEngine, n: int) -> list[list[Work]]:
    users = [decode_user(user(history(4 + 3 * i, seed=i), {"region": [3]}), engine.schema, Limits()) for i in range(n)]
    return [[Work("recommend", u, retrieve_k=20, top_k=4)] * 40 for u in users]


def same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.item_ids, b.item_ids)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-6)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def affinity(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_a_killed_engine_fails_over_to_the_standby_with_every_batch_in_flight_answered(failover):
    assert failover.wait_standby(60)
    bs = batches(failover, 3)
    want = [failover.run(b) for b in bs]
    primary, standby = failover.active, failover.standby
    cpu = failover.settings.cpus
    assert affinity(primary.proc.pid) == {frozenset(cpu)}
    c0 = cpu_seconds(standby.proc.pid)
    time.sleep(0.5)
    assert cpu_seconds(standby.proc.pid) - c0 < 0.05  # the standby idles: blocked on its pipe, no polling

    async def kill_with_three_in_flight() -> list:
        tasks = [asyncio.ensure_future(failover.run_async(b)) for b in bs]
        await asyncio.sleep(0)  # each has sent its batch to the primary's pipe
        assert len(primary._pending) == 3
        os.kill(primary.proc.pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    got = asyncio.run(kill_with_three_in_flight())
    for g, w in zip(got, want, strict=True):  # re-run on the standby: the same answers
        same(g, w)
    assert failover.active is standby and failover.available and False not in failover.states
    assert affinity(standby.proc.pid) == {frozenset(cpu)}  # it took the primary's CPUs
    assert failover.wait_standby(60) and failover.standby is not primary and failover.restarts == 1
    assert gone(primary.proc.pid)
    same(asyncio.run(failover.run_async(bs[0])), want[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_the_server_loses_no_call_when_its_engine_process_is_killed(failover, artifact):
    """The server takes the failover engine as it would an engine process: calls keep coming from
    two clients while the serving process is SIGKILLed, and every one is answered."""
    assert failover.wait_standby(60)
    srv = ThreadedServer(artifact, local_config(batch=BatchConfig(max_inflight=3)),
                         engine=failover)
    client = RecommenderClient(srv.target, timeout_s=30)
    done, errors, stop = [0, 0], [], threading.Event()

    def calls(i: int) -> None:
        u = user(history(6 + i, seed=i), {"region": [3]})
        while not stop.is_set():
            try:
                assert len(client.recommend(u, retrieve_k=20, top_k=5).items) == 5
                done[i] += 1
            except Exception as e:  # noqa: BLE001 - the test counts them
                errors.append(e)

    threads = [threading.Thread(target=calls, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: min(done) >= 20, 30)
        killed = failover.active
        os.kill(killed.proc.pid, signal.SIGKILL)
        at = list(done)
        assert wait_until(lambda: failover.active is not killed and min(d - a for d, a in zip(done, at)) >= 20, 30)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        srv.stop()
    assert errors == [] and failover.available


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_both_engines_dead_is_unavailable_then_recovers(failover):
    assert failover.wait_standby(60)
    bs = batches(failover, 1)
    want = failover.run(bs[0])
    restarts, told = failover.restarts, len(failover.states)
    for e in (failover.active, failover.standby):
        os.kill(e.proc.pid, signal.SIGKILL)
    # the watchers see both deaths with no traffic; a replacement loads for seconds
    assert wait_until(lambda: not failover.available, 10)
    with pytest.raises(EngineProcessError, match="no engine process can answer"):
        failover.run(bs[0])
    with pytest.raises(EngineProcessError, match="no engine process can answer"):
        asyncio.run(failover.run_async(bs[0]))
    assert failover.wait_standby(60) and failover.available
    assert failover.states[told:] == [False, True] and failover.restarts == restarts + 2
    same(failover.run(bs[0]), want)
    # a death nobody has seen yet: the thread's batch finds it and runs on the standby
    os.kill(failover.active.proc.pid, signal.SIGKILL)
    same(failover.run(bs[0]), want)
    assert failover.available


def test_health_is_not_serving_only_while_no_engine_process_can_answer(artifact):
    """The server's own engine (a standby by default): health stays SERVING when one process dies,
    turns NOT_SERVING when both are dead, and SERVING again once a replacement has loaded."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = ThreadedServer(artifact, ServeConfig(host="127.0.0.1", port=0, engine_process=True,
                                               process=ProcessSettings(threads=1)))
    engine = srv.server.engine
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.target))

    def status() -> int:
        return stub.Check(health_pb2.HealthCheckRequest(service="genrec.v1.Recommender"), timeout=5).status

    serving, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert isinstance(engine, FailoverEngine) and engine.wait_standby(60)
        assert status() == serving
        killed = engine.active
        os.kill(killed.proc.pid, signal.SIGKILL)
        # the standby takes over at once (its replacement loads for seconds, longer on a busy machine)
        assert wait_until(lambda: engine.active not in (None, killed), 10)
        assert status() == serving
        assert engine.wait_standby(120) and engine.restarts == 1
        for e in (engine.active, engine.standby):
            os.kill(e.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: status() == down, 10)
        assert wait_until(lambda: status() == serving, 120)
        assert len(RecommenderClient(srv.target, 10).retrieve(user(history(6, 0), {"region": [3]}), k=5).items) == 5
    finally:
        srv.stop()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_a_standby_started_after_the_artifact_changed_on_disk_is_refused(tmp_path):
    """Same names, other weights: the artifact's files are replaced by another model's and the
    serving process is SIGKILLed. The standby loaded before the change takes over; the one
    started after it finds the other model (its version: a hash of the content) and is stopped;
    with the last process of the first model killed too, nothing answers: no call is answered by
    the other model under the first one's version."""
    live, other = untrained_artifact(tmp_path / "live"), untrained_artifact(tmp_path / "other", seed=1)
    engine = FailoverEngine("torch", str(live), settings=ProcessSettings(threads=1))
    try:
        assert engine.wait_standby(60)
        u = decode_user(user([(5, T0, 1), (9, T0 + 60, 3)], {"region": [2]}), engine.schema, Limits())
        works = [Work("recommend", u, retrieve_k=20, top_k=4)]
        want = engine.run(works)
        for name in ("embeddings.safetensors", "dense.safetensors", "manifest.json"):
            shutil.copyfile(other / name, live / f".{name}")
            os.replace(live / f".{name}", live / name)
        os.kill(engine.active.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: [s.state for s in engine.replica_states()] == ["ready", "refused"], 60), \
            engine.replica_states()
        serving, refused = engine.replica_states()
        assert serving.version == engine.version != refused.version and "now holds the model" in refused.detail
        same(engine.run(works), want)
        os.kill(engine.active.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not engine.available, 10)
        with pytest.raises(EngineProcessError):
            engine.run(works)
        assert [s.state for s in engine.replica_states()] == ["dead", "refused"]
    finally:
        starting = engine._starting  # (a standby retrying its start: close() cancels it)
        engine.close()
    assert serving.pid and gone(serving.pid) and (starting is None or starting.proc is None or gone(starting.proc.pid))
