"""Open-loop load generator for genrec.v1.Recommender: QPS sweeps, latency percentiles,
errors by status code, the highest QPS under a p99 budget.

Open loop: each step draws Poisson send times for its offered QPS and sends on schedule
whatever the server's speed; latency is measured from the *scheduled* send time, so a
slow server cannot hide latency by slowing the sender (no coordinated omission). Failed
calls count as infinitely slow in ``p99_all``, the number the SLO is checked against.

    genrec loadtest --target 127.0.0.1:50051 --qps 50,100,200 --duration 10 \\
        --workload workload.jsonl --slo-p99-ms 15 --out loadtest-out/
    genrec loadtest --make-workload data/ml1m --out workload.jsonl --n 2000
    genrec loadtest --target 127.0.0.1:50051 --qps 5,10,20 --workload repeated \\
        --repeated.catalogue=ARTIFACT --repeated.history=4000 --metrics-url http://127.0.0.1:9100/metrics

The repeated-user workload (:class:`RepeatedUsers`) is built as it is sent: users who come
back, several calls per page view, histories that grow between views; with ``--metrics-url``
each step also reports the server's cache (hit rate, memory) from its Prometheus counters.

Only ever sends to ``--target``; every step is bounded by its duration and the whole run
by ``--max-requests``.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import os
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tqdm import tqdm

from genrec.loadtest.client import user as client_user
from genrec.loadtest.hdr import Histogram
from genrec.proto.v1 import recommender_pb2 as pb


@dataclass
class StepResult:
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


@dataclass
class LoadTestResult:
    target: str
    method: str
    slo_p99_ms: float
    steps: list[StepResult] = field(default_factory=list)
    # the highest offered QPS up to which every step met the budget (a step that missed it
    # caps the figure even if a higher, luckier step met it: see highest_passing_qps)
    max_qps_within_slo: float = 0.0
    highest_passing_qps: float = 0.0  # the highest step that met the budget, whatever the steps below it did
    workload: str = ""


# ----- workloads ------------------------------------------------------------------------------
def make_workload(data: str | Path, out: str | Path, n: int = 2000, history: int = 200, retrieve_k: int = 100,
                  top_k: int = 10, candidates: int = 0, with_actions: bool = False, seed: int = 0) -> Path:
    """Recommend requests from real users' latest events (JSONL, one request a line).

    ``with_actions`` keeps the events' action bitmasks and the user's context features
    (for ranking models with action and context tables)."""
    import pyarrow.dataset as ds

    # either dataset layout (train/data/schema.py), read without loading training code
    folder = Path(data) / "interactions"
    log = ds.dataset(folder if folder.is_dir() else Path(data) / "interactions.parquet", format="parquet",
                     partitioning="hive")
    ctx_cols = [c for c in log.schema.names if c.startswith("ctx_")] if with_actions else []
    t = log.to_table(columns=["item_ids", "timestamps", "actions", *ctx_cols])
    rng = np.random.default_rng(seed)
    rows = rng.choice(t.num_rows, size=n, replace=t.num_rows < n)
    items, times, acts = (t.column(c).to_pylist() for c in ("item_ids", "timestamps", "actions"))
    ctx = {c[4:]: t.column(c).to_pylist() for c in ctx_cols}
    with open(out, "w") as f:
        for r in rows:
            h = items[r][-history:]
            ts = (times[r] or [0] * len(items[r]))[-history:]
            ac = (acts[r] or [0] * len(items[r]))[-history:]
            req = {"history": [[int(i), int(x), int(a) if with_actions else 0] for i, x, a in zip(h, ts, ac)],
                   "retrieve_k": retrieve_k, "top_k": top_k}
            if ctx:
                req["context"] = {k: v[r] for k, v in ctx.items() if v[r]}
            if candidates:
                req["candidates"] = [[int(c), 1.0] for c in rng.choice(items[r], size=min(candidates, len(items[r])))]
            f.write(json.dumps(req) + "\n")
    return Path(out)


def load_workload(path: str | Path, columns: bool = True) -> list[bytes]:
    """JSONL requests -> serialized RecommendRequests (serialized once, before sending); the
    history as ``User.history_columns`` (packed arrays), or with ``columns=False`` as one
    ``Event`` message per event."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        user = client_user([tuple(e) for e in r["history"]], r.get("context", {}), columns=columns)
        req = pb.RecommendRequest(user=user, retrieve_k=r.get("retrieve_k", 0), top_k=r.get("top_k", 0),
                                  candidates=[pb.Candidate(item_id=i, bid=b) for i, b in r.get("candidates", [])])
        out.append(req.SerializeToString())
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


