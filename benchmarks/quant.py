"""Quantization benchmark: the ML-1M HSTU model as serving artifacts, size vs accuracy.

    python -m genrec.benchmarks.quant [--run RUN_DIR] [--qat-budget-min 20]

For every embedding scheme (fp32, fp16, int8, int4) x dense scheme (fp32, int8): export the
run's best checkpoint with ``genrec quantize``'s code path, load the artifact as the server
does, and measure HR@10 / NDCG@10 on the test split. Sizes are bytes on disk of the tables
(codes + per-row scale/bias) and of the whole artifact.

Co-design (``--qat-budget-min``): trains the same config three times for the same budget
(float tables, int8-QAT, int4-QAT), exports each at its own width, and compares the loss
from quantization with and without quantization-aware training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from genrec.benchmarks.common import RESULTS, dataset, machine, today, update_results_md, write_json
from genrec.quant.convert import QuantizeConfig, export
from genrec.quant.load import load_model
from genrec.train.data.reader import make_reader
from genrec.train.eval.evaluate import evaluate
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training

EMB = ("fp32", "fp16", "int8", "int4")
DENSE = ("fp32", "int8")


def test_metrics(run_dir: Path, artifact: Path, data: Path) -> dict[str, float]:
    job = load_job(run_dir / "config.toml", [f'--data.path="{data}"'])
    model, _ = load_model(artifact)
    return evaluate(model, make_reader(job.data, "test", job.embedding, job.model.max_seq_len), job.eval)


def artifact_row(run_dir: Path, out: Path, emb: str, dense: str, data: Path) -> dict:
    art = out / f"{emb}-{dense}"
    rep = export(run_dir, art, QuantizeConfig(embeddings=emb, dense=dense), eval_data=data, progress=False)
    m = test_metrics(run_dir, art, data)
    files = sum(p.stat().st_size for p in art.iterdir() if p.is_file())
    return {"embeddings": emb, "dense": dense, "table_bytes": rep["sizes"]["embeddings"]["after"],
            "dense_bytes": rep["sizes"]["dense"]["after"], "artifact_bytes": files,
            "test_hr@10": m["hr@10"], "test_ndcg@10": m["ndcg@10"], "valid": rep["metrics"]["after"]}


def qat_rows(data: Path, budget: float, out: Path, threads: int = 0) -> list[dict]:
    rows = []
    for qat, emb in (("none", "int8"), ("int8", "int8"), ("none", "int4"), ("int4", "int4")):
        name = f"qat_{qat}"
        run_dir = next(iter(sorted((out / "runs" / name).glob("*/results.json"))), None)
        if run_dir is None:
            over = [f'--data.path="{data}"', f"--train.time_budget_min={budget}", f'--run.out_dir="{out / "runs"}"',
                    f"--run.name={name}", f'--embedding.tables=[{{name="item", features=["item"], dim=64, '
                                          f'init_std=0.02, qat="{qat}"}}]']
            if threads:
                over.append(f"--train.threads={threads}")
            run_training(load_job("configs/hstu.toml", over))
            run_dir = next(iter(sorted((out / "runs" / name).glob("*/results.json"))))
        run_dir = run_dir.parent
        float_m = json.loads((run_dir / "results.json").read_text())["test"]
        q = artifact_row(run_dir, out / name, emb, "fp32", data)
        rows.append({"qat": qat, "embeddings": emb, "float_test_ndcg@10": float_m["ndcg@10"],
                     "quantized_test_ndcg@10": q["test_ndcg@10"],
                     "relative_loss": 1 - q["test_ndcg@10"] / float_m["ndcg@10"], "budget_min": budget})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="trained ML-1M HSTU run (default: the quality benchmark's)")
    ap.add_argument("--out", default="runs/benchmarks/quant")
    ap.add_argument("--qat-budget-min", type=float, default=0.0, help="also compare QAT (0: skip)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = dataset("ml1m")
    run = Path(args.run) if args.run else None
    if run is None:
        q = json.loads((RESULTS / "quality.json").read_text())["records"]
        run = Path(next(r["run_dir"] for r in q if r["dataset"] == "ml1m" and r["model"] == "hstu"))
    out = Path(args.out)
    rows = [artifact_row(run, out, e, d, data) for e in EMB for d in DENSE]
    base = next(r for r in rows if r["embeddings"] == "fp32" and r["dense"] == "fp32")
    for r in rows:
        r["table_ratio"] = r["table_bytes"] / base["table_bytes"]
        r["artifact_ratio"] = r["artifact_bytes"] / base["artifact_bytes"]
        r["ndcg_rel_loss"] = 1 - r["test_ndcg@10"] / base["test_ndcg@10"]
    qat = qat_rows(data, args.qat_budget_min, out, args.threads) if args.qat_budget_min else []
    write_json("quant", {"date": today(), "machine": machine(), "run": str(run), "rows": rows, "qat": qat})
    update_results_md()


if __name__ == "__main__":
    main()
