"""Engine capacity: what the batched PyTorch engine alone allows, apart from the server.

The serving benchmark measures the whole path (gRPC front-end, engine process, load
generator, all on 2 cores) and its figure swings with the host. This one isolates the
engine, in one process on one core with one thread, on the serving benchmark's artifact and
requests (ML-1M HSTU; history up to 200, retrieve 100, rank 100, return 10):

1. S(B): the engine's time for a batch of B requests (``TorchEngine.run``, the median of
   several batches of distinct random requests), for B from 1 to 16, and its linear fit
   S(B) = fixed + per_request * B; for the engine's default path (the packed path with the
   tower's native backend, ``kernels.hstu_native``) and, side by side on the same batches in
   alternation, the packed path with the tower in PyTorch (``TorchEngine(native=False)``,
   reported as "padded", its old name) and the model's batch path (``TorchEngine(packed=False)``);
2. the open-loop latency the engine alone (the default path) would give: Poisson arrivals at each offered QPS,
   continuous batching (whatever queued while a batch ran forms the next, up to 32, as the
   server's ``--max-wait-ms 0``), each batch taking the measured S(B) (interpolated), p50 and
   p99 from the arrival times; hence the highest QPS within the p99 budget and how much
   faster the engine would have to be to meet the goal;
3. the machine's fp32 matmul peak in the same run, so runs on different days compare.

This is an optimistic bound on the served figure, not a replacement: every batch takes its
median time (the spread of real batches adds to the p99), and the served p99 also adds
decode, IPC between front-end and engine, encode and the load generator's share of the CPUs.

    python -m genrec.benchmarks.engine_capacity [--artifact DIR] [--qps 50,100,...] [--goal-qps 300]
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from genrec.benchmarks import report
from genrec.benchmarks.common import machine, today, update_results_md, write_json
from genrec.benchmarks.serving import artifact_and_requests, peak_gflops, serving_arguments

BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_BATCH = 32  # the server's --max-batch in the serving benchmark


def batch_times(engines: dict, works: list, reps: int, seed: int = 0) -> dict[str, dict[int, float]]:
    """Median ms of each engine's ``run`` on B distinct random requests, for each B in
    BATCHES: {engine name: {B: ms}}. The engines take the same batches in alternation."""
    rng = np.random.default_rng(seed)
    for e in engines.values():  # warm-up
        for _ in range(3):
            e.run([works[0]])
    out: dict[str, dict[int, float]] = {name: {} for name in engines}
    for b in BATCHES:
        xs: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(reps):
            batch = [works[i] for i in rng.choice(len(works), b, replace=False)]
            for name, e in engines.items():
                t0 = time.perf_counter()
                e.run(batch)
                xs[name].append((time.perf_counter() - t0) * 1e3)
        for name in engines:
            out[name][b] = float(np.median(xs[name]))
    return out


def linear_fit(times: dict[int, float]) -> tuple[float, float]:
    """(fixed, per_request) ms of the least-squares line S(B) = fixed + per_request * B."""
    per_request, fixed = np.polyfit(np.array(list(times)), np.array(list(times.values())), 1)
    return float(fixed), float(per_request)


def simulate(service_ms, qps: float, n: int = 50_000, max_batch: int = MAX_BATCH, seed: int = 0) -> tuple[float, float]:  # noqa: ANN001
    """(p50, p99) ms from arrival to completion: Poisson arrivals at ``qps``, one engine
    taking whatever has queued (up to ``max_batch``) as soon as it is free, a batch of B
    taking ``service_ms(B)``. The first 1000 requests warm the queue up and are not counted."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1000.0 / qps, n))
    lat = np.empty(n)
    t, i = 0.0, 0
    while i < n:
        t = max(t, arrivals[i])
        j = min(int(np.searchsorted(arrivals, t, side="right")), i + max_batch)
        t += service_ms(j - i)
        lat[i:j] = t - arrivals[i:j]
        i = j
    return float(np.percentile(lat[1000:], 50)), float(np.percentile(lat[1000:], 99))


def main() -> None:
    ap = serving_arguments(__doc__)
    ap.add_argument("--qps", default="25,50,100,150,200,250,300,400")
    ap.add_argument("--goal-qps", type=float, default=300.0)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    from genrec.serve.engine import TorchEngine
    from genrec.serve.requests import Limits, decode

    artifact, payloads = artifact_and_requests(Path(args.out), args.artifact)
    torch.set_num_threads(1)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})  # one core, as the served engine process
    peak = peak_gflops(1)
    engines = {"default": TorchEngine(artifact), "padded": TorchEngine(artifact, native=False),
               "jagged": TorchEngine(artifact, packed=False)}
    if engines["default"].packed is None:
        raise SystemExit("this artifact's model does not take the packed path (serve.packed.packed_supports)")
    works = [decode("recommend", p, engines["default"].schema, Limits()) for p in payloads[:500]]
    gc.collect()
    gc.freeze()  # as the server does once loaded
    both = batch_times(engines, works, args.reps)
    times = both["default"]
    bs, ms = np.array(list(times)), np.array(list(times.values()))
    fixed, per_request = linear_fit(times)

    # S(B) for every batch the simulation can form, once: measured points interpolated, the fit's
    # slope beyond the largest measured batch
    sizes = np.arange(MAX_BATCH + 1)
    table = np.where(sizes <= bs[-1], np.interp(sizes, bs, ms), ms[-1] + per_request * (sizes - bs[-1]))

    def service(scale: float):  # noqa: ANN202
        return lambda b: scale * float(table[b])

    steps = []
    for q in (float(x) for x in args.qps.split(",")):
        p50, p99 = simulate(service(1.0), q)
        steps.append({"offered_qps": q, "p50_ms": p50, "p99_ms": p99})
    ok = [s["offered_qps"] for s in steps if s["p99_ms"] <= args.slo_p99_ms]
    # the largest engine cost (a factor on every S(B)) that meets the goal, in steps of 0.05
    scale = next((f for f in np.arange(1.0, 0.0, -0.05) if simulate(service(f), args.goal_qps)[1] <= args.slo_p99_ms), None)
    payload = {"date": today(), "machine": machine(), "command": " ".join(["python -m genrec.benchmarks.engine_capacity", *sys.argv[1:]]),
               "artifact": str(artifact), "cpu": cpu, "peak_gflops": peak, "default_path": engines["default"].path,
               "batch_ms": {str(k): v for k, v in times.items()}, "fit": {"fixed_ms": fixed, "per_request_ms": per_request},
               **{f"{alt}_batch_ms": {str(k): v for k, v in both[alt].items()} for alt in ("padded", "jagged")},
               **{f"{alt}_fit": dict(zip(("fixed_ms", "per_request_ms"), linear_fit(both[alt]))) for alt in ("padded", "jagged")},
               "slo_p99_ms": args.slo_p99_ms, "steps": steps, "max_qps_within_slo": max(ok) if ok else 0,
               "goal_qps": args.goal_qps, "cost_factor_for_goal": None if scale is None else round(float(scale), 2)}
    write_json("engine_capacity", payload)
    update_results_md()
    print("\n".join(report.renderer("engine_capacity")(payload)))


if __name__ == "__main__":
    main()
