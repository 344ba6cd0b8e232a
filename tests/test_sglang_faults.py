"""The SGLang engine's request path is contained (issue 42, item 3): an exception in the model's
forward fails only its call and the engine goes on; a killed SGLang scheduler under steady load
at about half the capacity fails over to the warm standby, the gRPC server stays SERVING and at
most 1% of calls fail (each naming its cause); a call past its deadline stops waiting, its SGLang
requests aborted. One engine (and its standby) for the whole module: they take a while to start.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genrec.loadtest.client import user
from genrec.serve.batcher import BatchConfig
from genrec.serve.engine import TorchEngine
from tests.serving_helpers import ThreadedServer, local_config
from tests.test_sglang import KINDS, artifact, history, same, work  # noqa: F401 - artifact: a fixture

T0 = 1_700_000_000


@pytest.fixture(scope="module")
def engines(artifact):  # noqa: F811
    from genrec.serve.sglang_engine import SGLangEngine

    se = SGLangEngine(artifact, pool_tokens=8192, threads=1, standby=True)
    try:
        yield TorchEngine(artifact), se
    finally:
        se.close()


def _wait(cond, seconds: float = 120.0) -> bool:  # noqa: ANN001
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_a_call_past_its_deadline_stops_waiting_and_the_engine_goes_on(engines):
    from genrec.serve.batcher import DeadlineExceeded

    te, se = engines
    w = work(te.schema, history(90, seed=1), "recommend", uid="late", seed=1)
    w.deadline = time.monotonic() + 0.002  # SGLang's round trip alone takes longer
    t = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="aborted"):
        se.run([w])
    assert time.monotonic() - t < 1.0  # bounded by the deadline, not by SGLang's answer
    w.deadline = float("inf")
    same(te, se, [w])


def test_an_exception_in_the_forward_fails_its_call_only(engines):
    """A request whose payload breaks the model's forward (a KeyError there), in one SGLang
    batch with good ones: it fails naming the reason, they are answered, nothing restarts."""
    from genrec.serve.sglang_engine import ModelForwardError

    te, se = engines
    active = se.runtimes.active
    works = [work(te.schema, history(20 + i, seed=10 + i), KINDS[i % 3], uid=f"fw{i}", seed=i) for i in range(3)]
    reqs = [se._request(w) for w in works]
    broken = se._request(works[0])
    del broken.payload["events"]  # what a bug in the forward looks like to SGLang's scheduler
    outs = se.send([broken, *reqs[1:]], time.monotonic() + 60)
    assert "KeyError" in outs[0]["meta_info"]["genrec_error"][-1]
    assert not [e for o in outs[1:] for e in (o["meta_info"].get("genrec_error") or []) if e]
    with pytest.raises(ModelForwardError, match="KeyError"):
        se._call([broken], time.monotonic() + 60, works[:1])
    # the engine goes on, the same runtime, and the failed user's half-written entries are not matched
    got = same(te, se, works)
    assert se.runtimes.active is active and se.runtimes.failovers == 0
    assert got[0].cached_tokens == 0 and se.cache_stats()["failed_requests"] == 1


class _Load:
    """Steady load through ``client``: eight users of 30 events (ids ``prefix0`` to ``prefix7``),
    each called once first (warm, and one call's mean latency measured), then two drivers, each
    calling and then sleeping that latency: about half of what the engine sustains.
    ``pick(i, users)``: call i's user (default: the users in turn). ``calls``: (user id, status
    code or None when answered, details) of every call of the load."""

    def __init__(self, client, prefix: str, seed: int, pick=None) -> None:  # noqa: ANN001
        self.client, self.pick = client, pick or (lambda i, us: us[i % len(us)])
        self.users = [user(history(30, seed=seed + i), {"region": [i % 5]}) for i in range(8)]
        for i, u in enumerate(self.users):
            u.user_id = f"{prefix}{i}"
        t = time.monotonic()
        for u in self.users:
            client.recommend(u, retrieve_k=20, top_k=5)
        self.latency = (time.monotonic() - t) / len(self.users)
        self.calls: list[tuple[str, grpc.StatusCode | None, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._drive, args=(k,)) for k in range(2)]

    def _drive(self, i: int) -> None:
        while not self._stop.is_set():
            u = self.pick(i, self.users)
            try:
                self.client.recommend(u, retrieve_k=20, top_k=5)
                self.calls.append((u.user_id, None, ""))
            except grpc.RpcError as e:
                self.calls.append((u.user_id, e.code(), e.details()))
            i += 2
            time.sleep(self.latency)

    def start(self) -> None:
        for th in self._threads:
            th.start()

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(30)

    def run(self, seconds: float) -> None:
        self.start()
        time.sleep(seconds)
        self.stop()


def _poisoned(se, monkeypatch) -> None:  # noqa: ANN001
    """Users named ``poison...`` send a payload that breaks the model's forward (a KeyError in
    the scheduler: what a bug there looks like), through the server's own request path."""
    make = se._request

    def request(w):  # noqa: ANN001, ANN202
        r = make(w)
        if w.user.user_id.startswith("poison"):
            del r.payload["events"]
        return r

    monkeypatch.setattr(se, "_request", request)


