"""Open-loop load generator for genrec.v1.Recommender: QPS sweeps, latency percentiles,
errors by status code, the highest QPS under a p99 budget.

Open loop: each step draws Poisson send times for its offered QPS and sends on schedule
whatever the server's speed; latency is measured from the *scheduled* send time, so a
slow server cannot hide latency by slowing the sender (no coordinated omission). Failed
calls count as infinitely slow in ``p99_all``, the number the SLO is checked against.

What flows through: serialized requests (:mod:`genrec.loadtest.workload`) -> :func:`run_step`
sends them on a schedule, a :class:`Recorder` fills histograms from gRPC's callback threads
-> one :class:`~genrec.loadtest.results.StepResult` per offered QPS -> :func:`sweep` gathers
them, with the server's cache and the machine's CPU around each step
(:mod:`genrec.loadtest.scrape`), into a :class:`~genrec.loadtest.results.LoadTestResult`.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message
from tqdm import tqdm

from genrec.loadtest.hdr import Histogram
from genrec.loadtest.results import LoadTestResult, StepResult, qps_within
from genrec.loadtest.scrape import cache_figures, cpu_shares, cpu_times, scrape
from genrec.loadtest.sender import send
from genrec.proto.v1 import recommender_pb2 as pb

# a refusal: the server's admission (RESOURCE_EXHAUSTED), or gRPC's core refusing a call past the
# server's pending bound (CANCELLED: this generator never cancels a call itself)
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "CANCELLED"})

RESPONSES = {"Recommend": pb.RecommendResponse, "Retrieve": pb.RetrieveResponse, "Rank": pb.RankResponse}
Payloads = Sequence[bytes] | Iterator[bytes]  # a list (sent round and round) or a stream (read on)


def _timing(response: type[Message], reply: bytes) -> pb.Timing | None:
    """The reply's Timing, or None when the reply does not parse as ``response`` or carries none."""
    try:
        msg = response.FromString(reply)
    except DecodeError:
        return None
    return msg.timing if msg.HasField("timing") else None