# ----- the repeated-user workload ----------------------------------------------------------------
EPOCH = 1_600_000_000  # the earliest first event (Unix seconds)


@dataclass(frozen=True)
class RepeatedUsers:
    """Users who come back (``genrec loadtest --workload repeated --repeated.KEY=VALUE``).

    A population of ``users``; user ``u`` (0-based) opens each page view with probability
    proportional to ``(u + 1) ** -zipf``. A page view is ``calls_per_view`` calls, sent one
    after another, with the same history and request time; before each of a user's page views
    after the first, ``appended`` events join the end of the history, later than the previous
    view's request time, and the new request time is later still. A first history holds
    ``history`` events. A call is a Rank of ``candidates`` given items or, with ``method =
    "Recommend"``, retrieves ``retrieve_k`` and returns ``top_k``. Ranges are inclusive, drawn
    uniformly. Each call carries ``User.user_id = user_prefix + str(u)``: engines that keep
    encoded histories file them under it (default prefix ``h{history}s{seed}u``, so workloads
    of different shapes against one server never share a user)."""

    catalogue: str = ""  # for the CLI: an artifact (its corpus ids) or a dataset (items.parquet) folder
    users: int = 1000
    zipf: float = 1.1
    history: int = 200
    calls_per_view: tuple[int, int] = (3, 5)
    appended: tuple[int, int] = (1, 5)
    candidates: tuple[int, int] = (100, 500)
    method: Literal["Rank", "Recommend"] = "Rank"
    retrieve_k: int = 100
    top_k: int = 10
    seed: int = 0
    user_prefix: str = ""

    def __post_init__(self) -> None:
        for name, least in (("calls_per_view", 1), ("appended", 0), ("candidates", 1)):
            r = getattr(self, name)
            if len(r) != 2 or not least <= r[0] <= r[1]:
                raise ValueError(f"repeated.{name} = {list(r)}: give [low, high] with {least} <= low <= high")
        if self.users < 1 or self.history < 1 or self.zipf < 0:
            raise ValueError(f"repeated: users ({self.users}) and history ({self.history}) must be at least 1, "
                             f"zipf ({self.zipf}) at least 0")


@dataclass(frozen=True)
class Call:
    """One call of the repeated-user workload: its serialized request and where it stands."""

    payload: bytes
    user: int
    view: int  # the user's page views before this one (0: the first; its history was never sent)
    index: int  # the call's place in its page view (0: the first)
    history: int  # events in the history sent
    candidates: int  # given candidates (0: Recommend retrieves)


@dataclass
class _Visitor:
    """What the generator keeps per user: the events appended since the first history (which
    is drawn again from the user's own seed when needed, so 8,000-event histories are never
    held), the request time and the page views so far."""

    request_time: int
    items: list[int] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    views: int = 0


