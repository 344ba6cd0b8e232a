"""The load-test harness against a tiny live server with a known delay and failure rate."""

import asyncio
import itertools
import json
import math
import os
import threading
import time
from dataclasses import replace

import grpc
import numpy as np
import pytest

from genrec.loadtest.hdr import Histogram
from genrec.loadtest.report import markdown, write_outputs
from genrec.loadtest.runner import sweep
from genrec.loadtest.scrape import cpu_shares, cpu_times
from genrec.loadtest.sender import available
from genrec.loadtest.workload import (
    RepeatedUsers,
    RepeatedUserWorkload,
    load_workload,
    make_workload,
)
from genrec.proto.v1 import recommender_pb2 as pb
from tests.conftest import native_or_skip

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


@pytest.mark.parametrize("sender", ["python", "native"])
def test_sweep_counts_percentiles_and_errors_match_the_known_server(tmp_path, sender):
    if sender == "native":
        native_or_skip(available())
    srv = KnownServer()
    try:
        payload = [pb.RecommendRequest(top_k=1).SerializeToString()]
        res = sweep(f"127.0.0.1:{srv.port}", [40.0, 80.0], 3.0, payload, slo_ms=30.0,
                    progress=False, cooldown_s=0.2, sender=sender)
        warmup = 1
        assert srv.calls == warmup + sum(s.sent for s in res.steps)
        for s in res.steps:
            assert s.ok + sum(s.errors.values()) == s.sent and not s.cut_short  # (the whole schedule ran)
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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs to show")
def test_pinning_the_generator_moves_the_threads_started_before():
    """gRPC's threads start with the first call and stay: the benchmarks pin the whole process,
    not the calling thread alone, or the generator's I/O keeps running on the server's CPU."""
    from genrec.benchmarks.common import pin_process

    cpus = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)
    early.start()  # (as gRPC's event engine, started before the pinning)
    try:
        pin_process({cpus[0]})
        assert os.sched_getaffinity(early.native_id) == {cpus[0]} == os.sched_getaffinity(0)
    finally:
        pin_process(cpus)
        stop.set()


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
    from genrec.loadtest.runner import step_seconds

    assert step_seconds(10, 10, 600) == 60 and step_seconds(100, 10, 600) == 10 and step_seconds(50, 3) == 3


def test_a_missed_step_caps_the_max_qps_even_when_a_higher_step_met_the_budget():
    from genrec.loadtest.results import StepResult, qps_within

    def step(qps: float, p99: float) -> StepResult:
        return StepResult(qps, 1.0, 10, 10, {}, qps, p99, p99, p99, p99, p99, p99, 0)

    steps = [step(200, 13.0), step(10, 11.0), step(100, 15.1), step(50, 12.0), step(300, 17.0)]
    assert qps_within(steps, 15.0) == (50, 200)
    assert qps_within([step(10, 16.0), step(50, 14.0)], 15.0) == (0.0, 50)
    assert qps_within([], 15.0) == (0.0, 0.0)
    # a step that sent nothing (p99 NaN) or less than its schedule (the request budget or a stream
    # ran out) measured no load: it meets nothing, and caps what is above it
    empty = StepResult(1000, 1.0, 0, 0, {}, 0.0, *[math.nan] * 6, 0)
    short = replace(step(400, 12.0), cut_short=True)
    assert qps_within([step(50, 12.0), empty], 15.0) == (50, 50)
    assert qps_within([step(50, 12.0), short, step(800, 13.0)], 15.0) == (50, 800)


def test_a_step_counts_answers_of_its_window_and_knows_when_it_was_cut_short():
    """achieved_qps is the step's answers per second of its window: answers that come back after
    it (a saturated server draining its queue) are not this step's rate. A step sent short of
    its schedule says so."""
    from genrec.loadtest.runner import Recorder

    rec = Recorder(3, None, None, None, window=2.0)
    rec.record(0.5, 0.2, "OK", b"")
    rec.record(1.5, 0.4, "OK", b"")
    rec.record(1.9, 0.9, "OK", b"")  # back at 2.8 s: after the window
    step = rec.result(100.0, 2.0, 3, 0.0, 0.0, scheduled=200)
    assert step.ok == 3 and step.achieved_qps == 1.0 and step.cut_short
    assert not rec.result(100.0, 2.0, 3, 0.0, 0.0, scheduled=3).cut_short


def test_a_calls_deadline_is_never_shorter_than_the_budget(monkeypatch):
    """With a 1.5 s budget and the 1 s default deadline, answers within the budget became
    DEADLINE_EXCEEDED (and p99 infinite): the deadline is raised to the budget."""
    from genrec.loadtest import runner
    from genrec.loadtest.results import StepResult

    seen = []

    def fake_step(call, payloads, qps, duration, timeout, *a, **k):  # noqa: ANN001, ANN002, ANN003
        seen.append(timeout)
        return StepResult(qps, duration, 1, 1, {}, qps, *[10.0] * 6, 0)

    srv = KnownServer()
    try:
        monkeypatch.setattr(runner, "run_step", fake_step)
        payload = [pb.RecommendRequest(top_k=1).SerializeToString()]
        runner.sweep(f"127.0.0.1:{srv.port}", [5.0], 0.1, payload, slo_ms=1500.0, timeout_s=1.0, warmup=0,
                     progress=False, cooldown_s=0.0)
        runner.sweep(f"127.0.0.1:{srv.port}", [5.0], 0.1, payload, slo_ms=15.0, timeout_s=1.0, warmup=0,
                     progress=False, cooldown_s=0.0)
    finally:
        srv.stop()
    assert seen == [1.5, 1.0]


