"""The load-test harness against a tiny live server with a known delay and failure rate."""

import asyncio
import json
import math
import os
import threading
import time

import grpc
import pytest

from genrec.proto.v1 import recommender_pb2 as pb
from genrec.serve.hdr import Histogram
from genrec.serve.loadtest import (
    cpu_shares,
    cpu_times,
    load_workload,
    make_workload,
    markdown,
    sweep,
    write_outputs,
)

DELAY_S, COMPUTE_S, FAIL_EVERY = 0.02, 0.005, 10


class KnownServer:
    """Answers Recommend after DELAY_S; every FAIL_EVERY-th call fails with UNAVAILABLE."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.calls = 0
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> int:
        async def handle(data: bytes, context) -> bytes:  # noqa: ANN001
            self.calls += 1
            n = self.calls
            await asyncio.sleep(DELAY_S)
            if n % FAIL_EVERY == 0:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "known failure")
            # the server's own account of the call: 15 ms queued + a 5 ms batch of two
            timing = pb.Timing(queue_ms=(DELAY_S - COMPUTE_S) * 1e3, compute_ms=COMPUTE_S * 1e3, batch_size=2,
                               decode_ms=1.0, wait_ms=8.0, handoff_ms=2.0)
            return pb.RecommendResponse(timing=timing).SerializeToString()

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "genrec.v1.Recommender", {"Recommend": grpc.unary_unary_rpc_method_handler(handle)}),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_histogram_percentiles_are_within_one_percent():
    h = Histogram()
    values = [i / 1000 for i in range(1, 1001)]  # 1..1000 ms
    for v in values:
        h.record(v)
    for p, want in ((50, 0.5), (90, 0.9), (99, 0.99), (99.9, 0.999)):
        assert h.percentile(p) == pytest.approx(want, rel=0.016)
    assert h.total == 1000


def test_sweep_counts_percentiles_and_errors_match_the_known_server(tmp_path):
    srv = KnownServer()
    try:
        payload = [pb.RecommendRequest(top_k=1).SerializeToString()]
        res = sweep(f"127.0.0.1:{srv.port}", [40.0, 80.0], 3.0, payload, slo_ms=30.0,
                    progress=False, cooldown_s=0.2)
        warmup = 1
        assert srv.calls == warmup + sum(s.sent for s in res.steps)
        for s in res.steps:
            assert s.ok + sum(s.errors.values()) == s.sent
            assert set(s.errors) <= {"UNAVAILABLE"}
            assert abs(s.sent - s.offered_qps * 3.0) < 5 * (s.offered_qps * 3.0) ** 0.5  # Poisson count
            assert 0.05 < s.errors.get("UNAVAILABLE", 0) / s.sent < 0.15  # every 10th call fails
            assert DELAY_S * 1e3 <= s.p50_ms < DELAY_S * 1e3 + 15
            assert s.p99_all_ms == float("inf")  # 10% failures can never meet a p99 budget
            # the answers' Timing: in server = queue + compute as the server reported them
            assert s.server_p50_ms == pytest.approx(DELAY_S * 1e3, rel=0.02)
            assert s.server_p99_ms == pytest.approx(DELAY_S * 1e3, rel=0.02)
            assert s.compute_p50_ms == pytest.approx(COMPUTE_S * 1e3, rel=0.02) and s.mean_batch == 2
            # ... and its parts besides the engine batch
            assert (s.decode_p99_ms, s.wait_p50_ms, s.handoff_p99_ms) == pytest.approx((1.0, 8.0, 2.0), rel=0.02)
            # the rest of each call's latency: what the client saw beyond the server's 20 ms
            assert 0 <= s.outside_p50_ms < 15 and s.outside_p50_ms <= s.p50_ms - DELAY_S * 1e3 + 1
            assert 0 <= s.send_late_p99_ms < 50
            assert (0 < s.cpu_busy_pct <= 100 and 0 <= s.steal_pct <= 100) if cpu_times() else math.isnan(s.steal_pct)
        assert res.max_qps_within_slo == 0.0
        out = write_outputs(res, tmp_path / "out")
        assert json.loads((out / "loadtest.json").read_text())["steps"][0]["sent"] == res.steps[0].sent
        assert (out / "latency_vs_load.png").stat().st_size > 1000
        assert "max QPS within budget: 0" in markdown(res)
    finally:
        srv.stop()


def test_machine_busy_and_steal_shares_come_from_proc_stat():
    assert cpu_shares((10.0, 1.0, 100.0), (40.0, 3.0, 200.0)) == pytest.approx((30.0, 2.0))
    assert all(math.isnan(x) for x in cpu_shares(None, (1.0, 0.0, 2.0)))
    before = cpu_times()
    if before is None:
        pytest.skip("no /proc/stat here")
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # one CPU busy for 0.3 s
        pass
    busy, steal = cpu_shares(before, cpu_times())
    assert 50 / os.cpu_count() <= busy <= 100 and 0 <= steal <= 100


def test_workload_round_trip(tiny_synth, tmp_path):
    path = make_workload(tiny_synth, tmp_path / "w.jsonl", n=20, history=8, retrieve_k=30, top_k=5)
    reqs = [pb.RecommendRequest.FromString(b) for b in load_workload(path)]  # histories as packed columns
    assert len(reqs) == 20 and all(0 < len(r.user.history_columns.item_ids) <= 8 and r.retrieve_k == 30 for r in reqs)
    assert all(len(r.user.history_columns.timestamps) == len(r.user.history_columns.item_ids) for r in reqs)
    events = [pb.RecommendRequest.FromString(b) for b in load_workload(path, columns=False)]
    assert [[e.item_id for e in r.user.history] for r in events] == [list(r.user.history_columns.item_ids) for r in reqs]


def test_a_step_lasts_long_enough_for_its_minimum_of_calls():
    from genrec.serve.loadtest import step_seconds

    assert step_seconds(10, 10, 600) == 60 and step_seconds(100, 10, 600) == 10 and step_seconds(50, 3) == 3


def test_a_missed_step_caps_the_max_qps_even_when_a_higher_step_met_the_budget():
    from genrec.serve.loadtest import StepResult, qps_within

    def step(qps: float, p99: float) -> StepResult:
        return StepResult(qps, 1.0, 10, 10, {}, qps, p99, p99, p99, p99, p99, p99, 0)

    steps = [step(200, 13.0), step(10, 11.0), step(100, 15.1), step(50, 12.0), step(300, 17.0)]
    assert qps_within(steps, 15.0) == (50, 200)
    assert qps_within([step(10, 16.0), step(50, 14.0)], 15.0) == (0.0, 50)
    assert qps_within([], 15.0) == (0.0, 0.0)
