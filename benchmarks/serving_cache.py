"""Serving with per-user caches (issue 32): users who come back, side by side in one run.

    python -m genrec.benchmarks.serving_cache [--quick] [--engines torch,torch-cache,sglang] [--artifact DIR]

Three servers, each a ``genrec serve`` on 127.0.0.1 with its Prometheus metrics on, one after
another: ``torch`` (no cache: ``serve.cache.kv_cache_mb = 0``), ``torch-cache`` (the per-user
K/V cache, its budget sized for the run's active users) and ``sglang`` (its KV pool and radix
cache, ``serve.cache.pool_tokens`` sized the same way); on request (``--engines``) also
``torch-cache-auto``, the cached engine scoring large calls' candidates in bf16
(``serve.scoring.candidate_precision = "auto"``), ``sglang-auto``, SGLang set the same way,
and ``torch-cache-bounded``, the same
serving a model with a bounded reach (``MODELS``: the last 512 events in full, earlier blocks
of 64 as summaries; its own artifact, built the same way) and ``sglang-bounded``, that artifact
behind the SGLang engine. Each gets the same repeated-user
workloads (``genrec.loadtest.workload.RepeatedUsers``: Zipf-popular users, page views of 3-5 calls with
one history, 1-5 events appended between a user's views, ``User.user_id`` set): the serving
shape (Recommend: history 200, retrieve 100, rank them, return 10) and Rank of 100-500 given
candidates with histories of 200 / 1,000 / 4,000 / 8,000 events. Per workload:

* single requests, closed loop, after a warm-up: p50 / p99 of every call, of each page view's
  first call and of the calls after it ("warm": the history was just sent), Rank with 200
  candidates; warm p50 against torch without cache, as a ratio;
* an open-loop sweep (genrec.loadtest.runner.sweep; sent by the C++ sender where it builds,
  ``--sender``): p50 / p99 per offered QPS, the max QPS within the
  p99 budget, and per step the cache's hit rate (cached / history tokens, from /metrics);
* memory per cached user: the cache's bytes per token (its gauges) times the workload's mean
  history.

Then the pool too small: each caching server again, its cache sized for a tenth of the active
users' tokens, on the 1,000-event workload: errors must be 0 and memory bounded.

The model: the ML-1M ranking HSTU (configs/ranking_ml1m.toml) with ``max_seq_len`` 8192,
trained a few steps (latency, not quality, is measured), int8 tables, built once under ``--out``.
``--quick`` is a smoke run (two workloads, short steps, the small pool for torch only: an SGLang
server takes a minute to start; its JSON stays under ``--out``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genrec.benchmarks.common import (
    ROOT,
    dataset,
    machine,
    pin_process,
    shown_path,
    today,
    update_results_md,
    write_json,
)
from genrec.loadtest.sender import choose

SLO_MS = 15.0
HISTORY_LIMIT = 16384  # serve.limits.max_history: 8,000 events and what the run appends
SINGLE_CANDIDATES = 200  # the single-request Rank calls (the issue's warm Rank target)
SMALL_POOL = 0.1  # the small pool: this share of the active users' tokens
SMALL_SHAPE = "rank-1k"


@dataclass(frozen=True)
class Shape:
    """One workload: its method, first-history length and offered QPS steps (CPU; --qps-scale)."""

    name: str
    method: str
    history: int
    qps: tuple[float, ...]


SHAPES = (Shape("serving", "Recommend", 200, (25, 50, 100, 200, 300)),
          Shape("rank-200", "Rank", 200, (10, 25, 50, 100)),
          Shape("rank-1k", "Rank", 1000, (10, 25, 50)),
          Shape("rank-4k", "Rank", 4000, (5, 10, 20)),
          Shape("rank-8k", "Rank", 8000, (5, 10, 20)))
QUICK = {"serving": (25, 50), "rank-1k": (10,)}  # --quick: these workloads, these steps
# engine config -> (--engine, the serve.cache key it is sized by; None: the cache off)
ENGINES = {"torch": ("torch", None), "torch-cache": ("torch", "kv_cache_mb"), "sglang": ("sglang", "pool_tokens"),
           "torch-cache-auto": ("torch", "kv_cache_mb"), "torch-cache-bounded": ("torch", "kv_cache_mb"),
           "sglang-bounded": ("sglang", "pool_tokens"), "sglang-auto": ("sglang", "pool_tokens")}
# engine configs that differ from another by server flags only
FLAGS = {"torch-cache-auto": ['--serve.scoring.candidate_precision="auto"'],
         "sglang-auto": ['--serve.scoring.candidate_precision="auto"'],
         "torch-cache-bounded": ['--serve.scoring.candidate_precision="auto"']}
# engine configs that serve another model: its training flags (the bounded reach of issue 44,
# kernels.hstu_bounded: the last 512 events in full, blocks of 64 before them as one summary each)
MODELS = {name: ("bounded", ["--model.hstu.window=512", "--model.hstu.summary_block=64"])
          for name in ("torch-cache-bounded", "sglang-bounded")}


# ----- the artifact ------------------------------------------------------------------------------
def genrec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "genrec.cli", *args], cwd=ROOT, check=True)


def build(out: Path, steps: int = 10, variant: str = "", flags: tuple[str, ...] = ()) -> Path:
    """ML-1M ranking HSTU with an 8,192-token window (``flags``: more model flags, built as
    ``variant``) -> a few steps -> int8 artifact (once)."""
    suffix = f"-{variant}" if variant else ""
    art = out / f"artifact-int8{suffix}"
    if not (art / "manifest.json").exists():
        genrec("train", "--config", "configs/ranking_ml1m.toml", f'--data.path="{dataset("ml1m")}"',
               f'--run.out_dir="{out}"', "--run.name=cache", f"--run.id=train{suffix}", "--model.max_seq_len=8192",
               f"--train.max_steps={steps}", "--train.evaluate=false", "--train.progress=false",
               '--train.parallel.sparse_optimizer="rowwise_adagrad"', *flags)
        genrec("quantize", "--checkpoint", str(out / "cache" / f"train{suffix}"), "--out", str(art),
               "--embeddings", "int8", "--no-eval", "--no-progress")
    return art


def kv_bytes_per_token(art: Path) -> int:
    """The torch engine's cache bytes per history token (serve.kvcache: every layer's keys and
    values, the events as int64), from the artifact's manifest."""
    m = json.loads((art / "manifest.json").read_text())
    h = m["model"].get("hstu", {})
    width = 2 if m.get("quantization", {}).get("dense") in ("bf16", "fp16") else 4
    return h.get("num_layers", 2) * h.get("num_heads", 1) * (h.get("qk_dim", 64) + h.get("v_dim", 64)) * width + 32


