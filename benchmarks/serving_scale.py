"""Serving at scale: a catalogue of 10^6 to 10^7 items and histories of thousands of events.

    python -m genrec.benchmarks.serving_scale [--items 1000000] [--histories 200,1000,4000] [--engines torch,sglang]
        [--search exact,ann] [--planted]

Builds once (under ``--out``): synthetic logs whose catalogue holds about ``--items``
distinct items, an HSTU with ``max_seq_len`` 4096 trained for a few steps (latency does not
depend on how well it is trained), and its int8-table artifact with its ANN index
(``genrec quantize``: nprobe calibrated on the validation users). ``--planted`` (for 10^7
items, where logs and a full-softmax step cost hours here) skips logs and training: the same
model untrained, its item table planted with topic-clustered rows (benchmarks/ann_index.py's
catalogue) standing in for a trained one, the index calibrated on that benchmark's synthetic
validation users. Then, per engine and per dense search (``--search``: the server's
``serve.retrieval.search``), starts ``genrec serve`` on 127.0.0.1 and measures closed-loop
single-request latency of ``Recommend`` (retrieve 100 from the whole catalogue, rank the 100,
return 10) at each history length, the server's resident memory, and for the ANN search its
``Retrieve`` recall@100 against the exact server's answers to the same users.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from genrec.benchmarks.common import ROOT, machine, today, write_json
from genrec.benchmarks.serving import single_request_latency, start_server
from genrec.proto.v1 import recommender_pb2 as pb


def genrec(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "genrec.cli", *args], cwd=ROOT, check=True)


def build(out: Path, items: int, users: int, max_len: int = 400) -> Path:
    """Data -> a few training steps -> int8 artifact (each step skipped when already done)."""
    data, art = out / "data", out / "artifact-int8"
    if not (data / "dataset.json").exists():
        # flat popularity and enough events that nearly every id occurs at least once
        genrec("data", "synth", "--out", str(data), f"--num_users={users}", f"--num_items={items}",
               "--num_topics=1000", "--zipf=0.3", "--median_len=80", f"--max_len={max_len}")
    if not (art / "manifest.json").exists():
        genrec("train", "--config", "configs/demo.toml", f'--data.path="{data}"', f'--run.out_dir="{out}"',
               "--run.name=scale", "--run.id=train", "--model.max_seq_len=4096", "--train.max_steps=10",
               "--train.evaluate=false", "--train.progress=false", '--train.parallel.sparse_optimizer="rowwise_adagrad"')
        genrec("quantize", "--checkpoint", str(out / "scale" / "train"), "--out", str(art), "--embeddings", "int8",
               "--no-eval", "--no-progress")
    return art


def planted(out: Path, items: int, noise: float = 0.75, seed: int = 0) -> Path:
    """The artifact of an untrained demo HSTU whose item table holds ``items`` planted rows
    (topic-clustered: ann_index.catalogue), int8, with its index (see the module docstring)."""
    import torch

    from genrec.benchmarks.ann_index import catalogue as planted_rows
    from genrec.benchmarks.ann_index import users
    from genrec.config import to_dict
    from genrec.embedding.spec import EmbeddingConfig, TableConfig
    from genrec.models.recommender import GenerativeRecommender
    from genrec.quant.ann import IndexConfig, index_artifact
    from genrec.quant.artifact import Manifest, save_artifact
    from genrec.quant.dense import dense_tensors
    from genrec.quant.embeddings import table_tensors
    from genrec.train.job import load_job

    art = out / "artifact-int8"
    if (art / "manifest.json").exists():
        return art
    job = load_job(ROOT / "configs" / "demo.toml", ["--model.max_seq_len=4096"])
    emb = EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=64, num_embeddings=items + 1),),
                          item_feature="item")
    torch.manual_seed(seed)
    model = GenerativeRecommender(job.model, emb, torch.arange(1, items + 1)).eval()
    rows, centres = planted_rows(items, 64, 1000, noise, seed)
    weight = next(p for p in model.sparse.parameters() if p.shape[0] == items + 1)
    with torch.no_grad():
        weight[1:] = torch.from_numpy(rows) * 0.05
    del rows
    manifest = Manifest(model=to_dict(job.model), embedding=to_dict(emb),
                        quantization={"embeddings": "int8", "dense": "fp32", "row_alignment": 16},
                        source={"run_dir": "planted", "checkpoint": "untrained"})
    save_artifact(art, manifest, {"embeddings.safetensors": table_tensors(model.sparse, "int8"),
                                  "dense.safetensors": dense_tensors(model, "fp32")})
    del model, weight
    index_artifact(art, IndexConfig(), queries=users(centres, 1000, noise, seed + 1),
                   source="synthetic validation users (ann_index.users)")
    return art


def catalogue(art: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(art / "dense.safetensors"))["corpus_ids"]


def requests(corpus: np.ndarray, history: int, n: int, seed: int = 0) -> list[bytes]:
    """Recommend requests whose histories are ``history`` catalogue items drawn at random."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.choice(corpus, size=history)
        ts = 1_700_000_000 + np.sort(rng.integers(0, 86400 * 365, size=history))
        user = pb.User(history=[pb.Event(item_id=int(i), timestamp=int(t)) for i, t in zip(ids, ts)])
        out.append(pb.RecommendRequest(user=user, retrieve_k=100, top_k=10).SerializeToString())
    return out