class Recorder:
    """What one step's answers add up to, filled from gRPC's callback threads: the latency
    histogram (seconds from the scheduled send), status codes, the parts of the server's Timing,
    refusals; ``finished`` is set once the ``expected`` answers are in. The sender itself records
    its lateness (:meth:`sent_late`, one thread: no lock)."""

    def __init__(self, expected: int, response: type[Message] | None, bar: tqdm | None,
                 calls: list[tuple[float, float, str]] | None, window: float = math.inf) -> None:
        self.response, self.bar, self.calls, self.window = response, bar, calls, window
        self.ok_in_window = 0  # answers OK that came back within the step's window (achieved_qps)
        self.latency, self.codes = Histogram(), Counter()
        self.server, self.compute, self.outside, self.lateness = (Histogram() for _ in range(4))
        self.decode, self.wait, self.handoff, self.refused = (Histogram() for _ in range(4))
        self.batch_sum, self.pending, self.late_sends = 0, expected, 0
        self.lock, self.finished = threading.Lock(), threading.Event()
        self.start = 0.0  # the step's time origin (perf_counter), set before the first send

    def answered(self, fut: grpc.Future, scheduled: float) -> None:
        """gRPC's done-callback of the call scheduled at ``scheduled``."""
        took = time.perf_counter() - scheduled
        try:
            reply, code = fut.result(), "OK"
        except grpc.RpcError as e:
            reply, code = None, e.code().name
        except grpc.FutureCancelledError:
            reply, code = None, "CANCELLED"
        self.record(scheduled - self.start, took, code, reply)

    def sent_late(self, behind: float) -> None:
        """A call was sent ``behind`` seconds after its scheduled time (over 1 ms: a late send)."""
        self.lateness.record(behind)
        self.late_sends += int(behind > 1e-3)

    def record(self, offset: float, took: float, code: str, reply: bytes | None) -> None:
        """One answer: the call scheduled ``offset`` seconds into the step came back after
        ``took`` seconds (from its scheduled time) with status ``code`` and, if OK, ``reply``."""
        timing = _timing(self.response, reply) if reply is not None and self.response is not None else None
        with self.lock:
            self.codes[code] += 1
            if self.calls is not None:
                self.calls.append((offset, took, code))
            if code == "OK" and offset + took <= self.window:
                self.ok_in_window += 1
            if code in REFUSALS:
                self.refused.record(took)
            if reply is not None:
                self.latency.record(took)
                if timing is not None:
                    self._split(took, timing)
            self._done(1)
        if self.bar is not None:
            self.bar.update(1)

    def _split(self, took: float, timing: pb.Timing) -> None:
        """Record where an answered call's ``took`` seconds went, by the server's own Timing."""
        in_server = (timing.queue_ms + timing.compute_ms) / 1e3
        self.server.record(in_server)
        self.compute.record(timing.compute_ms / 1e3)
        self.outside.record(took - in_server)
        self.decode.record(timing.decode_ms / 1e3)
        self.wait.record(timing.wait_ms / 1e3)
        self.handoff.record(timing.handoff_ms / 1e3)
        self.batch_sum += timing.batch_size

    def unsent(self, n: int) -> None:
        """``n`` scheduled calls will never be sent (a finite stream ran out)."""
        with self.lock:
            self._done(n)

    def _done(self, n: int) -> None:  # under the lock
        self.pending -= n
        if self.pending == 0:
            self.finished.set()

    def result(self, qps: float, duration: float, sent: int, busy: float, steal: float,
               scheduled: int | None = None) -> StepResult:
        """The step's figures, once ``finished`` (milliseconds). ``scheduled``: the calls its
        schedule held (None: ``sent``); fewer sent (a request budget or a stream that ran out)
        marks the step ``cut_short``."""
        ok = self.codes["OK"]
        short = bool(scheduled is not None and sent < scheduled)
        if sent == 0:
            return StepResult(qps, duration, 0, 0, {}, 0.0, *[math.nan] * 6, 0, cpu_busy_pct=busy, steal_pct=steal,
                              cut_short=short)

        def ms(h: Histogram, p: float) -> float:
            return h.percentile(p) * 1e3 if h.total else math.nan

        # p99 with failures as +inf: the (p99 * sent)-th latency must come from a success
        rank_needed = math.ceil(0.99 * sent)
        p99_all = math.inf if rank_needed > ok else self.latency.percentile(100.0 * rank_needed / ok) * 1e3
        return StepResult(
            # answers per second of the step's window: what came back after it is not this step's rate
            qps, duration, sent, ok, {k: v for k, v in self.codes.items() if k != "OK"}, self.ok_in_window / duration,
            ms(self.latency, 50), ms(self.latency, 90), ms(self.latency, 99), ms(self.latency, 99.9), p99_all,
            self.latency.max * 1e3 if ok else math.nan, self.late_sends,
            server_p50_ms=ms(self.server, 50), server_p99_ms=ms(self.server, 99),
            compute_p50_ms=ms(self.compute, 50), compute_p99_ms=ms(self.compute, 99),
            outside_p50_ms=ms(self.outside, 50), outside_p99_ms=ms(self.outside, 99),
            send_late_p99_ms=ms(self.lateness, 99),
            mean_batch=self.batch_sum / self.server.total if self.server.total else math.nan,
            decode_p50_ms=ms(self.decode, 50), decode_p99_ms=ms(self.decode, 99),
            wait_p50_ms=ms(self.wait, 50), wait_p99_ms=ms(self.wait, 99),
            handoff_p50_ms=ms(self.handoff, 50), handoff_p99_ms=ms(self.handoff, 99),
            cpu_busy_pct=busy, steal_pct=steal, refused_p50_ms=ms(self.refused, 50), refused_p99_ms=ms(self.refused, 99),
            cut_short=short)


