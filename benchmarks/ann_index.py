"""ANN index cost curves: recall@100 against exact search, latency, build time and memory at
10^5, 10^6 and 10^7 items (quant/ann.py's index, the re-score serving runs).

    python -m genrec.benchmarks.ann_index [--sizes 100000,1000000,10000000] [--threads 1]

Item vectors: synthetic, shaped like a trained catalogue's (``--topics`` topic directions, each
item its topic's direction plus noise, L2-normalised, D = 64: the served dimension of
configs/demo.toml); users: a mix of two topics plus noise. Two disjoint query sets: the
*validation* queries choose the index (factory and nprobe: the smallest nprobe reaching
``--target`` recall@100 of the re-scored shortlist, the cheapest such factory), the *held-out*
queries measure what is reported. Candidates: IVF with 4-bit fast-scan PQ (D/2 bytes... x4fs),
IVF with 8-bit scalar quantization, and HNSW over full vectors (the memory reference; at the
two smaller sizes only: it stores more bytes than the table). Single-query latency (one user
per call, ``--threads`` threads) of the index search plus the exact re-score, beside exact
search (one GEMM over all items + top-k) in the same process; median of ``--reps`` passes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import time
from typing import Any

import numpy as np
import torch

from genrec.benchmarks.common import RESULTS, machine, today, write_json
from genrec.quant.ann import (
    IndexConfig,
    ann_top,
    auto_factory,
    build_index,
    calibrate,
    exact_top,
    recall,
    set_nprobe,
)

K = 100


def catalogue(n: int, dim: int, topics: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(item vectors [n, dim] float32, normalised; topic directions [topics, dim])."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(topics, dim, generator=g), dim=1)
    out = torch.empty(n, dim)
    for i in range(0, n, 1 << 20):
        m = min(1 << 20, n - i)
        t = torch.randint(0, topics, (m,), generator=g)
        out[i : i + m] = torch.nn.functional.normalize(centres[t] + noise * torch.randn(m, dim, generator=g) / math.sqrt(dim), dim=1)
    return out.numpy(), centres.numpy()


def users(centres: np.ndarray, q: int, noise: float, seed: int) -> np.ndarray:
    """[q, dim] normalised: two topics mixed plus noise."""
    g = torch.Generator().manual_seed(seed)
    c = torch.from_numpy(centres)
    a, b = torch.randint(0, c.shape[0], (q,), generator=g), torch.randint(0, c.shape[0], (q,), generator=g)
    w = torch.rand(q, 1, generator=g)
    u = w * c[a] + (1 - w) * c[b] + noise * torch.randn(q, c.shape[1], generator=g) / math.sqrt(c.shape[1])
    return torch.nn.functional.normalize(u, dim=1).numpy()


def factories(n: int, dim: int, hnsw_max: int, others_max: int) -> list[str]:
    """The default (quant.ann.auto_factory); up to ``others_max`` items IVF-SQ8 beside it, up to
    ``hnsw_max`` HNSW too (each costs another build: at 10^7 items tens of minutes here)."""
    ivf = auto_factory(n, dim)
    nlist = ivf.split(",")[0]
    out = [ivf] + ([f"{nlist},SQ8"] if n <= others_max else [])
    if n <= hnsw_max:
        out.append("HNSW32,Flat")
    return out


def index_bytes(index: Any) -> int:
    import faiss

    return int(faiss.serialize_index(index).size)


def time_single(fn: Any, queries: np.ndarray, reps: int) -> dict[str, float]:
    """Per-query latency (ms) of fn(query [1, D]) over every query, median over ``reps`` passes of
    each query's p50 / p99."""
    p50, p99 = [], []
    for _ in range(reps):
        ms = []
        for i in range(queries.shape[0]):
            t = time.perf_counter()
            fn(queries[i : i + 1])
            ms.append((time.perf_counter() - t) * 1e3)
        p50.append(float(np.percentile(ms, 50)))
        p99.append(float(np.percentile(ms, 99)))
    return {"p50_ms": round(float(np.median(p50)), 3), "p99_ms": round(float(np.median(p99)), 3)}


def exact_latency(vectors: np.ndarray, queries: np.ndarray, reps: int) -> dict[str, float]:
    """Exact search's single-query latency: one GEMM against the table laid out [D, N] (as
    serve.catalogue keeps it) and the top-k."""
    table_t = torch.from_numpy(vectors).t().contiguous()
    return time_single(lambda q: torch.topk(torch.from_numpy(q) @ table_t, K, dim=1), queries, reps)