def cache_keys() -> set[str]:
    """The keys of ``[serve.cache]`` this checkout's ServeConfig has (none before it had one)."""
    import typing

    from genrec.serve.server import ServeConfig

    hints = typing.get_type_hints(ServeConfig)
    cls = hints.get("cache")
    return {f.name for f in dataclasses.fields(cls)} if cls and dataclasses.is_dataclass(cls) else set()


# ----- servers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``genrec serve`` on 127.0.0.1 (``benchmarks.serving.start_server``), metrics on: started
    by ``with``, stopped (SIGTERM) after."""

    def __init__(self, engine: str, artifact: Path, args: list[str], threads: int) -> None:
        self.metrics_port = free_port()
        self.engine, self.artifact, self.threads = engine, artifact, threads
        self.args = [f"--serve.metrics_port={self.metrics_port}", f"--serve.limits.max_history={HISTORY_LIMIT}", *args]
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.front_end_cpus: list[int] = []

    def __enter__(self) -> Server:
        from genrec.benchmarks.serving import start_server

        self.proc, self.target, layout = start_server(self.engine, self.artifact, self.threads, extra=self.args,
                                                      timeout_s=600, tail=self.tail)
        self.front_end_cpus = layout["front_end_cpus"]
        # keep reading: a server that logs into a full pipe would block
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def memory(self) -> dict[str, float | None]:
        """Resident MB of the server and its engine processes; their GPU MB where nvidia-smi answers."""
        pids = process_tree(self.proc.pid)
        rss = 0.0
        for pid in pids:
            try:
                rss += next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                            if ln.startswith("VmRSS:")) / 1024
            except (OSError, StopIteration):
                pass
        return {"rss_mb": round(rss, 1), "gpu_mb": gpu_mb(pids)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (/proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:  # the thread or process is gone
                pass
    return out


def gpu_mb(pids: list[int]) -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [ln.split(",") for ln in out.splitlines() if ln.strip()]
    return sum(float(m) for p, m in rows if p.strip().isdigit() and int(p) in pids)


# ----- measurements ------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float | None:
    import numpy as np

    return float(np.percentile(xs, p)) if xs else None


def single_requests(server: Server, method: str, calls: Any, n: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """``n`` calls one at a time: p50 / p99 of all, of each page view's first call, of the rest."""
    import grpc

    from genrec.loadtest.scrape import cache_figures, scrape

    first: list[float] = []
    warm: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    before = scrape(server.metrics_url)
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_unary(f"/genrec.v1.Recommender/{method}")
        for c in itertools.islice(calls, n):
            t0 = time.perf_counter()
            try:
                call(c.payload, timeout=timeout_s)
            except grpc.RpcError as e:
                errors[e.code().name] += 1
                continue
            (first if c.index == 0 else warm).append((time.perf_counter() - t0) * 1e3)
    cache = cache_figures(before, scrape(server.metrics_url))
    return {"n": n, "p50_ms": pct(first + warm, 50), "p99_ms": pct(first + warm, 99), "first_p50_ms": pct(first, 50),
            "warm_p50_ms": pct(warm, 50), "warm_p99_ms": pct(warm, 99), "errors": dict(errors),
            "hit_rate": cache["hit_rate"]}


