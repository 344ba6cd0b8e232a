"""Ranking against a cached history (issue 44): 2,000 candidates over 4,096 cached events, one
core, against the shape's FLOP floor on this machine.

    python -m genrec.benchmarks.ranking_cached [--artifact DIR] [--reps 20] [--quick]

The engine alone (``TorchEngine.run`` on one decoded Rank request with a ``user_id``), one
process pinned to one CPU with one torch thread, the artifact of ``benchmarks.ranking_serving``
(synthetic ads model, 4,096-event window, int8 tables). Every engine keeps a K/V cache and has
seen each user once before the timed rounds, so a timed call finds its history encoded and
does the candidates' work only (checked: each timed call is a cache hit). Variants, each on
the same request in a shuffled order per round:

* ``torch-coded``: the candidates' attention as before issue 44 (the coded backend, one
  [B, Cmax, L] block per call);
* ``torch``: ``kernels.hstu_candidates`` in fp32 (the default now);
* ``torch-bf16``: the same in bf16 (``TorchEngine(candidate_precision="bf16")``);
* ``native`` / ``native-bf16``: the C++ backend's history and scoring, and its history with
  the bf16 scorer.

The floor: the candidates' useful FLOPs (``ranking_serving.useful_flops``: tower and ranking
head) over this core's measured GEMM peak (a 2,048-square matmul, fp32 and bf16, the better of
a measurement before and after the rounds); each p50 as a multiple of the floor of its own
precision and of the fastest precision's. Also the bf16 scorer's probabilities against fp32's
on the same requests (largest difference, share of the fp32 top 100 by eCPM kept).

The result is merged into ``results/ranking_serving.json`` under ``cached`` (rendered in that
section of DETAILS.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = ((1024, 2000), (4096, 500), (4096, 2000))
VARIANTS = ("torch-coded", "torch", "torch-bf16", "native", "native-bf16")
KV_MB = 512.0


def gemm_peak(dtype: Any, n: int = 2048, reps: int = 6) -> float:
    """GFLOP/s of an n x n x n matmul in ``dtype`` on the current torch threads (best of reps)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def engines(artifact: Path) -> dict[str, Any]:
    """The variants' engines, each with a K/V cache."""
    from genrec.serve.engine import TorchEngine

    out = {"torch-coded": TorchEngine(artifact, native=False, kv_cache_mb=KV_MB)}
    for layer in out["torch-coded"].model.tower.layers:  # the attention before the blocked scorer
        layer.cfg = replace(layer.cfg, attention_backend="coded")
    out["torch"] = TorchEngine(artifact, native=False, kv_cache_mb=KV_MB)
    out["torch-bf16"] = TorchEngine(artifact, native=False, kv_cache_mb=KV_MB, candidate_precision="bf16")
    native = TorchEngine(artifact, kv_cache_mb=KV_MB)
    if native.path == "native":
        out["native"] = native
        out["native-bf16"] = TorchEngine(artifact, kv_cache_mb=KV_MB, candidate_precision="bf16")
    return out


def requests(engine: Any, users: int, seed: int = 0) -> dict[tuple[int, int], list[Any]]:
    """``users`` decoded Rank works per shape, each with its own ``user_id``."""
    from genrec.benchmarks.ranking_serving import rank_request
    from genrec.proto.v1 import recommender_pb2 as pb
    from genrec.serve.requests import Limits, decode

    emb = engine.schema.embedding
    context = {f: emb.table_of(f).num_embeddings for f in emb.pooled_features}
    rng = np.random.default_rng(seed)
    out = {}
    for h, c in SHAPES:
        works = []
        for u in range(users):
            req = pb.RankRequest.FromString(rank_request(rng, engine.corpus_np, context, h, c))
            req.user.user_id = f"u{h}-{c}-{u}"
            works.append(decode("rank", req.SerializeToString(), engine.schema, Limits(max_candidates=c)))
        out[(h, c)] = works
    return out


def sweep(engs: dict[str, Any], loads: dict[tuple[int, int], list[Any]], reps: int, seed: int = 0) -> tuple[dict, dict]:
    """Interleaved rounds after one untimed call per (engine, user): ({(variant, h, c): ms [...]},
    {(variant, h, c): {stage: ms [...]}})."""
    for e in engs.values():
        for works in loads.values():
            for w in works:
                e.run([w])
    rng = random.Random(seed)
    names, shapes = list(engs), list(loads)
    runs: dict[tuple, list[float]] = {(n, *s): [] for n in names for s in shapes}
    stages: dict[tuple, dict[str, list[float]]] = {(n, *s): {} for n in names for s in shapes}
    for r in range(reps):
        rng.shuffle(shapes)
        for s in shapes:
            work = loads[s][r % len(loads[s])]
            rng.shuffle(names)
            for n in names:
                hits, before = engs[n].cache.stats()["hits"], dict(engs[n].stages)
                t0 = time.perf_counter()
                engs[n].run([work])
                runs[(n, *s)].append((time.perf_counter() - t0) * 1e3)
                for k, v in engs[n].stages.items():
                    stages[(n, *s)].setdefault(k, []).append((v - before.get(k, 0.0)) * 1e3)
                if engs[n].cache.stats()["hits"] != hits + 1:
                    raise RuntimeError(f"{n}: a timed call missed the K/V cache")
    return runs, stages