def choose_nprobe(index: Any, vectors: np.ndarray, valid: np.ndarray, truth: np.ndarray,
                  target: float, shortlist: int) -> tuple[int, dict[str, float]]:
    """The smallest nprobe (IVF) / efSearch (HNSW) reaching ``target`` on the validation queries."""
    import faiss

    ladder = (16, 32, 64, 128, 256, 512) if "HNSW" in type(index).__name__ else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    if "IVF" in type(index).__name__:
        ladder = tuple(p for p in ladder if p <= faiss.extract_index_ivf(index).nlist)
    tried: dict[str, float] = {}
    for p in ladder:
        set_nprobe(index, p)
        tried[str(p)] = round(recall(ann_top(index, vectors, valid, K, shortlist), truth), 4)
        if tried[str(p)] >= target:
            return p, tried
    return ladder[-1], tried


def one_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    import faiss

    vectors, centres = catalogue(n, args.dim, args.topics, args.noise, args.seed)
    valid, held = (users(centres, args.queries, args.noise, args.seed + s) for s in (1, 2))
    truth_v, truth_h = exact_top(vectors, valid, K), exact_top(vectors, held, K)
    row: dict[str, Any] = {"items": n, "table_bytes": n * args.dim * 4,
                           "exact": exact_latency(vectors, held[: args.timed], args.reps), "indexes": {}}
    for f in factories(n, args.dim, args.hnsw_max, args.others_max):
        faiss.omp_set_num_threads(args.build_threads)
        t0 = time.perf_counter()
        index = build_index(vectors, f, seed=args.seed)
        build_s = time.perf_counter() - t0
        faiss.omp_set_num_threads(args.threads)
        if "IVF" in f:  # nprobe and shortlist as genrec quantize chooses them (quant.ann.calibrate)
            nprobe, shortlist, walk = calibrate(index, vectors, valid, IndexConfig(shortlist=args.shortlist,
                                                                                  target=args.target, k=K))
            tried = walk[str(shortlist)]
        else:
            shortlist = args.shortlist
            nprobe, tried = choose_nprobe(index, vectors, valid, truth_v, args.target, shortlist)
        set_nprobe(index, nprobe)
        rec = recall(ann_top(index, vectors, held, K, shortlist), truth_h)
        lat = time_single(lambda q, ix=index, s=shortlist: ann_top(ix, vectors, q, K, s), held[: args.timed], args.reps)
        size = index_bytes(index)
        row["indexes"][f] = {"build_s": round(build_s, 1), "bytes": size, "x_table": round(size / row["table_bytes"], 4),
                             "nprobe": nprobe, "shortlist": shortlist, "valid_recall_by_nprobe": tried,
                             "recall_at_100": round(rec, 4), **lat}
        print(n, f, row["indexes"][f], flush=True)
        del index
        gc.collect()
    ok = {f: r for f, r in row["indexes"].items() if r["recall_at_100"] >= 0 and r["x_table"] <= 0.3
          and r["valid_recall_by_nprobe"][str(r["nprobe"])] >= args.target}
    row["chosen"] = min(ok, key=lambda f: ok[f]["p50_ms"]) if ok else None  # on validation recall + memory, then speed
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return row