def workloads(shape: Shape, items: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The shape's three streams (warm-up, single requests, load): one seed, disjoint users."""
    from genrec.loadtest.workload import RepeatedUsers, RepeatedUserWorkload

    def make(part: str, seed: int, **kw: Any) -> RepeatedUserWorkload:
        cfg = RepeatedUsers(users=args.users, zipf=args.zipf, history=shape.history, method=shape.method,
                            seed=seed, user_prefix=f"{shape.name}-{part}", **kw)
        return RepeatedUserWorkload(cfg, items)

    fixed = (SINGLE_CANDIDATES, SINGLE_CANDIDATES)
    return {"warmup": make("w", args.seed + 2, candidates=fixed), "single": make("s", args.seed + 1, candidates=fixed),
            "load": make("l", args.seed)}


def steps_of(shape: Shape, args: argparse.Namespace) -> list[float]:
    return [q * args.qps_scale for q in (QUICK[shape.name] if args.quick else shape.qps)]


def plan(shape: Shape, streams: dict[str, Any], args: argparse.Namespace) -> dict[str, int]:
    """What the shape's calls touch (RepeatedUserWorkload.plan), Poisson counts with a margin."""
    n_load = args.warmup + sum(math.ceil(q * args.duration * 1.3) + 10 for q in steps_of(shape, args))
    parts = [streams["warmup"].plan(args.warmup), streams["single"].plan(args.single), streams["load"].plan(n_load)]
    load = parts[2]
    return {"users": sum(p["users"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
            "max_history": max(p["max_history"] for p in parts),
            "load_tokens_per_user": load["tokens"] / max(load["users"], 1)}


def measure(server: Server, shape: Shape, streams: dict[str, Any], args: argparse.Namespace,
            steps: list[float] | None = None, prime: bool = False) -> tuple[dict, Any]:
    """One workload against one server: single requests, then the sweep (the shape's steps, or
    ``steps``); ``prime``: first one call per user the sweep visits, so its hit rate is a warm
    cache's (the misses left are new events and evictions, not users never seen)."""
    from genrec.loadtest.runner import sweep

    t0 = time.perf_counter()
    single_requests(server, shape.method, streams["warmup"].calls(), args.warmup)
    single = single_requests(server, shape.method, streams["single"].calls(), args.single)
    steps = steps or steps_of(shape, args)
    primed = None
    if prime:  # every user the sweep will visit, once, at its first-view history (not measured)
        users = streams["load"].users_of(int(sum(steps) * args.duration * 1.5) + args.warmup)
        primed = single_requests(server, shape.method, streams["load"].first_calls(users), len(users), timeout_s=120)
    before_sweep = server.memory()
    res = sweep(server.target, steps, args.duration, streams["load"].payloads(), SLO_MS,
                timeout_s=args.timeout_s, progress=not args.no_progress, method=shape.method, warmup=args.warmup,
                metrics_url=server.metrics_url, sender=args.sender)
    hist = sum(s.cache_history_tokens or 0 for s in res.steps)
    cached = [s.cache_cached_tokens for s in res.steps if s.cache_cached_tokens is not None]
    last = res.steps[-1] if res.steps else None
    per_token = (last.cache_bytes / last.cache_used_tokens
                 if last and last.cache_bytes is not None and last.cache_used_tokens else None)
    if per_token is None and last and last.cache_bytes and last.cache_capacity_tokens:
        per_token = last.cache_bytes / last.cache_capacity_tokens  # a pool allocated whole (SGLang's)
    row = {"single": single, "max_qps_within_slo": res.max_qps_within_slo,
           "highest_passing_qps": res.highest_passing_qps,
           "hit_rate": sum(cached) / hist if cached and hist else None,
           "cache": {k: getattr(last, f"cache_{k}") if last else None
                     for k in ("bytes", "users", "used_tokens", "capacity_tokens")},
           "primed_users": primed["n"] if primed else 0,
           "cache_bytes_per_token": per_token, "server_before_sweep": before_sweep, "server": server.memory(),
           "steps": [dataclasses.asdict(s) for s in res.steps], "seconds": round(time.perf_counter() - t0, 1)}
    return row, res


# ----- the run -----------------------------------------------------------------------------------
def engine_args(name: str, keys: set[str], size: float | None, args: argparse.Namespace) -> list[str] | str:
    """The server's extra flags for engine config ``name``, or why it cannot run here."""
    engine, key = ENGINES[name]
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (bash .ci/setup-sglang)"
    out = [f"--serve.device={args.device}"] if args.device else []
    out += FLAGS.get(name, [])
    if args.window_block and "window_block" in keys:
        out.append(f"--serve.cache.window_block={args.window_block}")
    if key is None:  # the cache off (where there is one to turn off)
        return out + (["--serve.cache.kv_cache_mb=0"] if "kv_cache_mb" in keys else [])
    if key not in keys:
        if engine == "sglang":  # SGLang runs as it is, its pool unsized
            return out
        return f"this checkout's ServeConfig has no serve.cache.{key}"
    return out + [f"--serve.cache.{key}={size:g}"]


def sizes(plans: dict[str, dict], per_token: int, fraction: float = 1.0,
          shape: str | None = None) -> dict[str, float]:
    """kv_cache_mb and pool_tokens that hold ``fraction`` of the active users' tokens (of the
    largest workload, or of ``shape``): a quarter more, and for the pool room for the calls
    being encoded (an SGLang pool also holds the running batch)."""
    chosen = [plans[shape]] if shape else list(plans.values())
    tokens = max(p["tokens"] for p in chosen) * fraction
    longest = max(p["max_history"] for p in chosen) + 512
    slack = 1.25 if fraction >= 1 else 1.0
    return {"tokens": tokens, "kv_cache_mb": round(max(tokens * slack * per_token / 2**20, 1.0), 1),
            "pool_tokens": math.ceil(tokens * slack) + (4 if fraction >= 1 else 2) * longest}


def run_engine(name: str, server_args: list[str], shapes: list[Shape], items: Any, art: Path,
               args: argparse.Namespace) -> tuple[dict, dict]:
    record: dict[str, Any] = {"server_args": server_args, "shapes": {}}
    sweeps = {}
    t0 = time.perf_counter()
    with Server(ENGINES[name][0], art, server_args, args.server_threads) as server:
        record["startup_s"] = round(time.perf_counter() - t0, 1)
        record["memory_at_start"] = server.memory()
        all_cpus = tuple(sorted(os.sched_getaffinity(0)))
        pin_process(server.front_end_cpus or all_cpus)  # off a pinned engine's CPU
        try:
            for shape in shapes:
                row, res = measure(server, shape, workloads(shape, items, args), args,
                                   prime=ENGINES[name][1] is not None)
                record["shapes"][shape.name] = row
                sweeps[shape.name] = res
                print(name, shape.name, json.dumps({k: row[k] for k in ("single", "max_qps_within_slo", "hit_rate")}),
                      flush=True)
        finally:
            pin_process(all_cpus)
    return record, sweeps


def small_pool(name: str, server_args: list[str], shape: Shape, items: Any, art: Path,
               args: argparse.Namespace, pool: str, full: dict) -> dict[str, Any]:
    """The caching server with a pool too small for the active users (``pool``: its key = size) at
    the shape's lowest step, a load the server met with its full pool (``full``: that run's row):
    errors by code beside the full pool's, memory, hit rate."""
    qps = steps_of(shape, args)[0]
    with Server(ENGINES[name][0], art, server_args, args.server_threads) as server:
        start = server.memory()
        row, _ = measure(server, shape, workloads(shape, items, args), args, steps=[qps], prime=True)
    steps = row["steps"]
    errors = collections.Counter(row["single"]["errors"])
    for s in steps:
        errors.update(s["errors"])
    same = next((s for s in full.get("steps", []) if s["offered_qps"] == qps), {})
    within = [s["cache_used_tokens"] <= s["cache_capacity_tokens"] for s in steps
              if s["cache_used_tokens"] is not None and s["cache_capacity_tokens"] is not None]
    return {"server_args": server_args, "pool": pool, "shape": shape.name, "offered_qps": qps,
            "calls": sum(s["sent"] for s in steps) + args.single, "errors": sum(errors.values()),
            "errors_by_code": dict(errors), "full_pool_errors_at_qps": same.get("errors"),
            "p50_ms": steps[0]["p50_ms"] if steps else None, "p99_all_ms": steps[0]["p99_all_ms"] if steps else None,
            "hit_rate": row["hit_rate"], "cache": row["cache"], "memory_at_start": start,
            "memory_before_sweep": row["server_before_sweep"], "memory_at_end": row["server"],
            "evicted_tokens": sum(s["cache_evicted_tokens"] or 0 for s in steps),
            "bounded": all(within) if within else None, "steps": steps}


def ratios(engines: dict[str, dict], shapes: list[Shape]) -> None:
    """Each engine's warm single-request p50 against torch without cache's, per workload (in place)."""
    base = engines.get("torch", {}).get("shapes", {})
    for r in engines.values():
        for name, row in r.get("shapes", {}).items():
            ref, mine = (base.get(name) or {}).get("single", {}).get("warm_p50_ms"), row["single"]["warm_p50_ms"]
            row["warm_p50_vs_torch"] = mine / ref if mine is not None and ref else None
            row["mb_per_cached_user"] = (row["cache_bytes_per_token"] * row["tokens_per_user"] / 2**20
                                         if row["cache_bytes_per_token"] is not None else None)


def targets(d: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures, read out of the run."""
    eng, scale = d["engines"], d["qps_scale"]

    def shape(e: str, s: str) -> dict:
        return eng.get(e, {}).get("shapes", {}).get(s) or {}

    def at(e: str, s: str, qps: float) -> float | None:
        step = next((st for st in shape(e, s).get("steps", []) if st["offered_qps"] == qps), None)
        return step["p99_all_ms"] if step else None

    names = [e for e in eng if "shapes" in eng[e]]
    return {"serving_shape": {e: {"single_p50_ms": shape(e, "serving").get("single", {}).get("p50_ms"),
                                  "max_qps_within_slo": shape(e, "serving").get("max_qps_within_slo")} for e in names},
            "warm_rank_4k": {e: {"warm_p50_ms": shape(e, "rank-4k").get("single", {}).get("warm_p50_ms"),
                                 "vs_torch": shape(e, "rank-4k").get("warm_p50_vs_torch")} for e in names},
            "p99_8k": {"qps": 20 * scale, **{e: at(e, "rank-8k", 20 * scale) for e in names}},
            "hit_rate": {e: {s: r.get("hit_rate") for s, r in eng[e]["shapes"].items()} for e in names},
            "small_pool": {e: {"errors": r.get("errors"), "bounded": r.get("bounded")}
                           for e, r in d.get("small_pool", {}).items()}}


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: two workloads, short steps (JSON under --out)")
    ap.add_argument("--engines", default="torch,torch-cache,sglang")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument("--artifact", help="an artifact whose model takes 8,192 tokens (default: built under --out)")
    ap.add_argument("--out", default="runs/benchmarks/serving_cache")
    ap.add_argument("--users", type=int, default=200, help="users in the population of each workload")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per offered-QPS step")
    ap.add_argument("--qps-scale", type=float, default=1.0, help="multiply every workload's QPS steps (a GPU: 10)")
    ap.add_argument("--single", type=int, default=24, help="single requests per workload")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up calls per workload (and per sweep)")
    ap.add_argument("--timeout-s", type=float, default=1.0, help="per-call deadline of the sweeps")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--device", help="serve.device (default: the server's)")
    ap.add_argument("--window-block", type=int, default=0, help="serve.cache.window_block (0: the server's)")
    ap.add_argument("--kv-cache-mb", type=float, help="the torch cache's budget (default: sized for the active users)")
    ap.add_argument("--pool-tokens", type=int, help="SGLang's pool (default: sized for the active users)")
    ap.add_argument("--sender", choices=("auto", "native", "python"), default="auto",
                    help="who sends the sweeps' load (genrec loadtest --sender); auto: native where it builds")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.single = min(args.duration, 3.0), min(args.single, 12)
    return args


def main() -> None:
    from genrec.loadtest.report import plot
    from genrec.loadtest.workload import catalogue_ids

    args = arguments()
    args.sender, why = choose(args.sender)
    print(f"sender: {args.sender}" + (f" ({why})" if why else ""), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    art = Path(args.artifact) if args.artifact else build(out)
    items = catalogue_ids(art)
    wanted = args.shapes.split(",")
    shapes = [s for s in SHAPES if s.name in wanted and (not args.quick or s.name in QUICK)]
    streams = {s.name: workloads(s, items, args) for s in shapes}
    plans = {s.name: plan(s, streams[s.name], args) for s in shapes}
    per_token, keys = kv_bytes_per_token(art), cache_keys()
    full = sizes(plans, per_token)
    small_shape = next((s for s in shapes if s.name == SMALL_SHAPE), shapes[-1])
    small = sizes(plans, per_token, SMALL_POOL, small_shape.name)
    full.update({k: v for k, v in (("kv_cache_mb", args.kv_cache_mb), ("pool_tokens", args.pool_tokens)) if v})
    engines: dict[str, dict] = {}
    small_runs: dict[str, dict] = {}
    sweeps: dict[str, dict] = collections.defaultdict(dict)
    for name in args.engines.split(","):
        key = ENGINES[name][1]
        server_args = engine_args(name, keys, full.get(key) if key else None, args)
        if isinstance(server_args, str):
            engines[name] = {"skipped": server_args}
            continue
        try:
            variant, flags = MODELS.get(name, ("", []))
            model_art = build(out, variant=variant, flags=tuple(flags)) if variant else art
            engines[name], res = run_engine(name, server_args, shapes, items, model_art, args)
            if variant:
                engines[name]["artifact"] = shown_path(model_art)
        except RuntimeError as e:  # a server that would not start: the others still run
            engines[name] = {"failed": str(e)[-2000:]}
            continue
        for s, r in res.items():
            sweeps[s][name] = r
            engines[name]["shapes"][s]["tokens_per_user"] = plans[s]["load_tokens_per_user"]
        if key and key in keys and not (args.quick and ENGINES[name][0] == "sglang"):  # (quick: one SGLang start)
            try:
                small_runs[name] = small_pool(name, engine_args(name, keys, small[key], args), small_shape, items,
                                              model_art, args, f"{key} = {small[key]:g}",
                                              engines[name]["shapes"].get(small_shape.name, {}))
            except RuntimeError as e:
                small_runs[name] = {"failed": str(e)[-2000:]}
    ratios(engines, shapes)
    for s, by_engine in sweeps.items():
        plot(by_engine, out / f"latency-{s}.png", SLO_MS)
    payload = {"date": today(), "machine": machine(), "command": "python -m genrec.benchmarks.serving_cache "
               + " ".join(sys.argv[1:]), "artifact": str(art), "slo_p99_ms": SLO_MS, "quick": args.quick,
               "step_seconds": args.duration, "qps_scale": args.qps_scale, "server_threads": args.server_threads,
               "sender": args.sender,
               "workload": {"users": args.users, "zipf": args.zipf, "calls_per_view": [3, 5], "appended": [1, 5],
                            "candidates": [100, 500], "single_candidates": SINGLE_CANDIDATES, "seed": args.seed,
                            "serving_shape": {"history": 200, "retrieve_k": 100, "top_k": 10}},
               "shapes": {s.name: {"method": s.method, "history": s.history, "qps": steps_of(s, args)} for s in shapes},
               "sizing": {"active": plans, "kv_bytes_per_token": per_token, "full": full, "small": small,
                          "small_fraction": SMALL_POOL, "serve_cache_keys": sorted(keys)},
               "engines": engines, "small_pool": small_runs}
    payload["targets"] = targets(payload)
    payload["seconds"] = round(time.perf_counter() - t0, 1)
    if args.quick:
        path = out / "serving_cache-quick.json"
        path.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        path = write_json("serving_cache", payload)
        update_results_md()
    print("\n".join(serving_cache(payload)))
    print(f"\n{payload['seconds']:.0f} s; {path}")


# ----- RESULTS.md (benchmarks/report.py calls these) --------------------------------------------
def _steps(row: dict) -> str:
    from genrec.benchmarks.report import num

    return ", ".join(f"{num(s['offered_qps'], 'g')}: {num(s['p50_ms'], '.1f')} / {num(s['p99_all_ms'], '.1f')}"
                     for s in row.get("steps", [])) or "-"


def _codes(errors: dict | None) -> str:
    """" (RESOURCE_EXHAUSTED 3, ...)" from {code: count}; "" for none."""
    return f" ({', '.join(f'{k} {v}' for k, v in errors.items())})" if errors else ""


def serving_cache(d: dict) -> list[str]:
    from genrec.benchmarks.report import command, footer, get, num, table

    slo = num(d.get("slo_p99_ms"), "g")
    rows = []
    for shape in d.get("shapes", {}):
        for eng, r in d.get("engines", {}).items():
            row = get(r, f"shapes.{shape}")
            if row is None:
                rows.append([shape, eng, *(["-"] * 6), r.get("skipped") or r.get("failed", "-")[:80]])
                continue
            rows.append([shape, eng, num(get(row, "single.p50_ms"), ".1f"),
                         f"{num(get(row, 'single.warm_p50_ms'), '.1f')} ({num(row.get('warm_p50_vs_torch'), '.2f', 'x')})",
                         _steps(row), num(row.get("max_qps_within_slo"), "g"), num(row.get("hit_rate"), ".3f"),
                         num(row.get("mb_per_cached_user"), ".2f"), ""])
    small = [[eng, r.get("shape", "-"), r.get("pool", "-"), num(r.get("offered_qps"), "g"), num(r.get("calls"), "d"),
              f"{num(r.get('errors'), 'd')}{_codes(r.get('errors_by_code'))}",
              _codes(r.get("full_pool_errors_at_qps")).strip(" ()") or "0", num(r.get("hit_rate"), ".3f"),
              num(get(r, "cache.bytes") / 2**20 if get(r, "cache.bytes") is not None else None, ".1f"),
              f"{num(get(r, 'memory_before_sweep.rss_mb'), '.0f')} -> {num(get(r, 'memory_at_end.rss_mb'), '.0f')}",
              {True: "yes", False: "no", None: "missing"}[r.get("bounded")]]
             for eng, r in d.get("small_pool", {}).items() if "failed" not in r]
    w = d.get("workload", {})
    out = ["## Serving with per-user caches (repeated users, histories of 200 to 8,000 events)", "",
           "Anchor: issue 32's targets, measured side by side in one run: SGLang at the serving shape (history 200, "
           f"retrieve 100, rank 100): single-request p50 and max QPS within p99 {slo} ms; warm Rank of "
           f"{num(w.get('single_candidates'), 'd')} candidates at 4,000 events: p50 against torch without cache; "
           "8,000 events: p99 at 20 QPS; the hit rate with the pool sized for the active users; no errors and "
           "bounded memory with a pool too small.", "",
           f"Workload: {num(w.get('users'), 'd')} users per workload, Zipf {num(w.get('zipf'), 'g')}, "
           f"{'-'.join(map(str, w.get('calls_per_view', [])))} calls per page view with one history, "
           f"{'-'.join(map(str, w.get('appended', [])))} events appended between a user's views; Rank of "
           f"{'-'.join(map(str, w.get('candidates', [])))} given candidates (single requests: "
           f"{num(w.get('single_candidates'), 'd')}). Warm: the calls of a page view after its first. Hit rate: "
           "cached / history tokens over the sweep (the server's counters), the caching engines primed with one "
           "call per user the sweep visits (so a miss is a new event or an eviction, not a user never seen). "
           "MB per cached user: the cache's bytes "
           "per token times the workload's mean history.", "",
           *table(["workload", "engine", "single p50 ms", "warm p50 ms (x torch)",
                   "p50 / p99 ms by offered QPS (failures: inf)", f"max QPS, p99 <= {slo} ms", "hit rate",
                   "MB per cached user", "note"], rows)]
    if small:
        out += ["", f"Pool too small ({num(get(d, 'sizing.small_fraction'), 'g')} of the active users' tokens):", "",
                *table(["engine", "workload", "pool", "offered QPS", "calls", "errors", "errors with the full pool",
                        "hit rate", "cache MB", "server RSS MB over the sweep", "used <= capacity"], small)]
    out += ["", "What limits these figures, with the profile of one SGLang call (about 7 ms of SGLang's request "
            "path per call on this CPU, beside a 3-5 ms forward): benchmarks/notes/2026-12-03-sglang-stateful.md."]
    return out + footer(d, command(d, "python -m genrec.benchmarks.serving_cache"))


def serving_cache_summary(d: dict) -> tuple[str, str]:
    from genrec.benchmarks.report import get, num

    t = d.get("targets", {})
    return (f"SGLang warm Rank at 4k events {num(get(t, 'warm_rank_4k.sglang.vs_torch'), '.2f', 'x')} torch's p50; "
            f"serving shape {num(get(t, 'serving_shape.sglang.max_qps_within_slo'), 'g')} QPS; hit rate at 4k "
            f"{num(get(t, 'hit_rate.sglang.rank-4k'), '.2f')}",
            f"<= 0.35x torch without cache; >= 100 QPS within p99 {num(d.get('slo_p99_ms'), 'g')} ms; "
            "hit rate >= 0.95")


if __name__ == "__main__":
    main()