# ----- the repeated-user workload ---------------------------------------------------------------
def repeated(**kw) -> RepeatedUserWorkload:  # noqa: ANN003
    return RepeatedUserWorkload(RepeatedUsers(**kw), np.arange(1, 2001))


def by_view(calls: list) -> list[list]:
    """Calls grouped by page view (consecutive calls of one user and view)."""
    views: list[list] = []
    for c in calls:
        if views and (views[-1][0].user, views[-1][0].view) == (c.user, c.view):
            views[-1].append(c)
        else:
            views.append([c])
    return views


def test_page_views_follow_zipf_popularity():
    w = repeated(users=50, zipf=1.1)
    counts = np.bincount([u for u, _, _ in itertools.islice(w.views(), 40_000)], minlength=50)
    assert counts[0] / counts[1] == pytest.approx(2**1.1, rel=0.1)  # rank 1 against rank 2
    slope = np.polyfit(np.log(np.arange(1, 11)), np.log(counts[:10]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.1)
    assert 0.5 * np.abs(counts / counts.sum() - w.popularity).sum() < 0.02  # total variation
    flat = np.bincount([u for u, _, _ in itertools.islice(repeated(users=50, zipf=0.0).views(), 40_000)])
    assert flat.max() / flat.min() < 1.5  # zipf 0: every user alike


def test_a_page_view_is_3_to_5_calls_with_one_history_and_request_time():
    w = repeated(users=30, history=40, candidates=(100, 500))
    views = by_view(list(itertools.islice(w.calls(), 600)))[:-1]  # (the last may be cut)
    assert {len(v) for v in views} == {3, 4, 5}
    for v in views:
        reqs = [pb.RankRequest.FromString(c.payload) for c in v]
        assert [c.index for c in v] == list(range(len(v)))
        assert all(r.user == reqs[0].user for r in reqs) and reqs[0].user.user_id == f"h40s0u{v[0].user}"
        for r in reqs:
            ids = [x.item_id for x in r.candidates]
            assert 100 <= len(ids) <= 500 and len(set(ids)) == len(ids) and set(ids) <= set(range(1, 2001))
    sizes = [c.candidates for v in views for c in v]
    assert min(sizes) < 200 and max(sizes) > 400  # drawn over the whole range


def test_histories_grow_by_1_to_5_later_events_between_a_users_page_views():
    w = repeated(users=5, history=30)
    last: dict[int, pb.User] = {}
    grown = 0
    for v in by_view(list(itertools.islice(w.calls(), 400))):
        u = pb.RankRequest.FromString(v[0].payload).user
        items, times = list(u.history_columns.item_ids), list(u.history_columns.timestamps)
        assert len(items) == len(times) == v[0].history and times == sorted(times) and u.request_time > times[-1]
        prev = last.get(v[0].user)
        if prev is None:
            assert v[0].view == 0 and len(items) == 30
        else:
            old = list(prev.history_columns.item_ids)
            assert items[:len(old)] == old and 1 <= len(items) - len(old) <= 5  # the old history is a prefix
            assert min(times[len(old):]) > prev.request_time  # the new events came after the last request
            grown += 1
        last[v[0].user] = u
    assert grown > 20


def test_the_workload_is_deterministic_under_its_seed():
    def first(seed: int) -> list[bytes]:
        return [c.payload for c in itertools.islice(repeated(users=100, history=50, seed=seed).calls(), 300)]

    assert first(1) == first(1) and first(1) != first(2)
    # the page views do not depend on the candidates drawn: one seed, one sequence of users and histories
    a = [(c.user, c.view, c.history) for c in itertools.islice(repeated(users=100, seed=1).calls(), 300)]
    b = [(c.user, c.view, c.history) for c in itertools.islice(repeated(users=100, seed=1, candidates=(200, 200)).calls(), 300)]
    assert a == b


def test_the_workload_is_built_as_it_is_read():
    import tracemalloc

    w = repeated(users=1_000_000, history=8000)  # 10^6 users of 8,000 events: nothing built up front
    calls = w.calls()
    tracemalloc.start()
    try:
        sizes = [len(c.payload) for c in itertools.islice(calls, 100)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(sizes) > 5e6 and peak < 3e6  # 100 requests of ~60 kB streamed, not held
    visitors = calls.gi_frame.f_locals["visitors"]
    assert sum(len(v.items) for v in visitors.values()) < 5 * 100  # kept per user: the events appended


def test_the_plan_counts_what_the_calls_touch():
    w = repeated(users=200, history=100)
    calls = list(itertools.islice(w.calls(), 500))
    plan = w.plan(500)
    last = {c.user: c.history for c in calls}
    assert plan["users"] == len(last) and plan["max_history"] == max(last.values())
    assert plan["tokens"] == sum(last.values()) and plan["calls"] >= 500


def test_the_serving_shape_recommends_and_a_bad_range_names_its_key():
    c = next(repeated(method="Recommend").calls())
    r = pb.RecommendRequest.FromString(c.payload)
    assert (r.retrieve_k, r.top_k, len(r.candidates), c.candidates) == (100, 10, 0, 0) and r.user.user_id
    with pytest.raises(ValueError, match="calls_per_view"):
        RepeatedUsers(calls_per_view=(5, 3))


def test_the_cli_builds_the_repeated_workload_from_overrides(tiny_synth):
    from argparse import Namespace

    from genrec.config import ConfigError
    from genrec.loadtest.cli import workload_of

    args = Namespace(workload="repeated", event_messages=False)
    payloads, method, described = workload_of(args, [f'--repeated.catalogue="{tiny_synth}"', "--repeated.history=20",
                                                     "--repeated.candidates=[5,9]", "--repeated.zipf=1.2"])
    r = pb.RankRequest.FromString(next(payloads))
    assert method == "Rank" and len(r.user.history_columns.item_ids) == 20 and 5 <= len(r.candidates) <= 9
    assert '"zipf": 1.2' in described
    with pytest.raises(ConfigError, match="repeated.zipff"):
        workload_of(args, [f'--repeated.catalogue="{tiny_synth}"', "--repeated.zipff=1.2"])
    with pytest.raises(ConfigError, match="catalogue"):
        workload_of(args, [])


# ----- the server's cache, from /metrics ---------------------------------------------------------
METRICS = """# HELP genrec_cache_history_tokens_total History tokens of cached-engine calls
# TYPE genrec_cache_history_tokens_total counter
genrec_cache_history_tokens_total{{replica="0"}} {hist0}
genrec_cache_history_tokens_total{{replica="1"}} {hist1}
genrec_cache_history_tokens_created{{replica="0"}} 1.7e9
genrec_cache_cached_tokens_total {cached}
genrec_cache_hits_total 12.0
genrec_cache_misses_total 3.0
genrec_cache_evicted_tokens_total 0.0
# TYPE genrec_cache_bytes gauge
genrec_cache_bytes 1048576.0
genrec_cache_users 8.0
genrec_requests_total{{method="Rank",code="OK"}} 15.0
"""


def test_the_hit_rate_is_cached_over_history_tokens_between_two_scrapes():
    from genrec.loadtest.scrape import cache_figures, parse_metrics

    before = parse_metrics(METRICS.format(hist0=1000, hist1=0, cached=200))
    after = parse_metrics(METRICS.format(hist0=2500, hist1=500, cached=1700))
    assert before["genrec_cache_history_tokens_total"] == 1000 and after["genrec_requests_total"] == 15
    f = cache_figures(before, after)
    assert f["hit_rate"] == pytest.approx(1500 / 2000) and f["cache_history_tokens"] == 2000
    assert (f["cache_hits"], f["cache_evicted_tokens"], f["cache_bytes"], f["cache_users"]) == (0, 0, 2**20, 8)
    assert f["cache_used_tokens"] is None and f["cache_capacity_tokens"] is None  # not exported: None
    assert cache_figures(after, before)["hit_rate"] is None  # counters went back: a restarted server
    assert cache_figures(before, before)["hit_rate"] is None  # no calls with history
    plain = parse_metrics('genrec_requests_total{method="Rank",code="OK"} 3\n')
    assert set(cache_figures(plain, plain).values()) == {None}  # a server without a cache
    assert set(cache_figures(None, None).values()) == {None}


@pytest.mark.parametrize("sender", ["python", "native"])
def test_a_sweep_reads_a_stream_on_through_its_steps_and_reports_the_cache(tmp_path, sender):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if sender == "native":
        native_or_skip(available())

    srv = KnownServer()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # 10 history tokens a call, 7 of them cached
            body = (f"genrec_cache_history_tokens_total {10 * srv.calls}\ngenrec_cache_cached_tokens_total "
                    f"{7 * srv.calls}\ngenrec_cache_bytes 4096\n").encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:  # noqa: ANN002
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    taken = []

    def stream():  # noqa: ANN202
        for i in itertools.count():
            taken.append(i)
            yield pb.RecommendRequest(top_k=1).SerializeToString()

    try:
        res = sweep(f"127.0.0.1:{srv.port}", [30.0, 30.0], 1.0, stream(), slo_ms=30.0, progress=False,
                    cooldown_s=0.1, warmup=3, metrics_url=f"http://127.0.0.1:{http.server_port}/metrics",
                    sender=sender)
        assert len(taken) == 3 + sum(s.sent for s in res.steps) == srv.calls  # one stream, never restarted
        assert all(s.hit_rate == pytest.approx(0.7) and s.cache_bytes == 4096 for s in res.steps)
        assert res.steps[0].cache_history_tokens == 10 * res.steps[0].sent and res.steps[0].cache_users is None
        assert "cache hit rate" in markdown(res)
    finally:
        http.shutdown()
        srv.stop()