def agreement(engs: dict[str, Any], works: list[Any], top: int = 100) -> dict[str, float]:
    """bf16 scorer against fp32 on the same works: max |p difference|, share of fp32's top kept."""
    diff, kept = 0.0, []
    for w in works:
        a, b = engs["torch"].run([w])[0], engs["torch-bf16"].run([w])[0]
        pa, pb_ = (dict(zip(r.item_ids.tolist(), np.stack(list(r.tasks.values()), 1))) for r in (a, b))
        diff = max(diff, max(float(np.abs(pa[i] - pb_[i]).max()) for i in pa))
        kept.append(len(set(a.item_ids[:top].tolist()) & set(b.item_ids[:top].tolist())) / min(top, a.item_ids.size))
    return {"max_abs_prob_diff": diff, "top100_kept": float(np.mean(kept))}


def measure(artifact: Path, reps: int, users: int) -> dict[str, Any]:
    import torch

    from genrec.benchmarks.common import machine, today
    from genrec.benchmarks.ranking_serving import useful_flops

    torch.set_num_threads(1)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    engs = engines(artifact)
    loads = requests(engs["torch"], users)
    gc.collect()
    gc.freeze()
    peaks = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16)}
    load_before, t0 = os.getloadavg(), time.time()
    runs, stages = sweep(engs, loads, reps)
    peaks = {k: max(v, gemm_peak(getattr(torch, "float32" if k == "fp32" else "bfloat16"))) for k, v in peaks.items()}
    model = engs["torch"].model
    rows = []
    for (n, h, c), ms in runs.items():
        f = useful_flops(model, h, c)
        flops = f["candidate_tower"] + f["ranking_head"]
        own = peaks["bf16" if n.endswith("bf16") else "fp32"]
        floor_own, floor_best = flops / own / 1e6, flops / max(peaks.values()) / 1e6
        p50 = float(np.median(ms))
        rows.append({"variant": n, "history": h, "candidates": c, "n": len(ms), "p50_ms": p50,
                     "p99_ms": float(np.percentile(ms, 99)), "us_per_candidate": p50 / c * 1e3,
                     "useful_gflop": flops / 1e9, "floor_ms": floor_own, "floor_best_ms": floor_best,
                     "x_floor": p50 / floor_own, "x_best_floor": p50 / floor_best,
                     "stages_p50_ms": {k: float(np.median(v)) for k, v in stages[(n, h, c)].items()}})
    big = max(SHAPES)
    return {"date": today(), "machine": machine(), "cpu_pinned": cpu, "peak_gflops": peaks,
            "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "sweep_s": time.time() - t0,
            "command": " ".join(["python -m genrec.benchmarks.ranking_cached", *sys.argv[1:]]), "reps": reps,
            "users_per_shape": users, "variants": list(engs), "rows": rows,
            "bf16_vs_fp32": agreement(engs, loads[big])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", help="the ranking_serving artifact (default: built under --out)")
    ap.add_argument("--out", default="runs/benchmarks/ranking_serving")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--users", type=int, default=4, help="distinct users per shape, cycled through the rounds")
    ap.add_argument("--quick", action="store_true", help="3 rounds; JSON under --out only")
    args = ap.parse_args()
    from genrec.benchmarks.common import RESULTS
    from genrec.benchmarks.ranking_serving import NAME, build

    artifact = Path(args.artifact) if args.artifact else build(Path(args.out))
    res = measure(artifact, 3 if args.quick else args.reps, args.users)
    if args.quick:
        Path(args.out, "ranking_cached-quick.json").write_text(json.dumps(res, indent=2) + "\n")
    else:
        path = RESULTS / f"{NAME}.json"
        d = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**d, "cached": res}, indent=2) + "\n")
    print("\n".join(section(res)))


def section(c: dict) -> list[str]:
    """The DETAILS.md lines of ``ranking_serving.json``'s ``cached`` part."""
    from genrec.benchmarks.report import get, num, table

    if not c:
        return []
    rows = [[f"{r['history']:,}", f"{r['candidates']:,}", r["variant"], num(r.get("p50_ms"), ".1f"),
             num(r.get("p99_ms"), ".1f"), num(r.get("us_per_candidate"), ".1f"),
             num(get(r, "stages_p50_ms.candidate_tower"), ".1f"), num(get(r, "stages_p50_ms.ranking_head"), ".1f"),
             num(r.get("floor_ms"), ".1f"),
             num(r.get("x_floor"), ".2f"), num(r.get("x_best_floor"), ".2f")]
            for r in sorted(c.get("rows", []), key=lambda r: (r["history"], r["candidates"], r["variant"]))]
    loads = [x[0] for x in (c.get("load_avg_before"), c.get("load_avg_after")) if x]
    return ["", "### Against a cached history (issue 44)", "",
            f"Each timed call a K/V-cache hit (the candidates' work only), every variant on the same request, "
            f"interleaved, {num(c.get('reps'), 'd')} rounds, one core; load average "
            f"{'-'.join(num(x, '.1f') for x in sorted(loads))} on the shared machine. Floor: the candidates' useful "
            f"FLOPs over this core's GEMM peak, fp32 {num(get(c, 'peak_gflops.fp32'), '.0f')} / bf16 "
            f"{num(get(c, 'peak_gflops.bf16'), '.0f')} GFLOP/s (x floor: p50 over its precision's floor; "
            "x best: over the bf16 floor). `torch-coded` is the path before issue 44.", "",
            *table(["history", "candidates", "variant", "p50 ms", "p99 ms", "µs/cand.", "tower ms", "head ms",
                    "floor ms", "x floor", "x best"], rows), "",
            f"bf16 against fp32 on the same requests: largest probability difference "
            f"{num(get(c, 'bf16_vs_fp32.max_abs_prob_diff'), '.4f')}, fp32's top 100 by eCPM kept "
            f"{num((get(c, 'bf16_vs_fp32.top100_kept') or 0) * 100, '.1f')}%. Date {c.get('date')}; command "
            f"`{c.get('command')}`."]


if __name__ == "__main__":
    main()
