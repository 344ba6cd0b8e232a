"""One model per version label, bounded loads and the hot swap's schema race (issue 46).

* ``model_version`` ends in a hash of the artifact's content: two models under the same
  names differ in it, and an engine process (a pool's replica restarting a dead child, a
  failover engine's standby: tests/test_engine_failover.py) that finds another model on disk
  than the one it serves is stopped and reported ``refused``: no call is answered by the
  other model.
* ``admin.load_timeout_s`` bounds the whole engine start of a load (in this process, in an
  engine process, and a build that waits for child processes of its own, as SGLang's does):
  the start is stopped, the call fails DEADLINE_EXCEEDED naming the step, the next load runs.
* A call validated against the old model's schema runs on the old model, even when a reload
  swaps in a model with another schema before its batch runs; the old engine closes after.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genrec.loadtest.client import user
from genrec.proto.v1 import recommender_pb2 as pb
from genrec.quant.artifact import FILES, MANIFEST
from genrec.serve.batcher import BatchConfig
from genrec.serve.engine import TorchEngine
from genrec.serve.factory import make_engine
from genrec.serve.server import AdminConfig, ServeConfig
from genrec.serve.worker import ProcessSettings
from tests.serving_helpers import (
    SlowEngine,
    ThreadedServer,
    admin_token_file,
    local_config,
    untrained_artifact,
)

T0 = 1_700_000_000
U = user([(5, T0, 1), (9, T0 + 60, 3), (17, T0 + 120, 1)], {"region": [2]})


def swap_in(src: Path, dst: Path) -> None:
    """``src``'s files replace ``dst``'s under the same names (each by a rename: whole files)."""
    for name in (*FILES, MANIFEST):
        shutil.copyfile(src / name, dst / f".{name}.new")
        os.replace(dst / f".{name}.new", dst / name)


def answer(resp) -> tuple:  # noqa: ANN001
    return resp.model_version, tuple(i.item_id for i in resp.items), tuple(round(i.score, 5) for i in resp.items)


def engines() -> list[mp.process.BaseProcess]:
    return [c for c in mp.active_children() if c.name.startswith("genrec-engine")]


def wait_until(cond, timeout: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_the_version_label_tells_two_models_under_the_same_names_apart(tmp_path):
    a, b = untrained_artifact(tmp_path / "a"), untrained_artifact(tmp_path / "b", seed=1)
    again = untrained_artifact(tmp_path / "again")  # the same model written again (another time stamp)
    va, vb, v_again = (TorchEngine(p).version for p in (a, b, again))
    assert va.split("@")[0] == vb.split("@")[0]  # run / checkpoint / quantization: the same names
    assert va != vb and va == v_again


def test_a_replica_restarted_after_the_artifact_changed_on_disk_serves_nothing(tmp_path):
    """A pool of two engine processes; the artifact's files are replaced by another model's
    (same names, other weights) and a replica's process is SIGKILLed: its restart loads the
    other model, is refused, and its batches go to the other replica; with both refused, calls
    fail UNAVAILABLE. Every answer comes from the first model under its label; GetModelInfo
    says which replica holds what; a LoadArtifact then serves the new model."""
    live, other = untrained_artifact(tmp_path / "live"), untrained_artifact(tmp_path / "other", seed=1)
    cfg = ServeConfig(host="127.0.0.1", port=0, engine_process=True, engine_replicas=2,
                      process=ProcessSettings(threads=1), batch=BatchConfig(max_inflight=2, max_wait_ms=0))
    srv = ThreadedServer(live, cfg)
    try:
        c = srv.client(timeout_s=60)
        want = answer(c.recommend(U, retrieve_k=20, top_k=5))
        info = c.info()
        assert [(r.role, r.state, r.model_version) for r in info.replicas] == [
            ("replica 0", "ready", want[0]), ("replica 1", "ready", want[0])]
        swap_in(other, live)
        pool = srv.server.engine
        os.kill(pool.replicas[0].proc.pid, signal.SIGKILL)
        got: set = set()

        def call(_: int) -> object:
            try:
                return answer(c.recommend(U, retrieve_k=20, top_k=5))
            except grpc.RpcError as e:  # (a batch waits for the dead replica's restart: its calls may expire)
                return e.code()

        def refused() -> bool:  # calls until a batch has met the dead replica and its restart was refused
            with ThreadPoolExecutor(2) as ex:
                got.update(ex.map(call, range(4)))
            return c.info().replicas[0].state == "refused" or any(a != want for a in got if isinstance(a, tuple))

        assert wait_until(refused, 90)
        assert {a for a in got if isinstance(a, tuple)} == {want}  # every answer: the first model, its label
        states = {r.role: r for r in c.info().replicas}
        assert states["replica 0"].model_version != want[0]
        assert "now holds the model" in states["replica 0"].detail
        assert (states["replica 1"].state, states["replica 1"].model_version) == ("ready", want[0])
        assert srv.server.engine.available
        os.kill(pool.replicas[1].proc.pid, signal.SIGKILL)  # the last replica of the first model
        codes = []
        for _ in range(3):
            try:
                codes.append(answer(c.recommend(U, retrieve_k=20, top_k=5)))
            except grpc.RpcError as e:
                codes.append(e.code())
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
        assert [r.state for r in c.info().replicas] == ["refused", "refused"] and not srv.server.engine.available
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.target))
        assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service="genrec.v1.Recommender"),
                                               timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        new = c.load_artifact(str(live)).model_version
        assert new != want[0] and new == states["replica 0"].model_version
        got = answer(c.recommend(U, retrieve_k=20, top_k=5))
        assert got[0] == new and got[1:] != want[1:]  # the other model does answer otherwise
    finally:
        srv.stop()


# ----- bounded loads ---------------------------------------------------------------------------

RELEASE = threading.Event()  # lets an in-process build that hangs go on (at the end of a test)
BUILT: list[Tracked] = []


class Tracked(SlowEngine):
    """A real torch engine that remembers whether it was closed."""

    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


def hanging_build(kind: str, artifact: str, device: str, cache=None, retrieval=None, scoring=None):  # noqa: ANN001, ANN201
    """Builds the engine, except for an artifact folder named ``hang`` (hangs: in an engine
    process for good, in this one until RELEASE) or ``hang-child`` (waits for a child process
    that never ends, as SGLang's start waits for its scheduler's)."""
    name = Path(artifact).name
    if name == "hang":
        (threading.Event() if mp.parent_process() is not None else RELEASE).wait()
    if name == "hang-child":
        child = subprocess.Popen(["sleep", "600"])
        (Path(artifact).parent / "child.pid").write_text(str(child.pid))
        child.wait()
        raise RuntimeError("the child process this build waited for ended")
    engine = Tracked(make_engine(kind, artifact, device, cache, retrieval), 0.0)
    BUILT.append(engine)
    return engine


def admin_load(srv: ThreadedServer, path: str) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    try:
        c = srv.client()  # (its deadline is past the server's load_timeout_s)
        c.admin.LoadArtifact(pb.LoadArtifactRequest(path=path), timeout=90, metadata=c.admin_metadata)
        return grpc.StatusCode.OK, "", time.monotonic() - t0
    except grpc.RpcError as e:
        return e.code(), e.details() or "", time.monotonic() - t0


@pytest.fixture
def root(tmp_path) -> Path:
    live = untrained_artifact(tmp_path / "live")
    for name in ("hang", "hang-child"):
        shutil.copytree(live, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "engine-process"])
def test_a_load_that_hangs_is_stopped_at_load_timeout_s_and_the_next_load_runs(root, in_process):
    timeout = 4.0 if in_process else 20.0  # (an engine process of the good artifact loads in seconds)
    admin = AdminConfig(token_file=admin_token_file(), load_timeout_s=timeout)
    cfg = (local_config(admin=admin) if in_process else
           ServeConfig(host="127.0.0.1", port=0, admin=admin, process=ProcessSettings(threads=1, standby=False)))
    RELEASE.clear()
    srv = ThreadedServer(root / "live", cfg, build=hanging_build)
    try:
        before = srv.server.engine.version
        code, detail, took = admin_load(srv, "hang")
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, detail)
        assert "load_timeout_s" in detail and ("in this process" if in_process else "engine process") in detail
        assert timeout <= took < timeout + 15
        if not in_process:  # the process that hung was killed: only the serving one is left
            assert wait_until(lambda: len(engines()) == 1, 10), engines()
        assert srv.server.engine.version == before and len(srv.client().retrieve(U, k=5).items) == 5
        code, detail, _ = admin_load(srv, "live")  # not refused as "in progress"
        assert code == grpc.StatusCode.OK, (code, detail)
        if in_process:  # the hung build ends at last: what it built is closed, never served
            n = len(BUILT)
            RELEASE.set()
            assert wait_until(lambda: len(BUILT) > n and BUILT[-1].closed, 30)
            assert srv.server.engine is not BUILT[-1]
    finally:
        RELEASE.set()
        srv.stop()


def test_a_build_waiting_for_a_child_process_of_its_own_is_stopped_with_the_child(root):
    """SGLang's start, in this process, waits for scheduler processes it spawned: on timeout they
    are killed, which ends the wait; nothing of the load is left."""
    admin = AdminConfig(token_file=admin_token_file(), load_timeout_s=4.0)
    srv = ThreadedServer(root / "live", local_config(admin=admin), build=hanging_build)
    try:
        code, detail, _ = admin_load(srv, "hang-child")
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "building the torch engine in this process" in detail
        pid = int((root / "child.pid").read_text())
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists() or
                          Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 10)
        assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "genrec-load"], 10)
        assert admin_load(srv, "live")[0] == grpc.StatusCode.OK
    finally:
        srv.stop()


# ----- the swap's schema race ----------------------------------------------------------------

GATE, ENTERED = threading.Event(), threading.Event()


class Gated(Tracked):
    """Batches wait at the gate: the first call holds the only batch slot while others queue."""

    def run(self, works):  # noqa: ANN001, ANN201
        ENTERED.set()
        GATE.wait(60)
        return super().run(works)


def gated_build(kind: str, artifact: str, device: str, cache=None, retrieval=None, scoring=None):  # noqa: ANN001, ANN201
    inner = make_engine(kind, artifact, device, cache, retrieval)
    engine = Gated(inner, 0.0) if Path(artifact).name == "old" else Tracked(inner, 0.0)
    BUILT.append(engine)
    return engine


def test_calls_validated_before_a_swap_run_on_the_model_they_were_validated_for(tmp_path):
    """Rank calls are decoded against a model with ranking tasks and queue; a reload swaps in a
    retrieval-only model (another schema) before their batch runs. They run on the old model
    (its answers, its version); the old engine closes once they are done."""
    old, new = untrained_artifact(tmp_path / "old"), untrained_artifact(tmp_path / "new", ranking=False, seed=1)
    GATE.clear()
    ENTERED.clear()
    srv = ThreadedServer(old, local_config(batch=BatchConfig(max_inflight=1, max_wait_ms=0, max_batch=8),
                                           default_timeout_ms=60_000), build=gated_build)
    try:
        first = srv.server.engine
        c = srv.client(timeout_s=60)
        with ThreadPoolExecutor(5) as ex:
            futs = [ex.submit(c.rank, U, [(3, 0.0), (4, 0.0), (150, 0.0)], "click")]
            assert ENTERED.wait(30)  # the first holds the engine; the others queue behind it
            futs += [ex.submit(c.rank, U, [(3, 0.0), (4, 0.0), (150 + i, 0.0)], "click") for i in range(1, 5)]
            assert wait_until(lambda: srv.server.batcher.depth == 4, 30)
            version = c.load_artifact(str(new)).model_version
            assert srv.server.engine is not first and not first.closed  # its calls are still to run
            GATE.set()
            got = [f.result() for f in futs]
        assert {r.model_version for r in got} == {first.version} and all(len(r.items) == 3 for r in got)
        assert all(set(i.tasks) == {"click", "conversion"} for r in got for i in r.items)
        assert wait_until(lambda: first.closed, 30)
        assert c.retrieve(U, k=5).model_version == version
    finally:
        GATE.set()
        srv.stop()
