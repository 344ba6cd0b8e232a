"""Quality benchmark: the default configs on ML-1M and Amazon Beauty, next to baselines
and published numbers, under the leave-one-out full-corpus protocol.

    python -m genrec.benchmarks.quality                         # everything (hours on 2 cores)
    python -m genrec.benchmarks.quality --datasets ml1m --models hstu --budget-min 60
    python -m genrec.benchmarks.quality --datasets ml1m --models hstu --no-baselines --nproc 2   # torchrun, 2 CPU processes

Each (dataset, model, process count) record replaces the previous one in ``results/quality.json``, so
runs can be done one at a time. Models train with the shipped config unchanged except
``data.path`` (and the time budget): the recipe is the default, not a per-dataset tune.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from genrec.benchmarks.common import (
    RESULTS,
    ROOT,
    dataset,
    machine,
    today,
    update_results_md,
    write_json,
)
from genrec.train.data.reader import make_reader
from genrec.train.data.schema import read_info
from genrec.train.eval.baselines import Baseline, evaluate_baseline
from genrec.train.job import load_job, resolve_embedding
from genrec.train.loop.launch import run_training

CONFIGS = {"hstu": "configs/hstu.toml", "transformer": "configs/transformer.toml"}
KEYS = ["hr@10", "ndcg@10", "hr@50", "hr@200", "ndcg@200", "mrr"]
PUBLISHED = {
    "ml1m": [("SASRec (HSTU paper, Table 4)", 0.2853, 0.1603), ("HSTU (paper)", 0.3097, 0.1720),
             ("HSTU-large (paper)", 0.3294, 0.1893)],
    "beauty": [("SASRec (TIGER paper)", 0.0605, 0.0318), ("TIGER (paper)", 0.0648, 0.0384)],
}
VALID_NOTE = ("Validation users: the share of users whose second-to-last event is held out to pick the "
              "checkpoint (`data.valid_users`); the others also train on it, as every user does in the HSTU "
              "code (which has no validation split). The test event is never trained on. The headline figures are "
              "the test at the best validation epoch, or, where the validation column names a window, at the newest "
              "epoch of the best mean of that many consecutive validations (`train.select_window`), or, where it also says 'within 1 se', "
              "at the newest epoch whose mean is within one standard error of that best (`train.select_within_se`); the last epoch's column tests the run's newest checkpoint "
              "(filled from the two-process run of 2026-12-01 on; for that run by `benchmarks.quality.test_last` on its run directory after it ended).")
NAMES = {"ml1m": "MovieLens-1M", "beauty": "Amazon Beauty"}


def run_baselines(name: str, data: Path) -> list[dict]:
    job = load_job(CONFIGS["hstu"], [f'--data.path="{data}"'])
    emb = resolve_embedding(job.embedding, read_info(data))
    out = []
    for kind in ("popular", "transition"):
        t0 = time.perf_counter()
        reader = make_reader(job.data, "test", emb, job.model.max_seq_len)
        m = evaluate_baseline(Baseline(data, kind, job.data.valid_users), reader, job.eval)
        out.append({"dataset": name, "model": f"{kind} baseline", **{k: m[k] for k in KEYS},
                    "epochs": 0, "train_seconds": round(time.perf_counter() - t0, 1),
                    "valid_users": job.data.valid_users})
    return out


def run_model(name: str, data: Path, model: str, budget: float | None, out_dir: str,
              threads: int = 0, nproc: int = 1) -> dict:
    overrides = [f'--data.path="{data}"', f'--run.out_dir="{out_dir}"', f"--run.name={name}_{model}"]
    if budget is not None:
        overrides.append(f"--train.time_budget_min={budget}")
    if threads:
        overrides.append(f"--train.threads={threads}")
    job = load_job(CONFIGS[model], overrides)
    if nproc > 1:
        # the same config under torchrun: processes on this machine, one data-parallel rank each
        run_id = time.strftime("%Y%m%d-%H%M%S") + f"-x{nproc}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "genrec.cli", "train", "--config", CONFIGS[model], *overrides, f"--run.id={run_id}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
        subprocess.run(cmd, check=True, env=env)
        run_dir = Path(out_dir) / f"{name}_{model}" / run_id
        res = json.loads((run_dir / "results.json").read_text())
    else:
        run_dir, res = run_training(job)
    return record(name, model, run_dir, res, res["test"], job, threads or (1 if nproc > 1 else None), nproc)


def record(name: str, model: str, run_dir: Path, res: dict, test: dict, job, threads: int | None,  # noqa: ANN001
           nproc: int) -> dict:
    return {"dataset": name, "model": model, **{k: test[k] for k in KEYS}, "test_last": test_last(run_dir),
            "epochs": res["epochs"],
            "best_epoch": res["best_epoch"], "train_seconds": res["train_seconds"], "stopped": res["stopped"],
            "config": CONFIGS[model], "run_dir": repo_path(run_dir), "threads": threads, "processes": nproc,
            "budget_min": job.train.time_budget_min, "valid_users": job.data.valid_users,
            "select_window": job.train.select_window, "select_within_se": job.train.select_within_se,
            "valid_peak": res.get("valid_peak")}


# what may differ between a finished run and the shipped config it is recorded for
RUN_ONLY = ("data.path", "run.", "eval.test", "train.threads", "train.time_budget_min")


def record_run(name: str, data: Path, model: str, run_dir: Path) -> dict:
    """The record of a run already trained with the shipped config and ``--eval.test=false``
    (the run that chose the recipe on validation): its chosen checkpoint reads the test split
    now, once. Refused when the run's config differs from the shipped one beyond ``RUN_ONLY``."""
    from genrec.config import to_dict
    from genrec.train.cli import evaluate_run
    from genrec.train.runs.browse import config_differences

    run_dir = Path(run_dir)
    job = load_job(run_dir / "config.toml")
    if Path(job.data.path).resolve() != Path(data).resolve():
        raise SystemExit(f"{run_dir}: trained on {job.data.path}, not {data}")
    shipped = load_job(CONFIGS[model], [f'--data.path="{data}"'])
    # a run writes its tables sized from the data: compare the shipped config so sized
    shipped = replace(shipped, embedding=resolve_embedding(shipped.embedding, read_info(data)))
    differ = list(config_differences(to_dict(job), to_dict(shipped), RUN_ONLY))
    if differ:
        raise SystemExit(f"{run_dir}: trained with a config other than {CONFIGS[model]} ({', '.join(differ)} differ)")
    res = json.loads((run_dir / "results.json").read_text())
    if "test" in res:
        raise SystemExit(f"{run_dir}: this run already read the test split (results.json): record it as trained")
    test, _ = evaluate_run(run_dir, None, "test")
    env = json.loads((run_dir / "env.json").read_text())
    return record(name, model, run_dir, res, test, job, env["threads"], env["world_size"])


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (records name no machine's paths)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_last(run_dir: Path) -> dict:
    """Test metrics of the run's newest checkpoint (the last epoch, its schedule annealed or
    cut by the budget), beside the headline ones of the best-validation checkpoint: the
    validation users (10% of ML-1M: 604) pick an epoch within their noise, and this shows
    what that choice cost or gained."""
    from genrec.train.cli import evaluate_run
    from genrec.train.loop import checkpoint as ckpt

    last = ckpt.latest_checkpoint(Path(run_dir) / "checkpoints")
    m, path = evaluate_run(Path(run_dir), str(last), "test")
    return {"checkpoint": path.name, **{k: m[k] for k in KEYS}}


def key(record: dict) -> tuple:
    """A record replaces an earlier one of the same dataset, model and process count."""
    return record["dataset"], record["model"], record.get("processes", 1)






def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="ml1m,beauty")
    ap.add_argument("--models", default="hstu,transformer")
    ap.add_argument("--budget-min", type=float, default=None, help="override the configs' training time budget")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="train each model under torchrun with this many processes (data parallel, one thread each "
                         "unless --threads)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--out-dir", default="runs/benchmarks")
    ap.add_argument("--run", type=Path, default=None,
                    help="record this finished run (trained with the shipped config and --eval.test=false) instead "
                         "of training: its chosen checkpoint reads the test split once; one dataset and model")
    args = ap.parse_args()
    if args.run is not None and ("," in args.datasets or "," in args.models):
        ap.error("--run records one run: name its --datasets and --models")
    path = RESULTS / "quality.json"
    for name in args.datasets.split(","):
        data = dataset(name)
        new = [] if args.no_baselines else run_baselines(name, data)
        for model in args.models.split(","):
            if model and args.run is not None:
                new.append(record_run(name, data, model, args.run))
            elif model:
                new.append(run_model(name, data, model, args.budget_min, args.out_dir, args.threads, args.nproc))
        # re-read: other quality runs (one per core) may have written since this one started
        records = json.loads(path.read_text())["records"] if path.exists() else []
        for rec in new:
            rec.update(date=today(), machine=machine())
            records = [r for r in records if key(r) != key(rec)]
            records.append(rec)
            print(json.dumps({k: rec[k] for k in ("dataset", "model", "hr@10", "ndcg@10", "epochs", "train_seconds")}))
        order = {"popular baseline": 0, "transition baseline": 1, "transformer": 2, "hstu": 3}
        records.sort(key=lambda r: (r["dataset"] != "ml1m", order.get(r["model"], 9), r.get("processes", 1)))
        write_json("quality", {"protocol": "leave-one-out, full corpus, history excluded", "records": records})
        update_results_md()


if __name__ == "__main__":
    main()
