"""Serving a trained 10^7-item catalogue: exact search and the ANN index side by side, one run.

    python -m genrec.benchmarks.scale_serve --artifact runs/scale_10m/artifact-int8 --data runs/data10m

The artifact is ``genrec quantize`` of a configs/scale_10m.toml run (int8 tables, the IVF-PQ
index calibrated on the run's validation users). The requests are real users' latest 200
events (users with at least 200 in the logs; ``Recommend``: retrieve 100, rank the 100,
return 10). Per search (``serve.retrieval.search``), one server, the engine in the front end's
process with one thread, the server pinned to one CPU and this process (the client and the
load generator) to the other:

* single-request latency, closed loop (``--single`` calls; exact search fewer: a call streams
  the whole [D, N] table);
* ``Retrieve`` k = 100 for ``--recall-users`` users, and recall@100 of the ANN server's answers
  against the exact server's;
* the ANN server only: ``genrec loadtest`` steps of offered QPS, each step's p99 counting
  failures (a call past its deadline included) as infinitely slow; the max QPS whose p99 stays
  within ``--slo-p99-ms`` (answers after the budget count as misses: at most 1% may be);
* resident memory of the server, and (in this process, before any server) what each part of
  the served catalogue holds: the int8 rows, the index, the catalogue ids, the exact search's
  [D, N] vectors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from genrec.benchmarks.common import ROOT, machine, shown_path, today, write_json
from genrec.benchmarks.serving import single_request_latency, start_server
from genrec.benchmarks.serving_scale import retrieved, rss_mb, rss_tree_mb
from genrec.proto.v1 import recommender_pb2 as pb

SERVER_CPU, CLIENT_CPU = 0, 1


def workload(data: Path, out: Path, n: int, history: int = 200, seed: int = 0, valid_share: float = 0.02) -> Path:
    """JSONL Recommend requests (genrec.loadtest.workload's format): ``n`` users with at least
    ``history`` events, drawn at random, each with their latest ``history`` events; never a
    validation user (``valid_share``: the run's data.valid_users), whose vectors chose the index's
    nprobe and shortlist at quantize."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from genrec.train.data.reader import holds_valid

    t = pq.read_table(data / "interactions.parquet", columns=["user_id", "item_ids", "timestamps"])
    users = t.column("user_id").to_numpy()
    long = np.flatnonzero((pc.list_value_length(t.column("item_ids")).to_numpy() >= history)
                          & ~np.array([holds_valid(int(u), valid_share) for u in users]))
    rows = np.sort(np.random.default_rng(seed).choice(long, size=min(n, long.size), replace=False))
    sub = t.take(rows)
    with open(out, "w") as f:
        for items, times in zip(sub.column("item_ids").to_pylist(), sub.column("timestamps").to_pylist()):
            ev = [[int(i), int(x), 0] for i, x in zip(items[-history:], times[-history:])]
            f.write(json.dumps({"history": ev, "retrieve_k": 100, "top_k": 10}) + "\n")
    return out


def memory_parts(art: Path) -> dict:
    """Bytes each part of the served catalogue holds, measured in this process: the model's
    table-sized buffers (the int8 rows), the ANN catalogue (its index), the exact catalogue (its
    [D, N] vectors), and the RSS each step added."""
    import gc

    import torch

    from genrec.quant.load import load_model
    from genrec.serve.ann import RetrievalConfig
    from genrec.serve.catalogue import Catalogue

    pid = os.getpid()
    base = rss_mb(pid)
    model, manifest = load_model(art)
    after_model = rss_mb(pid)
    n = int(model.corpus_ids.numel())
    rows = sum(b.untyped_storage().nbytes() for b in  # the int8 rows (uint8 buffers), not the catalogue ids
               {id(b): b for b in model.buffers() if b.shape[0] >= n and b.dtype == torch.uint8}.values())
    ann = Catalogue(model, None, art, manifest, RetrievalConfig(search="ann"))
    after_ann = rss_mb(pid)
    del ann
    gc.collect()
    exact = Catalogue(model, None, art, manifest, RetrievalConfig(search="exact"))
    after_exact = rss_mb(pid)
    vec = exact.vectors_t.untyped_storage().nbytes() if exact.vectors_t is not None else 0
    del exact, model
    gc.collect()
    return {"items": n, "served_rows_bytes": rows, "index_bytes": int(manifest.index.get("bytes", 0)),
            "corpus_ids_bytes": n * 8, "exact_vectors_bytes": vec,
            "rss_mb": {"before": round(base, 1), "model_loaded": round(after_model, 1),
                       "ann_catalogue_added": round(after_ann - after_model, 1),
                       "exact_catalogue_after_ann_freed": round(after_exact, 1)}}


def sweep(target: str, work: Path, out: Path, qps: str, slo_ms: float, duration: float, min_requests: int) -> dict:
    """``genrec loadtest`` (pinned to the client CPU): loadtest.json's steps and max QPS."""
    cmd = [sys.executable, "-m", "genrec.cli", "loadtest", "--target", target, "--qps", qps, "--duration", str(duration),
           "--min-requests", str(min_requests), "--workload", str(work), "--slo-p99-ms", str(slo_ms),
           "--timeout-ms", "1000", "--out", str(out), "--cpus", str(CLIENT_CPU), "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    res = json.loads((out / "loadtest.json").read_text())
    keep = ("offered_qps", "sent", "ok", "achieved_qps", "p50_ms", "p99_ms", "p99_all_ms", "server_p99_ms",
            "compute_p50_ms", "compute_p99_ms", "mean_batch", "cpu_busy_pct", "steal_pct")
    return {"max_qps_within_slo": res["max_qps_within_slo"], "highest_passing_qps": res["highest_passing_qps"],
            "steps": [{k: s.get(k) for k in keep} for s in res["steps"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--data", required=True, help="the dataset the requests' histories come from")
    ap.add_argument("--out", default="runs/scale_serve")
    ap.add_argument("--single", type=int, default=300, help="single requests timed (ANN)")
    ap.add_argument("--single-exact", type=int, default=40, help="single requests timed (exact)")
    ap.add_argument("--recall-users", type=int, default=100)
    ap.add_argument("--qps", default="20,40,60,80,100,120")
    ap.add_argument("--slo-p99-ms", type=float, default=15.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--search", default="exact,ann",
                    help="servers in turn: exact, ann (the artifact's nprobe / shortlist) or ann:NPROBE:SHORTLIST")
    ap.add_argument("--name", default="serving_scale_ann_10m")
    ap.add_argument("--start-timeout", type=float, default=1200)
    args = ap.parse_args()
    load_at_start = os.getloadavg()  # other work on the machine inflates every figure: recorded
    art, out = Path(args.artifact).resolve(), (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = workload(Path(args.data).resolve(), out / "workload.jsonl", max(args.single, args.recall_users))
    from genrec.loadtest.workload import load_workload

    payloads = load_workload(work)
    users = [pb.RecommendRequest.FromString(p).user for p in payloads[: args.recall_users]]
    retrieve = [pb.RetrieveRequest(user=u, k=100).SerializeToString() for u in users]
    parts = memory_parts(art)
    print("memory", json.dumps(parts), flush=True)
    results: dict[str, dict] = {}
    exact_lists = None
    for name in args.search.split(","):
        # "ann:NPROBE:SHORTLIST" overrides the artifact's calibrated pair (serve.retrieval.nprobe / .shortlist)
        search, *pair = name.split(":")
        os.sched_setaffinity(0, {SERVER_CPU})  # the server (and its children) inherit this CPU
        extra = [f'--serve.retrieval.search="{search}"', "--serve.process.standby=false", "--serve.engine_process=false"]
        if pair:
            extra += [f"--serve.retrieval.nprobe={pair[0]}", f"--serve.retrieval.shortlist={pair[1]}"]
        t0 = time.perf_counter()
        proc, target, _ = start_server("torch", art, 1, out / f"profile-{name}.json", extra=extra,
                                       timeout_s=args.start_timeout)
        load_s = time.perf_counter() - t0
        os.sched_setaffinity(0, {CLIENT_CPU})
        try:
            n = args.single if search == "ann" else args.single_exact
            single_request_latency(target, payloads[:5], n=5)  # warm-up
            res: dict = {"load_s": round(load_s, 1), "single": single_request_latency(target, payloads[:n], n=n)}
            print(name, json.dumps(res), flush=True)
            got = retrieved(target, retrieve)
            res["server_rss_mb"] = round(rss_tree_mb(proc.pid), 1)
            if search == "exact":
                exact_lists = got
            elif exact_lists is not None:
                res["recall_at_100_vs_exact"] = round(float(np.mean(
                    [np.intersect1d(a, b).size / max(b.size, 1) for a, b in zip(got, exact_lists)])), 4)
            if search == "ann":
                res["loadtest"] = sweep(target, work, out / f"loadtest-{name.replace(':', '-')}", args.qps,
                                        args.slo_p99_ms, args.duration, args.min_requests)
            results[name] = res
            print(name, json.dumps(res), flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        prof = out / f"profile-{name}.json"  # the engine's stage seconds: where a call's time went
        if prof.exists():
            p = json.loads(prof.read_text())
            results[name]["stages_s"] = {k: round(v, 3) for k, v in p.get("stages_s", {}).items()}
            results[name]["served_calls"] = p.get("served")
    manifest = json.loads((art / "manifest.json").read_text())
    # serving_scale's layout too (its DETAILS.md section renders this file): engine -> latency by history
    engines = {("torch" if s == "exact" else f"torch-{s.replace(':', '-')}"): {
        "latency_by_history": {"200": r["single"]}, "server_rss_mb": r.get("server_rss_mb"),
        **({"recall_at_100_vs_exact": r["recall_at_100_vs_exact"]} if "recall_at_100_vs_exact" in r else {})}
        for s, r in results.items()}
    write_json(args.name, {
        "date": today(), "machine": machine(), "load_avg_at_start": load_at_start, "load_avg": os.getloadavg(),
        "command": "python -m genrec.benchmarks.scale_serve " + " ".join(sys.argv[1:]),
        "catalogue_size": parts["items"], "artifact_bytes": sum(f.stat().st_size for f in art.iterdir() if f.is_file()),
        "engines": engines, "server_threads": 1,
        "artifact": shown_path(art), "source": {k: shown_path(v) if k in ("run_dir", "dataset") and v else v  # (no machine's paths)
                   for k, v in (manifest.get("source") or {}).items()}, "index": manifest.get("index"),
        "request": {"history": 200, "retrieve_k": 100, "rank": 100, "top_k": 10},
        "pinning": f"server on CPU {SERVER_CPU} (engine in process, 1 thread), client / load generator on CPU {CLIENT_CPU}",
        "memory": parts, "searches": results, "planted": False})


if __name__ == "__main__":
    main()
