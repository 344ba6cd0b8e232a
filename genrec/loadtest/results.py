"""What a load test found: one :class:`StepResult` per offered QPS, gathered in a
:class:`LoadTestResult` with the highest QPS that met the p99 budget (:func:`qps_within`).

The runner fills them (:mod:`genrec.loadtest.runner`); reports and benchmarks read them
(:mod:`genrec.loadtest.report`, ``loadtest.json``). Latencies in milliseconds; a figure the
step could not measure is NaN (no successful call, no Timing in the replies) or None (a
cache figure the server does not export).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepResult:
    """One step at one offered QPS: what was sent and answered, latency percentiles from the
    scheduled send time (ms), where the time went (the replies' Timing), the machine's CPU
    and, with a metrics endpoint, the server's cache."""

    offered_qps: float
    duration_s: float
    sent: int
    ok: int
    errors: dict[str, int]
    achieved_qps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    p99_all_ms: float  # failures counted as infinitely slow
    max_ms: float
    late_sends: int  # sends the generator itself made > 1 ms late
    # where a call's time went, from the response's Timing (the server's own clock, from the
    # handler's start to the result: decode, queue, batch); "outside" = the client's latency
    # minus that: the load generator's lateness, both gRPC stacks, the transport, wake-ups
    server_p50_ms: float = math.nan
    server_p99_ms: float = math.nan
    compute_p50_ms: float = math.nan  # the engine batch alone (Timing.compute_ms)
    compute_p99_ms: float = math.nan
    outside_p50_ms: float = math.nan
    outside_p99_ms: float = math.nan
    send_late_p99_ms: float = math.nan  # how late the generator sent (scheduled -> handed to gRPC)
    mean_batch: float = math.nan  # the engine batch each answered call rode in, averaged over calls
    # parts of the server's share besides the engine batch (Timing.decode_ms / wait_ms / handoff_ms)
    decode_p50_ms: float = math.nan
    decode_p99_ms: float = math.nan
    wait_p50_ms: float = math.nan  # until the engine began the batch (queued behind others, the trip there)
    wait_p99_ms: float = math.nan
    handoff_p50_ms: float = math.nan  # the results' trip back from the engine (pipe, pickling, wake-ups)
    handoff_p99_ms: float = math.nan
    # the whole machine during the step (/proc/stat, Linux; the generator shares it with a local server):
    # CPU time busy, and time the hypervisor ran something else while a virtual CPU had work ("steal")
    cpu_busy_pct: float = math.nan
    steal_pct: float = math.nan
    # how fast a refusal (RESOURCE_EXHAUSTED: the server shedding load) reached the caller
    refused_p50_ms: float = math.nan
    refused_p99_ms: float = math.nan
    # the server's per-user cache, from its /metrics before and after the step (sweep's metrics_url;
    # None without one, or where the server exports no such figure): hit rate = cached tokens /
    # history tokens of the step's calls, the counters' growth over the step, then the gauges at its end
    hit_rate: float | None = None
    cache_history_tokens: float | None = None
    cache_cached_tokens: float | None = None
    cache_evicted_tokens: float | None = None
    cache_hits: float | None = None
    cache_misses: float | None = None
    cache_bytes: float | None = None
    cache_users: float | None = None
    cache_used_tokens: float | None = None
    cache_capacity_tokens: float | None = None
    # fewer calls sent than the step's schedule held (the request budget, or a stream, ran out):
    # not a measurement of its offered load
    cut_short: bool = False


@dataclass
class LoadTestResult:
    """A sweep: its steps in the order sent, the budget they were held to, and the QPS that
    met it (written as ``loadtest.json``)."""

    target: str
    method: str
    slo_p99_ms: float
    steps: list[StepResult] = field(default_factory=list)
    # the highest offered QPS up to which every step met the budget (a step that missed it
    # caps the figure even if a higher, luckier step met it: see highest_passing_qps)
    max_qps_within_slo: float = 0.0
    highest_passing_qps: float = 0.0  # the highest step that met the budget, whatever the steps below it did
    workload: str = ""
    sender: str = "python"  # who sent: this Python process or the native (C++) sender


def qps_within(steps: list[StepResult], slo_ms: float) -> tuple[float, float]:
    """(the highest offered QPS up to which every step's p99, failures counted as infinite,
    met ``slo_ms``; the highest step that met it). They differ when a step missed the budget
    below one that met it: on a noisy host the first figure is the one to plan with. A step
    that sent nothing or was cut short of its schedule meets nothing."""
    def met(s: StepResult) -> bool:  # (a step that sent nothing, or less than its schedule, met nothing)
        return not s.cut_short and s.sent > 0 and s.p99_all_ms <= slo_ms

    sustained = 0.0
    for s in sorted(steps, key=lambda s: s.offered_qps):
        if not met(s):
            break
        sustained = s.offered_qps
    return sustained, max((s.offered_qps for s in steps if met(s)), default=0.0)