def served_calibration(art: Path, corpus: np.ndarray, history: int, n: int = 300, target: float = 0.97) -> dict:
    """nprobe and shortlist chosen on validation users of the served model itself: the engine's
    vectors of ``n`` request histories drawn with another seed than the timed ones
    (quant.ann.calibrate). For a planted artifact, whose index was calibrated on synthetic users
    the untrained tower's vectors do not resemble."""
    import gc

    import torch

    from genrec.quant.ann import (
        IndexConfig,
        ann_top,
        calibrate,
        exact_top,
        item_vectors,
        recall,
        set_nprobe,
    )
    from genrec.serve.ann import RetrievalConfig
    from genrec.serve.engine import TorchEngine
    from genrec.serve.requests import Limits, decode_user

    engines = [TorchEngine(art, retrieval=RetrievalConfig(search="ann"))]

    def vectors(seed: int, count: int) -> np.ndarray:
        eng = engines[0]
        users = [decode_user(pb.RecommendRequest.FromString(r).user, eng.schema, Limits())
                 for r in requests(corpus, history, count, seed=seed)]
        with torch.inference_mode():
            return np.concatenate([eng.encode(users[i : i + 32])[0].float().numpy() for i in range(0, count, 32)])

    cat = engines[0].catalogue
    assert cat.ann is not None
    items = item_vectors(engines[0].model).float().numpy()  # [N, D]: the catalogue keeps none in ANN mode
    nprobe, shortlist, tried = calibrate(cat.ann.index, items, vectors(1, n), IndexConfig(target=target))
    held = vectors(0, n)  # the timed requests' users (seed 0): recall in this process, the server's re-score
    set_nprobe(cat.ann.index, nprobe)
    rec = recall(ann_top(cat.ann.index, items, held, 100, shortlist), exact_top(items, held, 100))
    engines.clear()  # (its catalogue: gigabytes at 10^7 items, before the servers load theirs)
    del cat, items
    gc.collect()
    return {"queries": f"{n} served users (seed 1)", "target": target, "nprobe": nprobe, "shortlist": shortlist,
            "recall_by_shortlist_nprobe": tried, "held_out_recall_at_100": round(rec, 4),
            "held_out": f"the {n} timed requests' users (seed 0), in process"}


def retrieve_requests(corpus: np.ndarray, history: int, n: int, seed: int = 0) -> list[bytes]:
    """Retrieve k = 100 for the users of :func:`requests` (same seed: the same histories)."""
    return [pb.RetrieveRequest(user=pb.RecommendRequest.FromString(r).user, k=100).SerializeToString()
            for r in requests(corpus, history, n, seed)]


def retrieved(target: str, payloads: list[bytes]) -> list[np.ndarray]:
    import grpc

    ch = grpc.insecure_channel(target)
    call = ch.unary_unary("/genrec.v1.Recommender/Retrieve")
    out = [np.array([it.item_id for it in pb.RetrieveResponse.FromString(call(p, timeout=30)).items]) for p in payloads]
    ch.close()
    return out