def projection(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """10^8 and 10^9 items from the log-log slopes of the chosen index's latency, build time and
    bytes between the two largest measured sizes (a straight line on paper, not a measurement)."""
    pts = [(r["items"], r["indexes"][r["chosen"]]) for r in rows if r.get("chosen")]
    if len(pts) < 2:
        return {}
    (n0, a), (n1, b) = pts[-2], pts[-1]
    out: dict[str, Any] = {"from": [n0, n1], "slopes": {}}
    for key in ("p50_ms", "build_s", "bytes"):
        out["slopes"][key] = round(math.log(b[key] / a[key]) / math.log(n1 / n0), 3)
    for n in (10**8, 10**9):
        out[str(n)] = {key: round(b[key] * (n / n1) ** out["slopes"][key], 1) for key in ("p50_ms", "build_s", "bytes")}
        out[str(n)]["table_bytes"] = n * 64 * 4
    return out


def ann_index(d: dict) -> list[str]:
    """The DETAILS.md section of ``results/ann_index.json``."""
    from genrec.benchmarks.report import command, footer, num, table

    v = d.get("vectors") or {}
    rows = []
    for r in d.get("sizes") or []:
        ex = r.get("exact") or {}
        rows.append([num(r.get("items"), ",d"), "exact (GEMM + top-k)", "1.0000", num(ex.get("p50_ms"), ".2f"),
                     num(ex.get("p99_ms"), ".1f"), "", num(r.get("table_bytes", 0) / 1e6, ".0f"), "1.000", ""])
        for f, x in (r.get("indexes") or {}).items():
            mark = " (chosen)" if f == r.get("chosen") else ""
            sl = f" shortlist {x['shortlist']}" if x.get("shortlist") else ""
            rows.append([num(r.get("items"), ",d"), f"`{f}` nprobe {x.get('nprobe')}{sl}{mark}", num(x.get("recall_at_100")),
                         num(x.get("p50_ms"), ".2f"), num(x.get("p99_ms"), ".1f"), num(x.get("build_s"), ".1f"),
                         num(x.get("bytes", 0) / 1e6, ".1f"), num(x.get("x_table"), ".3f"),
                         num(r.get("peak_rss_mb"), "d")])
    out = ["## ANN index cost curves (dense retrieval, 10^5 to 10^7 items)", "",
           "Anchor: exact search over every item (recall 1 by definition); targets recall@100 >= 0.95 of exact, "
           "index <= 0.3x the fp32 table. Synthetic item vectors (D = "
           f"{v.get('dim')}, {v.get('topics')} topics, noise {v.get('noise')}), users a mix of two topics; nprobe and the "
           "index chosen on validation queries, recall and latency on held-out ones; the index's shortlist "
           f"(from {d.get('shortlist')}, longer where the codes need it: quant.ann.calibrate) re-scored exactly (what "
           f"serving runs). One query per call, {d.get('threads')} "
           "thread(s), median of passes; the 2-core machine was shared with other work (p99 is its noise).", "",
           *table(["items", "search", "recall@100", "p50 ms", "p99 ms", "build s", "MB", "x table", "peak RSS MB"], rows)]
    pr = d.get("projection") or {}
    if pr:
        sl = pr.get("slopes") or {}
        out += ["", f"On paper, from the log-log slopes of the chosen index between {num(pr['from'][0], ',d')} and "
                f"{num(pr['from'][1], ',d')} items (latency {num(sl.get('p50_ms'), '.2f')}, build "
                f"{num(sl.get('build_s'), '.2f')}, bytes {num(sl.get('bytes'), '.2f')}):", ""]
        out += table(["items", "p50 ms", "build s", "index GB", "fp32 table GB"],
                     [[f"10^{len(n) - 1}", num(pr[n].get("p50_ms"), ".1f"), num(pr[n].get("build_s"), ".0f"),
                       num(pr[n].get("bytes", 0) / 1e9, ".1f"), num(pr[n].get("table_bytes", 0) / 1e9, ".0f")]
                      for n in ("100000000", "1000000000") if n in pr])
    return out + footer(d, command(d, "python -m genrec.benchmarks.ann_index"))


def ann_index_summary(d: dict) -> tuple[str, str]:
    """(headline, anchor): the chosen index at the largest size measured."""
    from genrec.benchmarks.report import num

    r = (d.get("sizes") or [{}])[-1]
    ix = r.get("indexes") or {}
    x = ix.get(r.get("chosen") or "") or next(iter(ix.values()), {})  # none chosen: the default index
    return (f"{num(r.get('items'), ',d')} items: recall@100 {num(x.get('recall_at_100'), '.3f')}, "
            f"p50 {num(x.get('p50_ms'), '.2f')} ms vs exact {num((r.get('exact') or {}).get('p50_ms'), '.1f')} ms, "
            f"{num(x.get('x_table'), '.2f')}x table", "exact search")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000,10000000")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=500, help="validation and held-out queries (each)")
    ap.add_argument("--timed", type=int, default=200, help="held-out queries timed one at a time")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.97, help="validation recall@100 that nprobe is chosen for")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.75,
                    help="norm of an item's (and a user's) noise beside its topic direction's 1")
    ap.add_argument("--shortlist", type=int, default=1000, help="candidates per query re-scored exactly")
    ap.add_argument("--hnsw-max", type=int, default=100_000, help="largest catalogue HNSW is built for (slow)")
    ap.add_argument("--others-max", type=int, default=1_000_000, help="largest catalogue IVF-SQ8 is built for")
    ap.add_argument("--build-threads", type=int, default=2, help="faiss threads while building (timing: --threads)")
    ap.add_argument("--merge", action="store_true", help="keep the other sizes of results/ann_index.json")
    args = ap.parse_args()
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    if args.merge:  # the sizes a former run measured and this one does not
        rows = [r for r in json.loads((RESULTS / "ann_index.json").read_text())["sizes"]
                if str(r["items"]) not in args.sizes.split(",")]
    for n in args.sizes.split(","):  # written after each size: a long run leaves what it measured
        rows.append(one_size(int(n), args))
        rows.sort(key=lambda r: r["items"])
        write(rows, args, faiss.__version__)


def write(rows: list[dict[str, Any]], args: argparse.Namespace, version: str) -> None:
    write_json("ann_index", {"date": today(), "machine": machine(), "faiss": version,
                             "shared_machine": True, "k": K, "shortlist": args.shortlist, "target": args.target,
                             "queries": {"validation": args.queries, "held_out": args.queries, "timed": args.timed},
                             "vectors": {"dim": args.dim, "topics": args.topics, "noise": args.noise, "kind": "synthetic topic mixture"},
                             "threads": args.threads, "build_threads": args.build_threads, "sizes": rows,
                             "projection": projection(rows)})


if __name__ == "__main__":
    main()