def send_times(qps: float, duration: float, seed: int, max_requests: int | None = None) -> np.ndarray:
    """Poisson send times (seconds from the step's start) of a step: ``qps`` on average, all
    before ``duration``, at most ``max_requests`` (None: the whole schedule)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / qps, size=int(qps * duration * 1.5) + 10)
    offsets = np.cumsum(gaps)
    return offsets[offsets < duration][:max_requests]


def run_step(call: grpc.UnaryUnaryMultiCallable, payloads: Payloads, qps: float, duration: float, timeout: float,
             seed: int, max_requests: int, bar: tqdm | None = None, response: type[Message] | None = None,
             calls: list[tuple[float, float, str]] | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> StepResult:
    """One open-loop step. ``call``: a (sync) unary-unary callable of a channel; this thread
    sleeps to each scheduled send time and starts the call without waiting for it
    (``call.future``), the answer is timed when gRPC completes it (its callback thread).
    ``response``: the reply's message class; when given, each answer's ``timing`` splits
    its latency into the server's part and the rest. ``calls``: when given, every call is
    appended as (scheduled time since the step's start, latency, status code name).
    ``metadata``: sent with every call (e.g. ``(("tenant", "ads"),)``: the server's fair shares).
    ``payloads``: a list, sent round from its start, or an iterator (a stream such as
    :meth:`~genrec.loadtest.workload.RepeatedUserWorkload.payloads`), read on from where it
    stands; each request is taken before the sleep to its send time, so building it costs the
    gap, not lateness.

    The sender sleeps with ``time.sleep`` (a nanosecond timer) rather than an event loop's
    timer, whose millisecond granularity makes an asyncio sender late by up to a millisecond
    and more: lateness that counts against the server, since latency runs from the scheduled
    time."""
    schedule = send_times(qps, duration, seed)
    offsets, planned = schedule[:max_requests], len(schedule)  # (planned: what the budget may cut)
    rec = Recorder(len(offsets), response, bar, calls, window=duration)
    source = itertools.cycle(payloads) if isinstance(payloads, Sequence) else iter(payloads)
    machine = cpu_times()
    rec.start = time.perf_counter() + 0.05
    for i, off in enumerate(offsets):
        payload = next(source, None)
        if payload is None:  # a finite stream ran out: the step ends with it
            rec.unsent(len(offsets) - i)
            offsets = offsets[:i]
            break
        scheduled = rec.start + off
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rec.sent_late(time.perf_counter() - scheduled)
        fut = call.future(payload, timeout=timeout, metadata=metadata or None)
        fut.add_done_callback(functools.partial(rec.answered, scheduled=scheduled))
    if len(offsets):
        rec.finished.wait()
    busy, steal = cpu_shares(machine, cpu_times())
    return rec.result(qps, duration, len(offsets), busy, steal, planned)


def native_step(target: str, method: str, payloads: Payloads, qps: float, duration: float, timeout: float,
                seed: int, max_requests: int, bar: tqdm | None = None, response: type[Message] | None = None,
                calls: list[tuple[float, float, str]] | None = None, metadata: tuple[tuple[str, str], ...] = (),
                warmup: int = 0, began: threading.Event | None = None) -> StepResult:
    """:func:`run_step` sent by the native sender (:mod:`genrec.loadtest.sender`) on a
    connection of its own: the same schedule for the same seed, the same payloads in the same
    order, the same figures. ``warmup``: calls sent one at a time first (from the start of a
    list; taken off a stream, before its scheduled calls). ``began``: set once the warm-up is
    over and the schedule's clock starts. Returns once every call has its answer; ``bar`` moves
    at the end."""
    schedule = send_times(qps, duration, seed)
    offsets, planned = schedule[:max_requests], len(schedule)
    if isinstance(payloads, Sequence):
        items, first = list(payloads), 0
    else:  # a stream: the warm-up's requests, then one per scheduled call, as far as it goes
        items, first = list(itertools.islice(payloads, warmup + len(offsets))), warmup
        offsets = offsets[:max(len(items) - warmup, 0)]
    rec = Recorder(len(offsets), response, None, calls, window=duration)
    if not len(offsets):
        if began is not None:
            began.set()
        return rec.result(qps, duration, 0, math.nan, math.nan, planned)
    machine = cpu_times()
    answers = send(target, f"/genrec.v1.Recommender/{method}", items, offsets.tolist(), timeout, warmup=warmup,
                   first=first, replies=response is not None, metadata=metadata, began=began)
    busy, steal = cpu_shares(machine, cpu_times())
    for offset, took, behind, code, reply in zip(answers.offsets, answers.took, answers.late, answers.codes,
                                                 answers.replies):
        rec.sent_late(behind)
        rec.record(offset, took, code, reply)
    if bar is not None:
        bar.update(len(offsets))
    return rec.result(qps, duration, len(offsets), busy, steal, planned)


def step_seconds(qps: float, duration: float, min_requests: int = 0) -> float:
    """How long a step runs: ``duration``, or long enough to send ``min_requests`` at its QPS
    (a p99 from ~100 calls is about their maximum; from 600, six calls lie above it)."""
    return max(duration, min_requests / qps if qps > 0 else 0.0)


def _warm_up(call: grpc.UnaryUnaryMultiCallable, payloads: Payloads, warmup: int) -> None:
    """Send ``warmup`` calls one after another: connections open, the server's first calls paid."""
    warm = payloads[:warmup] if isinstance(payloads, Sequence) else itertools.islice(payloads, warmup)
    for p in warm:
        try:
            call(p, timeout=5)
        except grpc.RpcError:
            pass


def _progress_line(qps: float, step: StepResult) -> str:
    return (f"{qps:8g} qps offered | {step.achieved_qps:8.1f} ok/s | p50 {step.p50_ms:6.2f} "
            f"p99 {step.p99_ms:7.2f} p99(all) {step.p99_all_ms:7.2f} ms | server p50 "
            f"{step.server_p50_ms:5.2f} p99 {step.server_p99_ms:6.2f}, outside p50 {step.outside_p50_ms:5.2f} "
            f"p99 {step.outside_p99_ms:6.2f}, batch {step.mean_batch:4.1f} | errors {step.errors}"
            + (f" | cache hit rate {step.hit_rate:.3f}" if step.hit_rate is not None else ""))


def sweep(target: str, qps_steps: list[float], duration: float, payloads: Payloads,
          slo_ms: float, timeout_s: float = 1.0, max_requests: int = 1_000_000, progress: bool = True,
          cooldown_s: float = 1.0, method: str = "Recommend", min_requests: int = 0, warmup: int = 50,
          metrics_url: str | None = None, tenant: str = "", sender: str = "python") -> LoadTestResult:
    """Steps of :func:`run_step` at each offered QPS, after ``warmup`` calls. ``payloads``: a
    list (each step starts it again) or one stream read on through the steps. ``metrics_url``:
    the server's Prometheus endpoint; each step then reports its cache (:func:`cache_figures`).
    ``tenant``: sent as ``tenant`` metadata on every call (the server's per-caller shares).
    ``sender``: "python" (this process) or "native" (each step sent by :func:`native_step`)."""
    if sender not in ("python", "native"):
        raise ValueError(f"sender is python or native, not {sender!r}")
    # a call's deadline is at least the budget: an answer within it is never cut off as an error
    timeout_s = max(timeout_s, slo_ms / 1e3)
    result = LoadTestResult(target, method, slo_ms)
    # what is loaded now stays; a full collection over it would stall the sender mid-step
    # (serve.factory.quiet_gc has the same reason on the server side)
    gc.collect()
    gc.freeze()
    with grpc.insecure_channel(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        call = ch.unary_unary(f"/genrec.v1.Recommender/{method}")
        _warm_up(call, payloads, warmup)
        budget = max_requests
        for i, qps in enumerate(qps_steps):
            seconds = step_seconds(qps, duration, min_requests)
            bar = tqdm(total=int(qps * seconds), desc=f"{qps:g} qps", unit="req", leave=False, disable=not progress)
            before = scrape(metrics_url)
            metadata = (("tenant", tenant),) if tenant else ()
            if sender == "native":
                step = native_step(target, method, payloads, qps, seconds, timeout_s, seed=i, max_requests=budget,
                                   bar=bar, response=RESPONSES.get(method), metadata=metadata)
            else:
                step = run_step(call, payloads, qps, seconds, timeout_s, seed=i, max_requests=budget, bar=bar,
                                response=RESPONSES.get(method), metadata=metadata)
            if metrics_url:
                step = replace(step, **cache_figures(before, scrape(metrics_url)))
            bar.close()
            budget -= step.sent
            result.steps.append(step)
            if progress:
                tqdm.write(_progress_line(qps, step))
            if budget <= 0:
                break
            time.sleep(cooldown_s)
    result.max_qps_within_slo, result.highest_passing_qps = qps_within(result.steps, slo_ms)
    return result
