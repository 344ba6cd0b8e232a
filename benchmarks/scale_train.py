"""Training a 10^7-row item table: TorchRec row-wise sharding over 2 ranks, fused row-wise Adagrad.

    python -m genrec.benchmarks.scale_train [--rows 10000000,100000] [--steps 120] [--resume-at 60]

The recipe is configs/scale_10m.toml; the same recipe runs at every ``--rows`` (its item
table's ``num_embeddings`` and data path swapped, nothing else), one after the other in one
session, so that their figures compare side by side. Per size, from the run's metrics.jsonl and
a sampler of the ranks' resident memory: samples/s (both ranks), peak memory per rank (the
trainer's own figure and the sampled RSS), the checkpoint's bytes and write time.

Checkpoint / resume (largest size only): the run of ``--steps`` steps that checkpointed at
``--resume-at`` is replayed as two jobs: one stopped at ``--resume-at`` (its checkpoint
written), one started again with the same run id, which resumes from that checkpoint and
trains to ``--steps``; its logged losses after the resume must equal the uninterrupted run's.

The data: ``genrec data synth --num_items=N`` with the first-order process's settings (as
configs/scale_10m.toml's header: the figures were measured on it) writes the items its logs hold (a Zipf catalogue of
10^7 ids shows about 3 x 10^6 of them in 200,000 users' logs); :func:`whole_catalogue` makes
the dataset's catalogue every id of the generator's id space, seen or not, as an ads catalogue
holds ads no log has shown yet (their rows stay at their initialisation: a cold start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from genrec.benchmarks.common import ROOT, machine, today, write_json

CONFIG = ROOT / "configs" / "scale_10m.toml"


def whole_catalogue(data: Path, num_items: int) -> int:
    """Rewrites ``data``/items.parquet as every id 1..``num_items`` (counts of the unseen: 0) and
    dataset.json's ``num_items`` to match; returns how many ids the logs held."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    info = json.loads((data / "dataset.json").read_text())
    t = pq.read_table(data / "items.parquet")
    ids, counts = t.column("item_id").to_numpy(), t.column("count").to_numpy()
    seen = int(info.get("extra", {}).get("seen_items", ids.size))
    if ids.size == num_items:
        return seen
    all_counts = np.zeros(num_items, np.int64)
    all_counts[ids - 1] = counts
    pq.write_table(pa.table({"item_id": np.arange(1, num_items + 1, dtype=np.int64), "count": all_counts}),
                   data / "items.parquet")
    info["num_items"] = num_items
    info.setdefault("extra", {})["seen_items"] = seen
    (data / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
    return seen


def config_for(rows: int, data: Path, out: Path) -> Path:
    """configs/scale_10m.toml with the item table's rows and the data path swapped."""
    text = CONFIG.read_text()
    text = re.sub(r"num_embeddings = \d+", f"num_embeddings = {rows + 1}", text)
    text = re.sub(r'path = "[^"]*"', f'path = "{data}"', text, count=1)
    path = out / f"scale_{rows}.toml"
    path.write_text(text)
    return path


class RssSampler:
    """Samples the resident memory of a process's descendants (the torchrun ranks) every
    ``period`` s: the peak per process, MB."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        import psutil

        self.root, self.period, self.peak = psutil.Process(pid), period, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                for p in self.root.children(recursive=True):
                    try:
                        self.peak[p.pid] = max(self.peak.get(p.pid, 0.0), p.memory_info().rss / 2**20)
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self._stop.wait(self.period)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return sorted((round(v, 1) for v in self.peak.values()), reverse=True)


def train(config: Path, out: Path, name: str, run_id: str, steps: int, checkpoint_every: int,
          extra: tuple[str, ...] = ()) -> dict:
    """One torchrun job of 2 ranks: wall time, sampled peak RSS of its processes (MB, largest
    first), exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "genrec.cli", "train",
           "--config", str(config), f"--train.max_steps={steps}", f"--train.checkpoint_every_steps={checkpoint_every}",
           "--train.evaluate=false", "--train.progress=false", f'--run.out_dir="{out}"', f"--run.name={name}",
           f"--run.id={run_id}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    with open(out / f"{name}-{run_id}-{steps}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = RssSampler(proc.pid)
        rc = proc.wait()
        rss = sampler.stop()
    if rc:
        raise RuntimeError(f"training failed ({rc}): {out / f'{name}-{run_id}-{steps}.log'}")
    return {"wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mb_by_process": rss}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"kind": "train"' in line]


def checkpoint_figures(run_dir: Path) -> dict:
    """Bytes of each step_* checkpoint, and the seconds spent writing checkpoints in each logged
    window (metrics.jsonl's per-step mean ``time_ms.checkpoint`` x the window's steps)."""
    ckpts = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
             for p in sorted((run_dir / "checkpoints").glob("step_*"))}
    recs, last, write = records(run_dir), 0, {}
    for r in recs:
        ms = r.get("time_ms", {}).get("checkpoint", 0.0)
        if ms:
            write[f"steps {last + 1}-{r['step']}"] = round(ms * (r["step"] - last) / 1e3, 2)
        last = r["step"]
    return {"bytes": ckpts, "write_s_by_window": write}


