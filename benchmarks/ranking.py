"""Ranking benchmark: multi-task action prediction over target-aware candidates.

For each dataset, in one run:
* ``joint``: the ranking config (HSTU, retrieval + ranking heads, one checkpoint);
* ``retrieval-only``: the same config with the ranking tasks removed, trained on the same
  (time-restricted) events, so its retrieval metrics show what ranking costs retrieval;
* ``dlrm``: the pooled-embedding DLRM-style baseline on the same batches and features;
* the synthetic generator's oracle: AUC of the true probabilities on the same test events.

    python -m genrec.benchmarks.ranking [--datasets synthetic,ml1m] [--budget-min 20]

Metrics on the held-out time split (``rank_test``): AUC, GAUC, NE per task; retrieval on
the leave-one-out test split.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from genrec.benchmarks.common import (
    RESULTS,
    ROOT,
    dataset,
    machine,
    shown_path,
    today,
    update_results_md,
    write_json,
)
from genrec.train.data.synthetic import first_order, generate
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training

CONFIGS = {"synthetic": "configs/ranking_synthetic.toml", "ml1m": "configs/ranking_ml1m.toml",
           "kuairand": "configs/ranking_kuairand.toml"}
VARIANTS = {
    "joint": [],
    "retrieval-only": ["--model.ranking.tasks=[]", "--train.early_stop_metric=ndcg@10"],
    "dlrm": ["--model.arch=dlrm"],
}


def synthetic_data() -> Path:
    """The first-order synthetic logs (``first_order()``): the recorded figures' rows."""
    out = ROOT / "data" / "synthetic_first_order"
    if not (out / "dataset.json").exists():
        generate(first_order(), out)
    return out


def run_variant(name: str, data: Path, variant: str, budget: float | None, out_dir: str,
                threads: int = 0) -> dict:
    overrides = [f'--data.path="{data}"', f'--run.out_dir="{out_dir}"', f"--run.name=ranking_{name}_{variant}",
                 *VARIANTS[variant]]
    if budget is not None:
        overrides.append(f"--train.time_budget_min={budget}")
    if threads:
        overrides.append(f"--train.threads={threads}")
    run_dir, res = run_training(load_job(CONFIGS[name], overrides))
    return {"dataset": name, "variant": variant, "epochs": res["epochs"], "best_epoch": res["best_epoch"],
            "train_seconds": res["train_seconds"], "run_dir": shown_path(run_dir), "test": res["test"],
            "retrieval_rule": "served"}  # a repeated target is a miss (docs/training.md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="synthetic,ml1m")
    ap.add_argument("--variants", default="joint,retrieval-only,dlrm")
    ap.add_argument("--budget-min", type=float, default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument("--out-dir", default="runs/benchmarks")
    args = ap.parse_args()
    path = RESULTS / "ranking.json"
    for name in args.datasets.split(","):
        data = synthetic_data() if name == "synthetic" else dataset(name)
        for variant in args.variants.split(","):
            rec = run_variant(name, data, variant, args.budget_min, args.out_dir, args.threads)
            rec.update(date=today(), machine=machine(), budget_min=args.budget_min)
            # re-read: another run of this script may have written its records meanwhile
            records = json.loads(path.read_text())["records"] if path.exists() else []
            records = [r for r in records if (r["dataset"], r["variant"]) != (name, variant)]
            records.append(rec)
            write_json("ranking", {"records": records})
            update_results_md()


if __name__ == "__main__":
    main()