class RepeatedUserWorkload:
    """:class:`RepeatedUsers` over a catalogue of item ids, as a stream built as it is read.

    >>> w = RepeatedUserWorkload(RepeatedUsers(users=10, history=5, candidates=(2, 2)), np.arange(1, 50))
    >>> [(c.user, c.view, c.index, c.history) for c in itertools.islice(w.calls(), 12)][4:10]
    [(2, 0, 4, 5), (0, 0, 0, 5), (0, 0, 1, 5), (0, 0, 2, 5), (0, 0, 3, 5), (0, 1, 0, 7)]

    Deterministic under ``cfg.seed``: the sequence of page views comes from one generator, the
    events appended and the candidates from another, each user's first history from its own."""

    def __init__(self, cfg: RepeatedUsers, items: np.ndarray) -> None:
        self.items = np.unique(np.asarray(items, dtype=np.int64))
        if self.items.size == 0:
            raise ValueError("repeated users: the catalogue holds no item ids")
        if cfg.method == "Rank" and cfg.candidates[1] > self.items.size:
            raise ValueError(f"repeated.candidates = {list(cfg.candidates)}: the catalogue has {self.items.size} items")
        self.cfg = cfg
        self.prefix = cfg.user_prefix or f"h{cfg.history}s{cfg.seed}u"
        self.popularity = np.arange(1, cfg.users + 1, dtype=np.float64) ** -cfg.zipf
        self.popularity /= self.popularity.sum()
        self._cdf = np.cumsum(self.popularity)

    def views(self, chunk: int = 1024) -> Iterator[tuple[int, int, int]]:
        """(user, calls, events appended before it if the user was seen before) per page view, forever."""
        rng = np.random.default_rng((self.cfg.seed, 0))
        (c0, c1), (a0, a1) = self.cfg.calls_per_view, self.cfg.appended
        while True:
            users = np.minimum(np.searchsorted(self._cdf, rng.random(chunk), side="right"), self.cfg.users - 1)
            calls, appended = rng.integers(c0, c1 + 1, chunk), rng.integers(a0, a1 + 1, chunk)
            yield from zip(users.tolist(), calls.tolist(), appended.tolist())

    def first_history(self, user: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(item ids, increasing timestamps, request time) of ``user``'s first page view."""
        rng = np.random.default_rng((self.cfg.seed, 2, user))
        n = self.cfg.history
        items = self.items[rng.integers(0, self.items.size, n)]
        times = EPOCH + int(rng.integers(0, 86400 * 365)) + np.cumsum(rng.integers(1, 3600, n))
        return items, times, int(times[-1] + rng.integers(1, 60))

    def calls(self) -> Iterator[Call]:
        """Every call, forever, each request serialized when it is reached (the user's part
        once per page view)."""
        cfg, rng = self.cfg, np.random.default_rng((self.cfg.seed, 1))
        visitors: dict[int, _Visitor] = {}
        for user, n, k in self.views():
            base_items, base_times, first_request = self.first_history(user)
            v = visitors.get(user)
            if v is None:
                v = visitors[user] = _Visitor(first_request)
            else:  # new events after the last request, then a later request
                times = v.request_time + np.cumsum(rng.integers(1, 600, k))
                v.items += self.items[rng.integers(0, self.items.size, k)].tolist()
                v.times += times.tolist()
                v.request_time = int((times[-1] if k else v.request_time) + rng.integers(1, 60))
            cols = pb.EventColumns(item_ids=base_items.tolist() + v.items, timestamps=base_times.tolist() + v.times)
            # RankRequest and RecommendRequest both carry the user as field 1: serialized messages
            # concatenate into their merge, so the user is serialized once per page view
            head = pb.RankRequest(user=pb.User(history_columns=cols, request_time=v.request_time,
                                               user_id=f"{self.prefix}{user}")).SerializeToString()
            length = cfg.history + len(v.items)
            for j in range(n):
                if cfg.method == "Rank":
                    c = int(rng.integers(cfg.candidates[0], cfg.candidates[1] + 1))
                    ids = rng.choice(self.items, size=c, replace=False).tolist()
                    tail = pb.RankRequest(candidates=[pb.Candidate(item_id=i, bid=1.0) for i in ids])
                else:
                    c, tail = 0, pb.RecommendRequest(retrieve_k=cfg.retrieve_k, top_k=cfg.top_k)
                yield Call(head + tail.SerializeToString(), user, v.views, j, length, c)
            v.views += 1

    def payloads(self) -> Iterator[bytes]:
        return (c.payload for c in self.calls())

    def users_of(self, n_calls: int) -> list[int]:
        """The users the first ``n_calls`` calls visit, in order of their first visit."""
        seen: dict[int, None] = {}
        calls = 0
        for user, n, _ in self.views():
            if calls >= n_calls:
                break
            seen.setdefault(user, None)
            calls += n
        return list(seen)

    def first_calls(self, users: list[int]) -> Iterator[Call]:
        """A call carrying each user's first-view history, as the stream first sends it (a
        Rank of one candidate, or the Recommend): a cache primed with these holds every active
        user, so what the stream then measures is the steady state of a warm cache."""
        cfg = self.cfg
        for user in users:
            items, times, request = self.first_history(user)
            u = pb.User(history_columns=pb.EventColumns(item_ids=items.tolist(), timestamps=times.tolist()),
                        request_time=request, user_id=f"{self.prefix}{user}")
            if cfg.method == "Rank":
                req = pb.RankRequest(user=u, candidates=[pb.Candidate(item_id=int(self.items[0]), bid=1.0)])
            else:
                req = pb.RecommendRequest(user=u, retrieve_k=cfg.retrieve_k, top_k=cfg.top_k)
            yield Call(req.SerializeToString(), user, 0, 0, cfg.history, 1 if cfg.method == "Rank" else 0)

    def plan(self, n_calls: int) -> dict[str, int]:
        """What the first ``n_calls`` calls touch, without building them: distinct users, page
        views, and the users' history events at their last view (what a cache holding every
        active user holds), in all and at most for one user."""
        seen: dict[int, int] = {}
        calls = views = 0
        for user, n, k in self.views():
            if calls >= n_calls:
                break
            seen[user] = seen[user] + k if user in seen else self.cfg.history
            calls, views = calls + n, views + 1
        return {"users": len(seen), "views": views, "calls": calls, "tokens": sum(seen.values()),
                "max_history": max(seen.values(), default=0)}


def catalogue_ids(path: str | Path) -> np.ndarray:
    """Item ids of an artifact folder (its retrieval corpus) or a dataset folder (items.parquet)."""
    p = Path(path)
    if (p / "dense.safetensors").exists():
        from safetensors import safe_open

        with safe_open(str(p / "dense.safetensors"), "np") as f:
            return f.get_tensor("corpus_ids").astype(np.int64)
    if (p / "items.parquet").exists():
        import pyarrow.parquet as pq

        return pq.read_table(p / "items.parquet", columns=["item_id"]).column("item_id").to_numpy()
    raise FileNotFoundError(f"{path}: no dense.safetensors (an artifact) or items.parquet (a dataset) to take "
                            "item ids from; set repeated.catalogue to one of those folders")


# ----- the server's cache, from its Prometheus metrics ---------------------------------------------
CACHE_COUNTERS = ("history_tokens", "cached_tokens", "evicted_tokens", "hits", "misses")
CACHE_GAUGES = ("bytes", "users", "used_tokens", "capacity_tokens")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value}, summed over the samples' labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)[0], line.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str | None, timeout: float = 2.0) -> dict[str, float] | None:
    """The metrics at ``url`` (parse_metrics), or None without a url or an answer."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_metrics(r.read().decode())
    except (OSError, ValueError):
        return None


def cache_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """StepResult's cache fields from scrapes before and after a step: the counters' growth
    (``genrec_cache_<name>_total``), the hit rate (cached / history tokens), the gauges after
    (``genrec_cache_<name>``). None for what either scrape lacks (a server without a cache, an
    engine that does not count) and for a counter that went back (the server restarted)."""
    def value(m: dict[str, float] | None, name: str) -> float | None:
        if m is None:
            return None
        return m.get(f"genrec_cache_{name}_total", m.get(f"genrec_cache_{name}"))

    grown = {}
    for name in CACHE_COUNTERS:
        a, b = value(before, name), value(after, name)
        grown[name] = b - a if a is not None and b is not None and b >= a else None
    hist, cached = grown["history_tokens"], grown["cached_tokens"]
    return {"hit_rate": cached / hist if hist and cached is not None else None,
            **{f"cache_{n}": grown[n] for n in CACHE_COUNTERS},
            **{f"cache_{n}": value(after, n) for n in CACHE_GAUGES}}


# ----- the open-loop sender ---------------------------------------------------------------------
RESPONSES = {"Recommend": pb.RecommendResponse, "Retrieve": pb.RetrieveResponse, "Rank": pb.RankResponse}


def _timing(response, reply: bytes) -> pb.Timing | None:  # noqa: ANN001
    """The reply's Timing, or None when the reply does not parse as ``response`` or carries none."""
    try:
        msg = response.FromString(reply)
    except DecodeError:
        return None
    return msg.timing if msg.HasField("timing") else None