def throughput(recs: list[dict], skip: int = 1) -> dict:
    """samples/s of the logged windows after the first ``skip`` (warm-up), median; peak memory."""
    rates = [r["samples_per_s"] for r in recs[skip:]] or [r["samples_per_s"] for r in recs]
    peak = [r.get("peak_mem_mb") for r in recs if r.get("peak_mem_mb") is not None]
    return {"samples_per_s_rank0_median": round(float(np.median(rates)), 1),
            "samples_per_s_windows": [round(x, 1) for x in rates],
            "trainer_peak_mem_mb_per_rank": peak[-1] if peak else None}


def scale_train_section(d: dict) -> list[str]:
    """DETAILS.md's section of results/scale_10m_train.json (report.py: DETAILS.md only)."""
    from genrec.benchmarks.report_format import command, footer, num, table

    sizes = {k: v for k, v in d.get("sizes", {}).items() if k != "resume"}
    rows = []
    for k, r in sizes.items():
        ck = r.get("checkpoint") or {}
        last = max((ck.get("bytes") or {}).values(), default=None)
        write = sum((ck.get("write_s_by_window") or {}).values()) or None
        peak = r.get("trainer_peak_mem_mb_per_rank") or []
        rows.append([f"{int(k):,}", f"{int(r.get('seen_in_logs', 0)):,}", num(r.get("samples_per_s_rank0_median"), ".0f"),
                     " / ".join(num(x, ".0f") for x in peak) or "missing",
                     num(last / 1e9 if last else None, ".3f"), num(write, ".2f")])
    res = d.get("sizes", {}).get("resume") or {}
    resume = (f"Checkpoint / resume at {num(res.get('rows'), ',d')} rows: a job stopped at step "
              f"{num(res.get('stopped_at'), 'd')} and restarted with the same run id resumed from its checkpoint; "
              f"its logged losses after the resume differ from the uninterrupted run's by at most "
              f"{num(res.get('max_abs_loss_difference'), 'g')} (steps {', '.join(res.get('loss_after_resume', {}))}).")
    return ["## Training a 10^7-row item table (TorchRec row-wise over 2 ranks, fused row-wise Adagrad)", "",
            "Anchor: the same recipe (configs/scale_10m.toml) at 10^5 rows, in the same session; "
            f"{d.get('steps')} steps of 256 sequences (128 a rank), evaluation off. samples/s: rank 0's, median of "
            "the logged windows after the first; peak memory: the trainer's per-rank peak RSS. The machine was "
            "shared with other work (load average about 10).", "",
            *table(["item rows", "seen in the logs", "samples/s (rank 0)", "peak MB per rank", "checkpoint GB",
                    "checkpoint write s"], rows), "", resume,
            *footer(d, command(d, "python -m genrec.benchmarks.scale_train"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="10000000,100000", help="item-table sizes, largest first (its data: --data-*)")
    ap.add_argument("--data", default="runs/data10m,runs/data100k", help="a dataset per size (genrec data synth)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--resume-at", type=int, default=60)
    ap.add_argument("--out", default="runs/scale_train")
    ap.add_argument("--name", default="scale_10m_train", help="results/<name>.json")
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.rows.split(",")]
    datas = [(ROOT / d).resolve() for d in args.data.split(",")]
    results: dict = {}
    for rows, data in zip(sizes, datas):
        seen = whole_catalogue(data, rows)
        cfg = config_for(rows, data, out)
        name = f"rows{rows}"
        job = train(cfg, out, name, "full", args.steps, args.resume_at)
        run_dir = out / name / "full"
        recs = records(run_dir)
        results[str(rows)] = {"catalogue": rows, "seen_in_logs": seen, **job, **throughput(recs),
                              "checkpoint": checkpoint_figures(run_dir),
                              "loss_by_step": {r["step"]: round(r["loss"], 6) for r in recs}}
        print(rows, json.dumps({k: v for k, v in results[str(rows)].items() if k != "loss_by_step"}), flush=True)
    rows, data = sizes[0], datas[0]
    cfg, name = out / f"scale_{rows}.toml", f"rows{rows}"
    first = train(cfg, out, name, "resumed", args.resume_at, args.resume_at)
    t0 = time.perf_counter()
    second = train(cfg, out, name, "resumed", args.steps, args.resume_at)
    resumed = {r["step"]: round(r["loss"], 6) for r in records(out / name / "resumed")}
    full = results[str(rows)]["loss_by_step"]
    after = [s for s in full if s > args.resume_at]
    results["resume"] = {
        "rows": rows, "stopped_at": args.resume_at, "first_job": first, "second_job": second,
        "second_job_s": round(time.perf_counter() - t0, 1),
        "loss_after_resume": {s: resumed.get(s) for s in after}, "loss_uninterrupted": {s: full[s] for s in after},
        "max_abs_loss_difference": max((abs(resumed[s] - full[s]) for s in after if s in resumed), default=None)}
    print("resume", json.dumps(results["resume"]), flush=True)
    write_json(args.name, {"date": today(), "machine": machine(), "load_avg": os.getloadavg(),
                           "config": str(CONFIG.relative_to(ROOT)), "steps": args.steps,
                           "command": "python -m genrec.benchmarks.scale_train " + " ".join(sys.argv[1:]), "shared_machine": True, "sizes": results})


if __name__ == "__main__":
    main()