def test_a_call_that_breaks_the_forward_fails_alone_under_load(artifact, engines, monkeypatch):  # noqa: F811
    """Through the gRPC server: a call whose request breaks the model's forward fails INTERNAL
    naming the cause, and only it: the calls batched with it are answered (once, the batch's
    error failed them all). Then at about half the capacity, poisoned calls among the load:
    at most 1% of the others fail, the server stays SERVING, no runtime restarts."""
    te, se = engines
    failovers = se.runtimes.failovers
    _poisoned(se, monkeypatch)
    names = ["poison0", "good0", "good1"]
    users = {n: user(history(30, seed=700 + i), {"region": [i % 5]}) for i, n in enumerate(names)}
    for n, u in users.items():
        u.user_id = n
    # every poisoned call in one batch with two good ones: the batch fills to three before it runs
    srv = ThreadedServer(artifact, cfg=local_config(batch=BatchConfig(max_batch=3, max_wait_ms=2000.0)), engine=se)
    try:
        client = srv.client(timeout_s=30)
        for _ in range(3):
            gate, got = threading.Barrier(3), {}

            def call(n: str, gate: threading.Barrier, got: dict) -> None:
                gate.wait()
                try:
                    got[n] = client.recommend(users[n], retrieve_k=20, top_k=5)
                except grpc.RpcError as e:
                    got[n] = e

            threads = [threading.Thread(target=call, args=(n, gate, got)) for n in names]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            bad = got["poison0"]
            assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INTERNAL, bad
            assert "KeyError" in bad.details() and "forward" in bad.details()
            for n in names[1:]:
                assert not isinstance(got[n], grpc.RpcError), (n, got[n])
                assert len(got[n].items) == 5
    finally:
        srv.stop()
    # the load of the killed-scheduler test, with a poisoned call among every few
    srv = ThreadedServer(artifact, engine=se)
    try:
        poison = users["poison0"]
        load = _Load(srv.client(timeout_s=10), "steady", 800, lambda i, us: poison if i % 8 == 7 else us[i % len(us)])
        load.run(5.0)
        poisoned = [(c, d) for u, c, d in load.calls if u == "poison0"]
        failed = [(c, d) for u, c, d in load.calls if u != "poison0" and c is not None]
        ok = sum(1 for u, c, _ in load.calls if u != "poison0" and c is None)
        assert ok > 50 and len(failed) <= 0.01 * ok, (ok, failed[:3])
        assert poisoned and all(c == grpc.StatusCode.INTERNAL and "KeyError" in d for c, d in poisoned), poisoned[:3]
        assert _health(srv.target) == health_pb2.HealthCheckResponse.SERVING
        assert se.runtimes.failovers == failovers and se.available
    finally:
        srv.stop()


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_a_killed_scheduler_fails_over_under_load_and_the_server_keeps_serving(artifact, engines):  # noqa: F811
    te, se = engines
    assert _wait(lambda: se.runtimes.standby is not None), "the standby runtime did not start"
    srv = ThreadedServer(artifact, engine=se)
    try:
        load = _Load(srv.client(timeout_s=10), "load", 500)
        load.start()
        time.sleep(2.0)
        active = se.runtimes.active
        sched = next((p for p in active.procs if "scheduler" in active.names[p.pid]), active.procs[0])
        os.kill(sched.pid, signal.SIGKILL)
        assert _wait(lambda: se.runtimes.active is not active, 10)
        time.sleep(3.0)
        load.stop()
        failed = [(c, d) for _, c, d in load.calls if c is not None]
        total = len(load.calls)
        assert total > 50 and len(failed) <= 0.01 * total, (total, failed[:3])
        for code, details in failed:
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) and details
        assert se.runtimes.failovers == 1 and se.available
        assert _health(srv.target) == health_pb2.HealthCheckResponse.SERVING
        # the answers are still the reference's (a new runtime: nothing cached)
        w = work(te.schema, history(30, seed=500), "recommend", uid="load0", seed=0)
        r = same(te, se, [w])[0]
        assert r.cached_tokens in (0, 29)
        # a new standby, started REBUILD_DELAY_S after the takeover (out of the way of the calls it took over)
        assert _wait(lambda: se.runtimes.standby is not None, 180), "no new standby after the failover"
    finally:
        srv.stop()
