"""Distributed training benchmark: 1 process vs 2, sharding types, memory, communication.

    python -m genrec.benchmarks.distributed [--steps 60] [--users 30000]

Runs the synthetic ads config (10^7 raw item ids, managed-collision item table, fused
Adagrad, DDP dense) for a fixed number of steps, train-only, as: one process (a world of
one), two processes with the item table row-wise (the config), and two processes with a
hashed item table sharded table-wise, row-wise and column-wise. Reports global samples/s,
peak RSS per rank and the per-rank communication volume of one step (computed from the
sharding plan and the batch's token count), so scaling on a real cluster can be estimated.
On this 2-core machine two ranks share the cores that one rank already used: the numbers
show overheads, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from genrec.benchmarks.common import ROOT, machine, today, update_results_md, write_json
from genrec.train.data.files import read_interactions

CONFIG = "configs/ads_synthetic.toml"
HASHED_ITEM = ('--embedding.tables=[{{name="item", features=["item"], dim=64, num_embeddings=200000, oov="hash", '
               'sharding="{s}", init_std=0.02}}, {{name="action", features=["action"], dim=64, sharding="table_wise"}}, '
               '{{name="segment", features=["segment"], dim=16, pooling="sum", sharding="table_wise"}}, '
               '{{name="device", features=["device"], dim=8, pooling="sum", sharding="table_wise"}}, '
               '{{name="region", features=["region"], dim=8, pooling="sum", sharding="column_wise"}}]')


def ensure_data(users: int) -> Path:
    out = ROOT / "data" / f"ads{users}"
    if not (out / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "genrec.cli", "data", "synth", "--out", str(out), "--no-progress",
                        f"--num_users={users}", "--num_items=10000000", "--num_topics=1000"], check=True, cwd=ROOT)
    return out


def launch(world: int, data: Path, out: Path, name: str, steps: int, extra: list[str]) -> dict:
    args = ["-m", "genrec.cli", "train", "--config", CONFIG, f'--data.path="{data}"', f'--run.out_dir="{out}"',
            f"--run.name={name}", f"--train.max_steps={steps}", "--train.evaluate=false", "--train.progress=false",
            "--train.log_every_steps=10", "--train.checkpoint_every_steps=0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
    cmd = [sys.executable, *args] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                       "--nproc-per-node", str(world), *args]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    run_dir = max((out / name).iterdir(), key=lambda p: p.stat().st_mtime)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if r["kind"] == "train"][1:]  # the first window includes warm-up
    mem = [json.loads(p.read_text())["peak_rss_mb"] for p in sorted(run_dir.glob("memory.rank*.json"))]
    plan = json.loads((run_dir / "sharding.json").read_text()) if (run_dir / "sharding.json").exists() else {}
    return {"world_size": world, "samples_per_s": float(np.median(rates)) * world, "peak_rss_mb_per_rank": mem,
            "plan": plan, "run_dir": str(run_dir)}


def comm_bytes(plan: dict, world: int, tokens: float, negatives: int, dense_params: int, dim: int = 64) -> dict:
    """Per rank, per step: embedding all-to-alls (ids in, rows out, row gradients back) and
    the DDP all-reduce of the dense gradients (ring: 2 (W-1)/W of the payload)."""
    if world == 1:
        return {"embedding_alltoall": 0, "ddp_allreduce": 0, "total": 0}
    remote = (world - 1) / world  # the share of lookups served by another rank
    looked_up = tokens + negatives
    ids = looked_up * 8 * remote
    rows = looked_up * dim * 4 * remote
    emb = ids + 2 * rows  # forward rows + backward gradients
    ddp = dense_params * 4 * 2 * (world - 1) / world
    return {"embedding_alltoall": int(emb), "ddp_allreduce": int(ddp), "total": int(emb + ddp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--users", type=int, default=30000)
    ap.add_argument("--out", default="runs/benchmarks/distributed")
    args = ap.parse_args()
    data = ensure_data(args.users)
    out = Path(args.out)
    col = read_interactions(data, ["item_ids"]).column("item_ids").combine_chunks()
    mean_len = float(np.minimum(np.diff(col.offsets.to_numpy()) - 2, 100).mean())
    runs = {
        "1 process (MCH item table)": launch(1, data, out, "one", args.steps, []),
        "2 processes, MCH item row-wise": launch(2, data, out, "two_mch", args.steps, []),
    }
    for s in ("table_wise", "row_wise", "column_wise"):
        runs[f"2 processes, hashed item {s}"] = launch(2, data, out, f"two_{s}", args.steps, [HASHED_ITEM.format(s=s)])
    from genrec.train.job import build_model, load_job

    model, _ = build_model(load_job(CONFIG, [f'--data.path="{data}"']), sparse_device=__import__("torch").device("meta"))
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse."))
    base = runs["1 process (MCH item table)"]["samples_per_s"]
    for r in runs.values():
        tokens = 256 / r["world_size"] * mean_len
        r["comm_bytes_per_rank_step"] = comm_bytes(r["plan"], r["world_size"], tokens, 512, dense)
        r["vs_one_process"] = r["samples_per_s"] / base
    payload = {"date": today(), "machine": machine(), "config": CONFIG, "steps": args.steps, "users": args.users,
               "mean_tokens_per_sequence": mean_len, "dense_parameters": dense, "runs": runs}
    write_json("distributed", payload)
    update_results_md()


if __name__ == "__main__":
    main()
