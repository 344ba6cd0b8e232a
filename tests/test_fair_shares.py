"""Fair shares between callers (serve.admission, serve.batcher's fair queue): a caller past its
share is refused while another keeps being served."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from genrec.loadtest.client import RecommenderClient, user
from genrec.serve.admission import (
    CONTENTION_KEY,
    MAX_NAME,
    FairConfig,
    Shares,
    TenantQuota,
    caller_of,
)
from genrec.serve.batcher import BatchConfig, Batcher, Overloaded
from genrec.serve.contract import Result
from genrec.serve.engine import TorchEngine
from genrec.serve.proxy import available as front_available
from genrec.serve.server import ConnectionConfig
from tests.conftest import native_or_skip
from tests.serving_helpers import (
    SlowEngine,
    ThreadedServer,
    local_config,
    tiny_ranking_artifact,
)

T0 = 1_700_000_000

@pytest.mark.unit
def test_a_caller_is_its_tenant_metadata_else_its_peer_host():
    assert caller_of((("tenant", "ads"),), "ipv4:10.0.0.7:5123", "tenant") == "ads"
    assert caller_of((("other", "x"),), "ipv4:10.0.0.7:5123", "tenant") == "ipv4:10.0.0.7"
    assert caller_of((), "ipv6:[::1]:5123", "tenant") == "ipv6:[::1]"
    assert len(caller_of((("tenant", "x" * 500),), "", "tenant")) == 64  # a bounded key
    # ...that still tells apart long names sharing their first 64 characters
    a, b = (caller_of((("tenant", "p" * 64 + tail),), "", "tenant") for tail in ("-a", "-b"))
    assert a != b and len(a) == len(b) == 64 and a.startswith("p" * 40)


@pytest.mark.unit
def test_shares_bound_each_callers_calls_at_once_and_its_rate():
    cfg = FairConfig(max_share=0.25, quotas=(TenantQuota("ads", max_concurrent=3), TenantQuota("feed", qps=1.0,
                                                                                               burst_s=2.0)))
    s = Shares(cfg, slots=16)  # 4 at once for anyone without a quota of its own ...
    for _ in range(6):
        s.acquire("peer-a")  # ... once another caller is active: alone, a caller may use every slot
    s.acquire("peer-b")  # another caller is not held back by peer-a
    with pytest.raises(Overloaded, match="'peer-a' has 6 calls"):
        s.acquire("peer-a")  # and now peer-a is past its share
    s.release("peer-a")
    s.release("peer-a")
    for _ in range(3):
        s.acquire("ads")
    with pytest.raises(Overloaded, match="'ads'"):
        s.acquire("ads")
    s.release("peer-a")
    s.acquire("peer-a")  # a released call frees its place
    s.acquire("feed")
    s.acquire("feed")  # a burst of 2
    with pytest.raises(Overloaded, match="rate"):
        s.acquire("feed")
    assert s.refused == {"other": 1, "ads": 1, "feed": 1}
    for _ in range(5):
        s.release("peer-b")  # more releases than acquires leave no entry behind
    assert "peer-b" not in s.held
    with pytest.raises(ValueError, match="max_share"):
        FairConfig(max_share=0)
    # limits that could never apply, or would refuse every call, are config errors
    with pytest.raises(ValueError, match="at most 64 characters"):  # (longer callers' names: a digest)
        TenantQuota("t" * 65, max_concurrent=1)
    for bad in (dict(max_concurrent=-1), dict(qps=-1.0), dict(qps=float("nan")), dict(burst_s=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TenantQuota("ads", **bad)
    # gRPC lower-cases keys: "Tenant" never arrives; the front end's own key would let a caller
    # named "light" pass as light
    for key in ("Tenant", "", "grpc-tenant", "tenant-bin", CONTENTION_KEY):
        with pytest.raises(ValueError, match="metadata_key"):
            FairConfig(metadata_key=key)
    assert FairConfig(metadata_key="x-tenant.id").metadata_key == "x-tenant.id"


@pytest.mark.unit
def test_the_share_binds_only_while_another_caller_is_active():
    s = Shares(FairConfig(max_share=0.25, active_s=0.05), slots=8)
    s.acquire("b")
    s.release("b")
    s.acquire("a")
    s.acquire("a")
    with pytest.raises(Overloaded):
        s.acquire("a")  # b called 0 s ago: a gets its 2
    time.sleep(0.1)  # b has gone quiet: a may use every slot
    for _ in range(6):
        s.acquire("a")
    with pytest.raises(Overloaded, match="has 8 calls"):
        s.acquire("a")


@pytest.mark.unit
def test_batches_take_callers_in_turn_so_a_backlog_delays_only_its_own_caller():
    async def scenario() -> tuple[list[str], float, float]:
        engine = SimpleNamespace(batches_together=False, parallel=1)
        b = Batcher(lambda: engine, BatchConfig(max_batch=4, max_wait_ms=0))
        loop = asyncio.get_running_loop()
        def work(name: str) -> SimpleNamespace:
            return SimpleNamespace(name=name, deadline=time.monotonic() + 60)

        for i in range(12):  # a flood from one caller ...
            b.queues.setdefault("flood", collections.deque()).append((work(f"f{i}"), loop.create_future(), engine))
        b.queued = 12
        b.queues["quiet"] = collections.deque([(work("q0"), loop.create_future(), engine)])
        b.queued += 1
        for _ in range(10):
            b.cost.observe(4, 0.004)  # 1 ms a call
        waits = b.predicted_wait(caller="quiet"), b.predicted_wait(caller="flood")
        batch, _ = await b._collect()
        return [w.name for w, _ in batch], *waits

    first, quiet_wait, flood_wait = asyncio.run(scenario())
    assert "q0" in first  # ... and one call of another caller rides in the first batch
    assert quiet_wait < flood_wait / 3  # and admission knows: the quiet caller's wait is short


@pytest.mark.unit
def test_the_batchers_share_is_given_only_while_another_caller_is_active(monkeypatch):
    """On the real clock a stall of a few ms while "quiet" held its call (a busy CI machine) made
    it the heavier holder of the test's microseconds, and read 0.5: the clock is the test's own."""
    import genrec.serve.admission as admission

    clock = [100.0]

    def tick() -> float:
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(admission.time, "monotonic", tick)
    shares = Shares(FairConfig(max_share=0.25, active_s=60), slots=32)
    shares.acquire("a")
    assert shares.contended("a") is None  # alone: the whole budget
    shares.acquire("b")
    assert shares.contended("a") == shares.contended("b") == 0.25
    assert Shares(FairConfig(enabled=False), slots=32).contended("a") is None
    # a light caller (a quarter of the calls beside a flood) is not held to it: its bursts ride
    # on the budget the flood leaves (benchmarks/notes/2026-12-06-two-callers.md)
    shares = Shares(FairConfig(max_share=0.5, active_s=60), slots=32)
    for i in range(40):
        shares.acquire("flood")
        shares.release("flood")
        if i % 4 == 0:
            shares.acquire("quiet")
            shares.release("quiet")
    assert shares.contended("flood") == 0.5 and shares.contended("quiet") == 0.0


@pytest.mark.unit
def test_a_caller_of_few_long_calls_is_heavy_by_what_it_holds(monkeypatch):
    """Heaviness by calls sent alone let a caller of few, long calls (20 a second, a second
    each) take every slot beside one of many short calls; what a caller holds counts too."""
    import genrec.serve.admission as admission

    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    shares = Shares(FairConfig(max_share=0.5, active_s=1.0), slots=8)
    outcomes = []
    for tick in range(200):  # 2 s: the short caller every 10 ms (5 ms each), the long one every 50 ms
        clock[0] += 0.005
        shares.acquire("short")
        clock[0] += 0.005
        shares.release("short")
        if tick % 5 == 0:
            try:
                shares.acquire("long")  # (never released: each call outlives the test)
                outcomes.append("ok")
            except Overloaded:
                outcomes.append("refused")
    assert outcomes.count("ok") == 4, outcomes  # its share of the 8 slots, then refused
    assert shares.heavy("long", clock[0])


@pytest.mark.unit
def test_thousands_of_recent_callers_rebuild_the_tables_once_per_active_s(monkeypatch):
    """Past 4,096 recent callers the tables were rebuilt on every call (1 ms a call, under the
    lock the event loop shares); they are pruned at most once per ``active_s`` now."""
    import genrec.serve.admission as admission

    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    shares = Shares(FairConfig(max_share=0.5, active_s=1.0), slots=8)
    rebuilds, last = 0, shares.pruned_at
    for i in range(6000):  # 6,000 callers in 0.6 s
        clock[0] += 0.0001
        shares.acquire(f"host-{i}")
        shares.release(f"host-{i}")
        rebuilds, last = rebuilds + (shares.pruned_at != last), shares.pruned_at
    assert rebuilds == 1 and len(shares.rates) > 4096


@pytest.mark.unit
def test_a_light_caller_beside_a_heavy_one_may_wait_twice_the_budget():
    """The quiet caller's last refusals beside a 4x flood were the budget itself: a call
    predicted to wait 20-22 ms against 20 ms, the heavy caller's calls in flight
    (benchmarks/notes/2026-12-06-two-callers.md). A light caller may wait up to twice it."""
    async def scenario() -> list[str]:
        engine = SimpleNamespace(batches_together=False, parallel=1)
        b = Batcher(lambda: engine, BatchConfig(max_batch=4, max_wait_ms=0, max_queue_ms=20))
        loop = asyncio.get_running_loop()
        b.queues["flood"] = collections.deque(
            (SimpleNamespace(deadline=time.monotonic() + 60), loop.create_future(), engine) for _ in range(30))
        b.queued = 30
        for _ in range(10):
            b.cost.observe(4, 0.004)  # 1 ms a call: ~30 ms of work ahead of everyone
        out = []
        for share in (None, 0.0):
            try:
                b.admit(time.monotonic() + 60, "flood" if share is None else "quiet", share)
                out.append("admitted")
            except Overloaded:
                out.append("refused")
        return out

    assert asyncio.run(scenario()) == ["refused", "admitted"]


@pytest.mark.unit
def test_a_flood_cannot_fill_the_batches_in_flight_that_every_caller_waits_for():
    """A caller offering ~8x capacity beside a quiet one at a fifth of it: admission stops the
    flood at its share of the queueing budget, so the quiet caller's calls (which wait for the
    batches in flight, whoever's calls they hold) still start in time; without the share the
    flood keeps the pipeline full and the quiet caller is refused with it."""
    class Engine:
        batches_together, parallel = False, 1

        def __init__(self) -> None:
            self.busy = asyncio.Lock()  # one batch at a time, as one engine process computes them

        async def run_async(self, works):  # noqa: ANN001, ANN202 - 2 ms a call: ~500 calls/s
            async with self.busy:
                await asyncio.sleep(0.002 * len(works))
            return [Result(np.zeros(0, np.int64), np.zeros(0, np.float32), compute_ms=2.0 * len(works),
                           batch_size=len(works)) for _ in works]

    async def scenario(share: float | None) -> dict[str, collections.Counter]:
        engine = Engine()
        b = Batcher(lambda: engine, BatchConfig(max_batch=8, max_wait_ms=0, max_queue_ms=20, max_inflight=3))
        b.start()
        codes = {"flood": collections.Counter(), "quiet": collections.Counter()}
        counted = time.monotonic() + 0.2  # (the first batches fit the cost model: admission is blind before)

        async def call(caller: str) -> None:
            seen = codes[caller] if time.monotonic() > counted else collections.Counter()
            try:
                b.admit(time.monotonic() + 1, caller, share)
            except Overloaded:
                seen["refused"] += 1
                return
            await b.submit(SimpleNamespace(deadline=time.monotonic() + 1), caller=caller)
            seen["ok"] += 1

        calls, end, tick = [], time.monotonic() + 1.7, 0
        while time.monotonic() < end:
            calls += [asyncio.create_task(call("flood")) for _ in range(4)]
            if tick % 10 == 0:
                calls.append(asyncio.create_task(call("quiet")))
            tick += 1
            await asyncio.sleep(0.001)
        await asyncio.gather(*calls)
        b.loop_task.cancel()
        return codes

    fair, unfair = asyncio.run(scenario(0.5)), asyncio.run(scenario(None))
    assert fair["quiet"]["refused"] <= 0.05 * sum(fair["quiet"].values()), fair
    assert fair["flood"]["ok"] >= 0.5 * unfair["flood"]["ok"], (fair, unfair)  # the flood still gets the rest
    assert unfair["quiet"]["refused"] >= 0.2 * sum(unfair["quiet"].values()), unfair  # (what the share prevents)


@pytest.fixture(scope="module")
def artifact(tiny_synth, tmp_path_factory):
    return tiny_ranking_artifact(tiny_synth, tmp_path_factory.mktemp("fair"))


@pytest.mark.serving
@pytest.mark.parametrize("front_end", ["aio", "threads", "native"])
@pytest.mark.parametrize("names", [("flood", "quiet"), ("p" * 64 + "-flood", "p" * 64 + "-quiet")],
                         ids=["short-names", "names-sharing-64-characters"])
def test_a_flooding_tenant_is_refused_past_its_share_while_another_is_served(artifact, front_end, names):
    """On every listener (serve.frontend: the thread-pool one takes shares on its handler threads;
    serve.proxy: the native front end takes them in front of the server, a caller's share of its cap).
    Long names are bounded, not cut: two names alike in their first 64 characters are two callers."""
    if front_end == "native":
        native_or_skip(front_available())
    engine = SlowEngine(TorchEngine(artifact), delay=0.05)  # ~80 calls/s at batches of 4
    cfg = local_config(batch=BatchConfig(max_batch=4, max_wait_ms=1, max_queue=64, max_queue_ms=200),
                       fair=FairConfig(max_share=0.25), connections=ConnectionConfig(front_end=front_end))
    srv = ThreadedServer(artifact, cfg, engine=engine)
    try:
        u = user([(i + 1, T0 + 60 * i, 1) for i in range(6)], {"region": [3]})
        flood = RecommenderClient(srv.target, timeout_s=5, tenant=names[0])
        quiet = RecommenderClient(srv.target, timeout_s=5, tenant=names[1])
        stop = threading.Event()
        flood_codes: list[str] = []

        def flooding(_):
            while not stop.is_set():
                try:
                    flood.retrieve(u, k=5)
                    flood_codes.append("OK")
                except grpc.RpcError as e:
                    flood_codes.append(e.code().name + ":" + (e.details() or ""))

        # 16 calls at once: past its share (8 of the 32 handler slots), within the listener's limits.
        # (gRPC's core limits, slots and the pending bound, are shared by every caller: a flood
        # that fills them gets others refused there too; serve/admission.py's docstring)
        with ThreadPoolExecutor(16) as pool:
            for i in range(16):
                pool.submit(flooding, i)
            time.sleep(0.5)
            quiet_codes = []
            for _ in range(15):
                try:
                    quiet.retrieve(u, k=5)
                    quiet_codes.append("OK")
                except grpc.RpcError as e:
                    quiet_codes.append(e.code().name)
            stop.set()
        assert quiet_codes == ["OK"] * 15, quiet_codes
        refused = [c for c in flood_codes if c.startswith("RESOURCE_EXHAUSTED")]
        shown = names[0][:MAX_NAME - 17]  # (the whole name where it fits)
        assert refused and any(f"caller '{shown}" in c for c in refused), set(flood_codes)
    finally:
        srv.stop()


@pytest.mark.parametrize("front_end", ["aio", "native"])
def test_a_tenants_rate_quota_binds_on_every_listener(artifact, front_end):
    """``[[serve.fair.quotas]]`` are the server's (serve.admission.Shares), not the front end's:
    behind the native front end the server still takes each call's quota."""
    if front_end == "native":
        native_or_skip(front_available())
    cfg = local_config(fair=FairConfig(quotas=(TenantQuota("metered", qps=1.0, burst_s=1.0),)),
                       connections=ConnectionConfig(front_end=front_end))
    srv = ThreadedServer(artifact, cfg)
    try:
        u = user([(i + 1, T0 + 60 * i, 1) for i in range(6)], {"region": [3]})
        metered = RecommenderClient(srv.target, timeout_s=5, tenant="metered")
        codes = []
        for _ in range(4):  # within a second: one call's worth of tokens
            try:
                metered.retrieve(u, k=5)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(f"{e.code().name}: {e.details()}")
        assert codes[0] == "OK" and any("past its rate" in c for c in codes[1:]), codes
        assert RecommenderClient(srv.target, timeout_s=5, tenant="other").retrieve(u, k=5).items
    finally:
        srv.stop()


@pytest.mark.serving
def test_behind_the_native_front_end_calls_are_held_to_its_word_on_the_caller(artifact):
    """The server saw only the calls the front end let through: a flood held to its places
    there looked no heavier than a quiet caller's burst, and the server, judging again, refused
    the quiet caller as the heavy one (a resilience probe: 18 of its 23 refusals came from the
    server). The front end now forwards its own judgement (serve.proxy.CONTENTION_KEY), which
    the batcher's admission takes; a client's own value for that key is dropped. Here the
    server's own judgement is made blind (None) so that only the front end's word can count."""
    native_or_skip(front_available())
    engine = SlowEngine(TorchEngine(artifact), delay=0.05)
    cfg = local_config(batch=BatchConfig(max_batch=4, max_wait_ms=1, max_queue=64, max_queue_ms=1000),
                       fair=FairConfig(max_share=0.5), connections=ConnectionConfig(front_end="native"))
    srv = ThreadedServer(artifact, cfg, engine=engine)
    seen: list[tuple[str, float | None]] = []
    admit = srv.server.batcher.admit
    srv.server.shares.contended = lambda caller: None  # (the server's own judgement, blinded)

    def recording(deadline, caller="", share=None):  # noqa: ANN001, ANN202
        seen.append((caller, share))
        return admit(deadline, caller, share)

    srv.server.batcher.admit = recording
    try:
        u = user([(i + 1, T0 + 60 * i, 1) for i in range(6)], {"region": [3]})
        flood = RecommenderClient(srv.target, timeout_s=5, tenant="flood")
        claims = RecommenderClient(srv.target, timeout_s=5, tenant="flood")  # the flood, claiming to be light
        claims.metadata = (*claims.metadata, (CONTENTION_KEY, "light"))
        quiet = RecommenderClient(srv.target, timeout_s=5, tenant="quiet")
        stop = threading.Event()

        def flooding(i):
            while not stop.is_set():
                try:
                    (flood if i % 2 else claims).retrieve(u, k=5)
                except grpc.RpcError:
                    pass

        with ThreadPoolExecutor(16) as pool:
            for i in range(16):
                pool.submit(flooding, i)
            time.sleep(0.5)
            for _ in range(10):
                quiet.retrieve(u, k=5)
            stop.set()
    finally:
        srv.stop()
    quiet_shares = {share for caller, share in seen if caller == "quiet"}
    flood_shares = collections.Counter(share for caller, share in seen if caller == "flood")
    assert quiet_shares == {0.0}, quiet_shares  # light beside the flood: may wait twice the budget
    assert flood_shares[0.5] > 0 and flood_shares[0.0] == 0, flood_shares  # heavy, whatever it claims


@pytest.mark.serving
def test_a_light_callers_burst_passes_the_native_front_end_beside_a_flood(artifact):
    """A fixed count of places per caller refused a light caller's bursts (a Poisson caller at a
    quarter of capacity holds more than half of 12 places about 15% of the time): only a heavy
    caller, one sending more than its share of the calls, is held to its places."""
    native_or_skip(front_available())
    engine = SlowEngine(TorchEngine(artifact), delay=0.05)
    cfg = local_config(batch=BatchConfig(max_batch=4, max_wait_ms=1, max_queue=64, max_queue_ms=1000),
                       fair=FairConfig(max_share=0.5),
                       connections=ConnectionConfig(front_end="native", max_in_flight=12))
    srv = ThreadedServer(artifact, cfg, engine=engine)
    try:
        u = user([(i + 1, T0 + 60 * i, 1) for i in range(6)], {"region": [3]})
        flood = RecommenderClient(srv.target, timeout_s=10, tenant="flood")
        quiet = RecommenderClient(srv.target, timeout_s=10, tenant="quiet")
        stop = threading.Event()
        flood_codes: collections.Counter = collections.Counter()

        def flooding(_):
            while not stop.is_set():
                try:
                    flood.retrieve(u, k=5)
                    flood_codes["OK"] += 1
                except grpc.RpcError as e:
                    flood_codes[e.code().name] += 1

        def one(_):
            try:
                quiet.retrieve(u, k=5)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name + ":" + (e.details() or "")

        with ThreadPoolExecutor(16) as pool, ThreadPoolExecutor(9) as burst:
            for i in range(16):
                pool.submit(flooding, i)
            time.sleep(1.0)
            one(0)  # the quiet caller is active from here on: the flood is held to its share
            time.sleep(0.5)
            quiet_codes = []
            for _ in range(3):  # bursts of 9 calls at once: past its 6 places (12 x 0.5), a third
                quiet_codes += list(burst.map(one, range(9)))  # of the server's calls over time
                time.sleep(0.6)
            stop.set()
        assert quiet_codes == ["OK"] * 27, quiet_codes
        assert flood_codes["RESOURCE_EXHAUSTED"] > 0, flood_codes  # the flood is held to its places
    finally:
        srv.stop()



@pytest.mark.unit
def test_a_batch_that_partly_failed_answers_each_call_with_its_own_outcome():
    """An engine that computed some works of a batch and failed others (PartlyFailed): each call
    gets its own result or its own WorkFailed, not the batch's error."""
    from genrec.serve.contract import PartlyFailed, Result, WorkFailed

    class Engine:
        batches_together, parallel = False, 1

        async def run_async(self, works):  # noqa: ANN001, ANN202
            return_or_fail = [WorkFailed(f"{w.name}: KeyError") if w.name.startswith("bad") else
                              Result(np.array([len(w.name)]), np.zeros(1)) for w in works]
            raise PartlyFailed(return_or_fail)

    async def scenario() -> list:
        engine = Engine()
        b = Batcher(lambda: engine, BatchConfig(max_batch=4, max_wait_ms=50))
        b.start()
        works = [SimpleNamespace(name=n, deadline=time.monotonic() + 60, user=None) for n in ("a", "bad1", "ccc")]
        return await asyncio.gather(*(b.submit(w) for w in works), return_exceptions=True)

    a, bad, c = asyncio.run(scenario())
    assert isinstance(a, Result) and a.item_ids[0] == 1 and isinstance(c, Result) and c.item_ids[0] == 3
    assert isinstance(bad, WorkFailed) and "bad1: KeyError" in str(bad)
    # it crosses an engine process's pipe whole
    import pickle
    back = pickle.loads(pickle.dumps(PartlyFailed([WorkFailed("x"), a])))
    assert isinstance(back.outcomes[0], WorkFailed) and str(back.outcomes[0]) == "x"