def cpu_times() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU time of the whole machine so far, in clock ticks, from
    /proc/stat's first line; None where there is none (not Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, idle, iowait, irq, softirq, steal = (float(x) for x in fields[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def cpu_shares(before: tuple[float, float, float] | None,
               after: tuple[float, float, float] | None) -> tuple[float, float]:
    """(busy %, steal %) of the machine's CPU time between two :func:`cpu_times` readings."""
    if before is None or after is None or after[2] <= before[2]:
        return math.nan, math.nan
    total = after[2] - before[2]
    return 100 * (after[0] - before[0]) / total, 100 * (after[1] - before[1]) / total


def run_step(call, payloads: Sequence[bytes] | Iterator[bytes], qps: float, duration: float, timeout: float,
             seed: int, max_requests: int, bar: tqdm | None = None, response=None,  # noqa: ANN001
             calls: list[tuple[float, float, str]] | None = None) -> StepResult:
    """One open-loop step. ``call``: a (sync) unary-unary callable of a channel; this thread
    sleeps to each scheduled send time and starts the call without waiting for it
    (``call.future``), the answer is timed when gRPC completes it (its callback thread).
    ``response``: the reply's message class; when given, each answer's ``timing`` splits
    its latency into the server's part and the rest. ``calls``: when given, every call is
    appended as (scheduled time since the step's start, latency, status code name).
    ``payloads``: a list, sent round from its start, or an iterator (a stream such as
    :meth:`RepeatedUserWorkload.payloads`), read on from where it stands; each request is taken
    before the sleep to its send time, so building it costs the gap, not lateness.

    The sender sleeps with ``time.sleep`` (a nanosecond timer) rather than an event loop's
    timer, whose millisecond granularity makes an asyncio sender late by up to a millisecond
    and more: lateness that counts against the server, since latency runs from the scheduled
    time."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / qps, size=int(qps * duration * 1.5) + 10)
    offsets = np.cumsum(gaps)
    offsets = offsets[offsets < duration][:max_requests]
    hist, codes = Histogram(), Counter()
    server, compute, outside, lateness = Histogram(), Histogram(), Histogram(), Histogram()
    decode, wait, handoff, refused = Histogram(), Histogram(), Histogram(), Histogram()
    lock, finished = threading.Lock(), threading.Event()
    state = {"batch_sum": 0, "pending": len(offsets)}  # what the callbacks update
    source = itertools.cycle(payloads) if isinstance(payloads, Sequence) else iter(payloads)

    def answered(fut: grpc.Future, scheduled: float) -> None:
        took = time.perf_counter() - scheduled
        try:
            reply, code = fut.result(), "OK"
        except grpc.RpcError as e:
            reply, code = None, e.code().name
        except grpc.FutureCancelledError:
            reply, code = None, "CANCELLED"
        timing = _timing(response, reply) if reply is not None and response is not None else None
        with lock:
            codes[code] += 1
            if calls is not None:
                calls.append((scheduled - start, took, code))
            if code == "RESOURCE_EXHAUSTED":
                refused.record(took)
            if reply is not None:
                hist.record(took)
                if timing is not None:
                    in_server = (timing.queue_ms + timing.compute_ms) / 1e3
                    server.record(in_server)
                    compute.record(timing.compute_ms / 1e3)
                    outside.record(took - in_server)
                    decode.record(timing.decode_ms / 1e3)
                    wait.record(timing.wait_ms / 1e3)
                    handoff.record(timing.handoff_ms / 1e3)
                    state["batch_sum"] += timing.batch_size
            state["pending"] -= 1
            if state["pending"] == 0:
                finished.set()
        if bar is not None:
            bar.update(1)

    machine = cpu_times()
    late, start = 0, time.perf_counter() + 0.05
    for i, off in enumerate(offsets):
        payload = next(source, None)
        if payload is None:  # a finite stream ran out: the step ends with it
            with lock:
                state["pending"] -= len(offsets) - i
                if state["pending"] == 0:
                    finished.set()
            offsets = offsets[:i]
            break
        scheduled = start + off
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        behind = time.perf_counter() - scheduled
        lateness.record(behind)
        if behind > 1e-3:
            late += 1
        fut = call.future(payload, timeout=timeout)
        fut.add_done_callback(functools.partial(answered, scheduled=scheduled))
    if len(offsets):
        finished.wait()
    busy, steal = cpu_shares(machine, cpu_times())
    batch_sum = state["batch_sum"]
    sent, ok = len(offsets), codes["OK"]
    if sent == 0:
        return StepResult(qps, duration, 0, 0, {}, 0.0, *[math.nan] * 6, 0, cpu_busy_pct=busy, steal_pct=steal)

    def pct(p: float) -> float:
        return hist.percentile(p) * 1e3 if ok else math.nan

    # p99 with failures as +inf: the (p99 * sent)-th latency must come from a success
    rank_needed = math.ceil(0.99 * sent)
    p99_all = math.inf if rank_needed > ok else hist.percentile(100.0 * rank_needed / ok) * 1e3
    def ms(h: Histogram, p: float) -> float:
        return h.percentile(p) * 1e3 if h.total else math.nan

    return StepResult(qps, duration, sent, ok, {k: v for k, v in codes.items() if k != "OK"},
                      ok / duration, pct(50), pct(90), pct(99), pct(99.9), p99_all,
                      hist.max * 1e3 if ok else math.nan, late,
                      ms(server, 50), ms(server, 99), ms(compute, 50), ms(compute, 99), ms(outside, 50), ms(outside, 99), ms(lateness, 99),
                      batch_sum / server.total if server.total else math.nan,
                      ms(decode, 50), ms(decode, 99), ms(wait, 50), ms(wait, 99), ms(handoff, 50), ms(handoff, 99),
                      cpu_busy_pct=busy, steal_pct=steal, refused_p50_ms=ms(refused, 50), refused_p99_ms=ms(refused, 99))


def step_seconds(qps: float, duration: float, min_requests: int = 0) -> float:
    """How long a step runs: ``duration``, or long enough to send ``min_requests`` at its QPS
    (a p99 from ~100 calls is about their maximum; from 600, six calls lie above it)."""
    return max(duration, min_requests / qps if qps > 0 else 0.0)


def sweep(target: str, qps_steps: list[float], duration: float, payloads: Sequence[bytes] | Iterator[bytes],
          slo_ms: float, timeout_s: float = 1.0, max_requests: int = 1_000_000, progress: bool = True,
          cooldown_s: float = 1.0, method: str = "Recommend", min_requests: int = 0, warmup: int = 50,
          metrics_url: str | None = None) -> LoadTestResult:
    """Steps of :func:`run_step` at each offered QPS, after ``warmup`` calls. ``payloads``: a
    list (each step starts it again) or one stream read on through the steps. ``metrics_url``:
    the server's Prometheus endpoint; each step then reports its cache (:func:`cache_figures`)."""
    result = LoadTestResult(target, method, slo_ms)
    # what is loaded now stays; a full collection over it would stall the sender mid-step
    # (serve.factory.quiet_gc has the same reason on the server side)
    gc.collect()
    gc.freeze()
    with grpc.insecure_channel(target) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        call = ch.unary_unary(f"/genrec.v1.Recommender/{method}")
        warm = payloads[:warmup] if isinstance(payloads, Sequence) else itertools.islice(payloads, warmup)
        for p in warm:  # warm up connections and the server
            try:
                call(p, timeout=5)
            except grpc.RpcError:
                pass
        budget = max_requests
        for i, qps in enumerate(qps_steps):
            seconds = step_seconds(qps, duration, min_requests)
            bar = tqdm(total=int(qps * seconds), desc=f"{qps:g} qps", unit="req", leave=False, disable=not progress)
            before = scrape(metrics_url)
            step = run_step(call, payloads, qps, seconds, timeout_s, seed=i, max_requests=budget, bar=bar,
                            response=RESPONSES.get(method))
            if metrics_url:
                step = replace(step, **cache_figures(before, scrape(metrics_url)))
            bar.close()
            budget -= step.sent
            result.steps.append(step)
            if progress:
                tqdm.write(f"{qps:8g} qps offered | {step.achieved_qps:8.1f} ok/s | p50 {step.p50_ms:6.2f} "
                           f"p99 {step.p99_ms:7.2f} p99(all) {step.p99_all_ms:7.2f} ms | server p50 "
                           f"{step.server_p50_ms:5.2f} p99 {step.server_p99_ms:6.2f}, outside p50 {step.outside_p50_ms:5.2f} "
                           f"p99 {step.outside_p99_ms:6.2f}, batch {step.mean_batch:4.1f} | errors {step.errors}"
                           + (f" | cache hit rate {step.hit_rate:.3f}" if step.hit_rate is not None else ""))
            if budget <= 0:
                break
            time.sleep(cooldown_s)
    result.max_qps_within_slo, result.highest_passing_qps = qps_within(result.steps, slo_ms)
    return result