def rss_tree_mb(pid: int) -> float:
    """Resident memory of the server and its engine processes (children), MB."""
    total = rss_mb(pid)
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in child.read_text().split():
            total += rss_mb(int(c))
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=40_000)
    ap.add_argument("--max-len", type=int, default=400, help="longest training sequence of the synthetic logs")
    ap.add_argument("--histories", default="200,1000,4000")
    ap.add_argument("--engines", default="torch,sglang")
    ap.add_argument("--requests", type=int, default=40, help="requests timed per history length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/benchmarks/serving_scale")
    ap.add_argument("--search", default="exact,ann", help="serve.retrieval.search of each server, exact first")
    ap.add_argument("--planted", action="store_true", help="no logs or training: an untrained model, planted table")
    ap.add_argument("--name", default="serving_scale", help="results/<name>.json")
    ap.add_argument("--start-timeout", type=float, default=1200, help="seconds a server may take to load")
    ap.add_argument("--calibrate-served", action="store_true",
                    help="choose the ANN server's nprobe / shortlist on the served model's validation users")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    art = planted(out, args.items) if args.planted else build(out, args.items, args.users, args.max_len)
    build_s = time.perf_counter() - t0
    corpus = catalogue(art)
    results: dict[str, dict] = {}
    first = int(args.histories.split(",")[0])
    served = served_calibration(art, corpus, first) if args.calibrate_served else None
    if served:
        print("served calibration", json.dumps(served), flush=True)
    for engine in args.engines.split(","):
        if engine == "sglang":
            if importlib.util.find_spec("sglang") is None:  # importing it needs serve.sglang_shim first
                results[engine] = {"skipped": "SGLang is not installed (bash .ci/setup-sglang)"}
                continue
        exact_lists: list[np.ndarray] | None = None
        for search in args.search.split(","):
            name = engine if search == "exact" else f"{engine}-{search}"
            # no standby engine process: at 10^7 items a second copy of the catalogue would not fit beside
            extra = [f'--serve.retrieval.search="{search}"', "--serve.process.standby=false"]
            if served and search == "ann":
                extra += [f"--serve.retrieval.nprobe={served['nprobe']}", f"--serve.retrieval.shortlist={served['shortlist']}"]
            proc, target, _ = start_server(engine, art, args.threads, out / f"profile-{name}.json", extra=extra,
                                           timeout_s=args.start_timeout)
            try:
                rows = {}
                for h in (int(x) for x in args.histories.split(",")):
                    payloads = requests(corpus, h, args.requests)
                    single_request_latency(target, payloads[:3], n=3)  # warm-up (first-shape compiles, caches)
                    rows[str(h)] = single_request_latency(target, payloads, n=args.requests)
                    print(name, h, json.dumps(rows[str(h)]), flush=True)
                got = retrieved(target, retrieve_requests(corpus, first, args.requests))
                res: dict = {"latency_by_history": rows, "server_rss_mb": rss_tree_mb(proc.pid)}
                if search == "exact":
                    exact_lists = got
                elif exact_lists is not None:
                    res["recall_at_100_vs_exact"] = round(float(np.mean(
                        [np.intersect1d(a, b).size / max(b.size, 1) for a, b in zip(got, exact_lists)])), 4)
                results[name] = res
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
            prof = out / f"profile-{name}.json"  # which search answered: the engine's stage seconds
            stages = json.loads(prof.read_text()).get("stages_s", {}) if prof.exists() else {}
            results[name]["retrieve_s"] = {k: round(stages[k], 3) for k in ("retrieve_topk", "retrieve_ann") if k in stages}
    sizes = json.loads((art / "quantization_report.json").read_text())["sizes"] if (
        art / "quantization_report.json").exists() else {}
    payload = {"date": today(), "machine": machine(), "artifact": str(art), "catalogue_size": int(corpus.size),
               "item_rows": args.items, "server_threads": args.threads, "build_seconds": round(build_s, 1),
               "artifact_bytes": sum(sizes.get("files", {}).values()) if sizes else None,
               "request": {"retrieve_k": 100, "rank": 100, "top_k": 10}, "engines": results,
               "planted": args.planted, "index": json.loads((art / "manifest.json").read_text()).get("index", {}),
               "served_calibration": served,
               "shared_machine": True}
    write_json(args.name, payload)


if __name__ == "__main__":
    main()
