"""Learning curve of the ranking model on the synthetic ads logs: data size against the ceilings.

For each scale m, the synthetic generator with ``num_users = 6000 * m`` (everything else its
first-order process, ``first_order()``, on which the recorded figures were taken: the same
world, item catalogue and user process), the joint ranking
config trained within a time budget; its test AUC / NE per task beside the oracle and the
``world+history`` ceiling (``benchmarks/ranking_bounds.py``: what an estimator that knows
the generator's world, but the user only through the shown history, reaches on the same
candidates). If the model's AUC climbs toward the ceiling as m grows, the gap is data;
the rest, up to the oracle, is what no model of these histories can know.

    python -m genrec.benchmarks.ranking_curve [--scales 1,4,16] [--budget-min 30]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from genrec.benchmarks.common import (
    RESULTS,
    ROOT,
    machine,
    shown_path,
    today,
    update_results_md,
    write_json,
)
from genrec.benchmarks.ranking_bounds import bounds
from genrec.train.data.schema import read_info
from genrec.train.data.synthetic import first_order, generate
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training

BASE_USERS = first_order().num_users


def scaled_data(m: int) -> Path:
    out = ROOT / "data" / ("synthetic_first_order" if m == 1 else f"synthetic_first_order_x{m}")
    if not (out / "dataset.json").exists():
        generate(first_order(num_users=BASE_USERS * m), out)
    return out


def run_scale(m: int, budget: float, threads: int, out_dir: str) -> dict:
    data = scaled_data(m)
    overrides = [f'--data.path="{data}"', f'--run.out_dir="{out_dir}"', f"--run.name=curve_x{m}",
                 f"--train.time_budget_min={budget}", "--train.max_epochs=1000", "--train.progress=false"]
    if threads:
        overrides.append(f"--train.threads={threads}")
    t0 = time.time()
    run_dir, res = run_training(load_job("configs/ranking_synthetic.toml", overrides))
    return record(m, Path(run_dir), res, time.time() - t0)


def calibrated_test(run_dir: Path) -> dict[str, float]:
    """rank_test metrics of a run's chosen checkpoint as served; a checkpoint written before
    calibration existed is calibrated on its rank_valid first (in memory), as training does now."""
    from genrec.train.cli import load_run_model
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.calibrate import fit_calibration
    from genrec.train.eval.ranking_metrics import evaluate_ranking
    from genrec.train.job import task_masks

    job, model, emb, _ = load_run_model(run_dir, None, None)
    tasks = task_masks(job, read_info(job.data.path))

    def reader(split: str):  # noqa: ANN202
        return make_reader(job.data, split, emb, job.model.max_seq_len, tasks=tasks)

    if not bool(model.ranking.calibrator.fitted.all()):
        fit_calibration(model, reader("rank_valid"), list(tasks))
    return evaluate_ranking(model, reader("rank_test"), list(tasks))


def record(m: int, run_dir: Path, res: dict, wall: float) -> dict:
    """The curve's record of scale ``m`` from its run (``res``: run_training's results)."""
    data = scaled_data(m)
    test = calibrated_test(run_dir)
    ceiling = bounds(data, chunk=16)
    keys = [f"{t}/{k}" for t in ("click", "conversion") for k in ("auc", "ne", "ece", "ece_floor", "ne_uncalibrated")]
    return {"scale": m, "users": BASE_USERS * m, "epochs": res["epochs"], "best_epoch": res["best_epoch"],
            "train_seconds": res["train_seconds"], "wall_seconds": wall, "run_dir": shown_path(run_dir),
            "model": {k: test.get(k) for k in keys},
            "oracle": ceiling["estimators"]["oracle"], "world+history": ceiling["estimators"]["world+history"],
            "test_candidates": ceiling["candidates"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--budget-min", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument("--out-dir", default="runs/benchmarks")
    ap.add_argument("--from-runs", default="", help="SCALE=RUN_DIR,...: record finished runs instead of training")
    args = ap.parse_args()
    path = RESULTS / "ranking_curve.json"
    done = dict(kv.split("=", 1) for kv in args.from_runs.split(",") if kv)
    for m in (int(s) for s in (args.scales.split(",") if not done else done)):
        if done:
            run_dir = Path(done[str(m)])
            res = json.loads((run_dir / "results.json").read_text())
            rec = record(m, run_dir, res, float("nan"))
        else:
            rec = run_scale(m, args.budget_min, args.threads, args.out_dir)
        rec.update(date=today(), machine=machine(), budget_min=args.budget_min)
        records = json.loads(path.read_text())["records"] if path.exists() else []
        records = sorted([r for r in records if r["scale"] != m] + [rec], key=lambda r: r["scale"])
        write_json("ranking_curve", {"records": records,
                                     "command": "python -m genrec.benchmarks.ranking_curve"})
        update_results_md()


def ranking_curve(d: dict) -> list[str]:
    from genrec.benchmarks.report import machine_text, num, table

    out = ["## Ranking learning curve (synthetic logs: data size against the ceilings)", "",
           "The joint ranking config on 6,000 x m users of the same generator, each trained within its "
           "budget; test AUC beside the oracle and the ceiling given the shown histories "
           "(previous section). NE: normalized entropy of the model's probabilities.", ""]
    rows = []
    for r in d["records"]:
        m, c, o = r["model"], r["world+history"], r["oracle"]
        rows.append([f"x{r['scale']} ({r['users']:,} users)", f"{r['epochs']} ({r['best_epoch']})",
                     f"{r['train_seconds'] / 60:.0f}",
                     *(f"{num(m[f'{t}/auc'], '.3f')} / {num(c[f'{t}/auc'], '.3f')} / {num(o[f'{t}/auc'], '.3f')}"
                       for t in ("click", "conversion")),
                     num(m["click/ne"], ".3f"), num(m["conversion/ne"], ".3f")])
    out += table(["data", "epochs (best)", "train min", "click AUC: model / ceiling / oracle",
                  "conversion AUC: model / ceiling / oracle", "click NE", "conversion NE"], rows) + [""]
    last = d["records"][-1]
    out += [f"Machine: {machine_text(last['machine'])}; {last['date']}; budget {last['budget_min']} min per run. "
            f"Command: `{d['command']}`.", ""]
    return out


def ranking_curve_summary(d: dict) -> tuple[str, str]:
    r = d["records"][-1]
    return (f"x{r['scale']} data: click AUC {r['model']['click/auc']:.3f}",
            f"ceiling {r['world+history']['click/auc']:.3f}, oracle {r['oracle']['click/auc']:.3f}")


if __name__ == "__main__":
    main()