def qps_within(steps: list[StepResult], slo_ms: float) -> tuple[float, float]:
    """(the highest offered QPS up to which every step's p99, failures counted as infinite,
    met ``slo_ms``; the highest step that met it). They differ when a step missed the budget
    below one that met it: on a noisy host the first figure is the one to plan with."""
    sustained = 0.0
    for s in sorted(steps, key=lambda s: s.offered_qps):
        if s.p99_all_ms > slo_ms:
            break
        sustained = s.offered_qps
    return sustained, max((s.offered_qps for s in steps if s.p99_all_ms <= slo_ms), default=0.0)


# ----- reports --------------------------------------------------------------------------------
def markdown(result: LoadTestResult) -> str:
    lines = [f"Target {result.target}, {result.method}, p99 budget {result.slo_p99_ms:g} ms: "
             f"**max QPS within budget: {result.max_qps_within_slo:g}** (every step up to it met the budget)"
             + (f"; the highest step that met it: {result.highest_passing_qps:g} QPS"
                if result.highest_passing_qps != result.max_qps_within_slo else ""), "",
             "| offered QPS | achieved ok/s | sent | p50 ms | p90 ms | p99 ms | p99.9 ms | p99 incl. errors | errors "
             "| in server p50 / p99 ms | engine batch p50 / p99 ms | outside p50 / p99 ms | send late p99 ms "
             "| mean batch | decode p50 / p99 ms | wait for the engine p50 / p99 ms | hand-off p50 / p99 ms "
             "| machine busy / steal % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result.steps:
        err = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "-"
        lines.append(f"| {s.offered_qps:g} | {s.achieved_qps:.1f} | {s.sent} | {s.p50_ms:.2f} | {s.p90_ms:.2f} | "
                     f"{s.p99_ms:.2f} | {s.p999_ms:.2f} | {s.p99_all_ms:.2f} | {err} | {s.server_p50_ms:.2f} / "
                     f"{s.server_p99_ms:.2f} | {s.compute_p50_ms:.2f} / {s.compute_p99_ms:.2f} | {s.outside_p50_ms:.2f} / {s.outside_p99_ms:.2f} | "
                     f"{s.send_late_p99_ms:.2f} | {s.mean_batch:.1f} | {s.decode_p50_ms:.2f} / {s.decode_p99_ms:.2f} | "
                     f"{s.wait_p50_ms:.2f} / {s.wait_p99_ms:.2f} | {s.handoff_p50_ms:.2f} / {s.handoff_p99_ms:.2f} | "
                     f"{s.cpu_busy_pct:.0f} / {s.steal_pct:.1f} |")
    if any(s.hit_rate is not None or s.cache_bytes is not None for s in result.steps):
        lines += ["", "| offered QPS | cache hit rate | cache hits / misses | evicted tokens | cache MB | cached users "
                  "| used / capacity tokens |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {s.offered_qps:g} | {_fig(s.hit_rate, '.3f')} | {_fig(s.cache_hits, '.0f')} / "
                  f"{_fig(s.cache_misses, '.0f')} | {_fig(s.cache_evicted_tokens, '.0f')} | "
                  f"{_fig(s.cache_bytes / 2**20 if s.cache_bytes is not None else None, '.1f')} | "
                  f"{_fig(s.cache_users, '.0f')} | {_fig(s.cache_used_tokens, '.0f')} / "
                  f"{_fig(s.cache_capacity_tokens, '.0f')} |" for s in result.steps]
    lines += ["", "In server: the response's own timing (decode, queue, batch); engine batch: the batch the call rode "
              "in, as the engine timed it; outside: the rest of each call's latency (the generator's lateness, both "
              "gRPC stacks, the transport, process wake-ups). Parts of the server's share: decode (parse, validate), "
              "wait for the engine (until the engine began the call's batch: queued behind the batches before it, "
              "and the batch's trip to the engine), hand-off (the results' trip back from the end of the engine's "
              "compute). Machine busy / steal: the share of all CPUs' time busy during the "
              "step (the generator's own included when it shares the machine), and the share the hypervisor ran "
              "something else while a virtual CPU had work (Linux /proc/stat)."]
    return "\n".join(lines)


def _fig(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def plot(results: dict[str, LoadTestResult], out: Path, slo_ms: float) -> Path | None:
    """p50 / p99 against offered QPS, as one PNG; None without matplotlib (the ``plot`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        qps = [s.offered_qps for s in r.steps]
        p99 = [min(s.p99_all_ms, 1e4) for s in r.steps]
        line = ax.plot(qps, p99, marker="o", label=f"{name} p99")[0]
        ax.plot(qps, [s.p50_ms for s in r.steps], ls="--", color=line.get_color(), alpha=0.6, label=f"{name} p50")
    ax.axhline(slo_ms, color="red", lw=1, label=f"p99 budget {slo_ms:g} ms")
    ax.set(xlabel="offered load (QPS)", ylabel="latency (ms, failures as infinite)", yscale="log",
           title="latency vs offered load (open loop)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_outputs(result: LoadTestResult, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loadtest.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    (out / "loadtest.md").write_text(markdown(result) + "\n")
    plot({"server": result}, out / "latency_vs_load.png", result.slo_p99_ms)
    return out


@dataclass(frozen=True)
class LoadTestFile:
    """What ``--repeated.KEY=VALUE`` overrides fill (``--workload repeated``)."""

    repeated: RepeatedUsers = field(default_factory=RepeatedUsers)


def workload_of(args, overrides: list[str]) -> tuple[Sequence[bytes] | Iterator[bytes], str, str]:  # noqa: ANN001
    """(the requests, the method they call, a description) of ``--workload``: a JSONL file, or
    ``repeated`` configured by ``--repeated.KEY=VALUE`` overrides."""
    from genrec.config import ConfigError, load_config, to_dict

    if args.workload != "repeated":
        return load_workload(args.workload, columns=not args.event_messages), "Recommend", str(args.workload)
    bad = [o for o in overrides if not o.startswith("--repeated.")]
    if bad:
        raise ConfigError(f"--workload repeated takes --repeated.KEY=VALUE overrides: {bad[0]}")
    cfg = load_config(LoadTestFile, None, overrides).repeated
    if not cfg.catalogue:
        raise ConfigError("repeated.catalogue is not set: --repeated.catalogue=DIR (an artifact or dataset folder)")
    workload = RepeatedUserWorkload(cfg, catalogue_ids(cfg.catalogue))
    return workload.payloads(), cfg.method, "repeated " + json.dumps(to_dict(cfg))


def cmd_loadtest(args, overrides: list[str]) -> int:  # noqa: ANN001
    if overrides and (args.make_workload or args.workload != "repeated"):
        raise SystemExit(f"genrec loadtest takes config overrides only with --workload repeated: {overrides}")
    if args.make_workload:
        path = make_workload(args.make_workload, args.out or "workload.jsonl", n=args.n, history=args.history,
                             retrieve_k=args.retrieve_k, top_k=args.top_k, candidates=args.candidates,
                             with_actions=args.with_actions)
        print(f"wrote {path}")
        return 0
    if not args.target:
        raise SystemExit("genrec loadtest needs --target HOST:PORT (or --make-workload DATA)")
    if not args.workload:
        raise SystemExit("genrec loadtest needs --workload FILE (make one with --make-workload DATA --out FILE) "
                         "or --workload repeated")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    payloads, method, described = workload_of(args, overrides)
    qps = [float(x) for x in args.qps.split(",")]
    t0 = time.perf_counter()
    result = sweep(args.target, qps, args.duration, payloads, args.slo_p99_ms, args.timeout_ms / 1e3,
                   args.max_requests, progress=not args.no_progress, min_requests=args.min_requests,
                   method=method, metrics_url=args.metrics_url)
    result.workload = described
    out = write_outputs(result, args.out or "loadtest-out")
    print(markdown(result))
    print(f"\n{len(qps)} steps in {time.perf_counter() - t0:.0f}s; results in {out}/")
    return 0
