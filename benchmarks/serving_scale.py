"""Serving at scale: a catalogue of about 10^6 items and histories of thousands of events.

    python -m genrec.benchmarks.serving_scale [--items 1000000] [--histories 200,1000,4000] [--engines torch,sglang]

Builds once (under ``--out``): synthetic logs whose catalogue holds about ``--items``
distinct items, an HSTU with ``max_seq_len`` 4096 trained for a few steps (latency does not
depend on how well it is trained), and its int8-table artifact. Then, per engine, starts
``genrec serve`` on 127.0.0.1 and measures closed-loop single-request latency of
``Recommend`` (retrieve 100 from the whole catalogue, rank the 100, return 10) at each
history length, and the server's resident memory.
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

from genrec.benchmarks.common import ROOT, machine, today, update_results_md, write_json
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
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    art = build(out, args.items, args.users, args.max_len)
    build_s = time.perf_counter() - t0
    corpus = catalogue(art)
    results: dict[str, dict] = {}
    for engine in args.engines.split(","):
        if engine == "sglang":
            if importlib.util.find_spec("sglang") is None:  # importing it needs serve.sglang_shim first
                results[engine] = {"skipped": "SGLang is not installed (bash .ci/setup-sglang)"}
                continue
        proc, target, _ = start_server(engine, art, args.threads, out / f"profile-{engine}.json")
        try:
            rows = {}
            for h in (int(x) for x in args.histories.split(",")):
                payloads = requests(corpus, h, args.requests)
                single_request_latency(target, payloads[:3], n=3)  # warm-up (first-shape compiles, caches)
                rows[str(h)] = single_request_latency(target, payloads, n=args.requests)
                print(engine, h, json.dumps(rows[str(h)]), flush=True)
            results[engine] = {"latency_by_history": rows, "server_rss_mb": rss_mb(proc.pid)}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    sizes = json.loads((art / "quantization_report.json").read_text())["sizes"] if (
        art / "quantization_report.json").exists() else {}
    payload = {"date": today(), "machine": machine(), "artifact": str(art), "catalogue_size": int(corpus.size),
               "item_rows": args.items, "server_threads": args.threads, "build_seconds": round(build_s, 1),
               "artifact_bytes": sum(sizes.get("files", {}).values()) if sizes else None,
               "request": {"retrieve_k": 100, "rank": 100, "top_k": 10}, "engines": results}
    write_json("serving_scale", payload)
    update_results_md()


if __name__ == "__main__":
    main()
