"""Reading logs that outgrow one file: a synthetic log of 10^7+ events written as date
partitions (16+ files), read by the training reader alone, against what the training step
consumes, and resumed exactly across a SIGKILL.

* data: ``genrec data synth --partition date`` of ``--users`` users (and the same users as one
  ``interactions.parquet``, to compare), in a temporary folder, never in the repository;
* throughput: the ``train`` reader of ``configs/hstu.toml`` (batch 128, 200-event windows, sort
  windows of 16 batches) alone, a whole epoch (a date partition holds users of similar history
  lengths, so a part of an epoch reads faster or slower than the whole): 1 rank, and each rank
  of 2 (one process iterating rank 0's, then rank 1's reader); ``--rounds`` rounds, each another
  epoch, the arms' order reversed every other round, the median kept. "Rows decoded a sample"
  is what the rank split costs: a partitioned rank decodes its own units, a one-file rank every
  row group;
* the training step's need: samples/s of the same recipe's training step on this project's
  CPU, from ``results/train_ops.json`` (its mean step time and batch size; ML-1M);
* kill and resume: a worker process reads rank 1 of 2, writing each batch's user ids (and a
  CRC of its token ids) to a log and, every ``--every`` batches, a checkpoint (the reader's
  ``state_dict`` and the log's length, as a trainer checkpoints with its model). It is
  SIGKILLed mid-epoch, between checkpoints; a fresh process resumes from the checkpoint (the
  log cut back to it, as a trainer redoes the steps after its last checkpoint) and finishes
  the epoch. Its log must equal an uninterrupted worker's, line for line.

    python -m genrec.benchmarks.data_reader [--users 100000] [--rounds 3] [--every 50]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

CONFIG = "configs/hstu.toml"
RESUME_WORLD, RESUME_RANK = 2, 1


def make_reader(data: Path, rank: int = 0, world: int = 1):  # noqa: ANN201 - a SequenceReader
    """The training reader ``genrec train --config configs/hstu.toml`` builds on ``data``."""
    from genrec.train.data.reader import make_reader as make
    from genrec.train.data.schema import read_info
    from genrec.train.job import load_job, resolve_embedding

    job = load_job(CONFIG, [f'--data.path="{data}"'])
    emb = resolve_embedding(job.embedding, read_info(data))
    return make(job.data, "train", emb, job.model.max_seq_len, seed=job.train.seed, rank=rank, world_size=world)


def synthesize(root: Path, users: int) -> dict[str, Any]:
    """The partitioned log and the same users as one file; what they hold."""
    from genrec.train.data.files import InteractionFiles
    from genrec.train.data.schema import Layout
    from genrec.train.data.synthetic import first_order, generate

    # histories as long as ML-1M's (median 96 events): the reader's work a sample is the recipe's;
    # the first-order process, as recorded: its gaps set how many days (partitions) the log spans
    cfg = first_order(num_users=users, num_items=100_000, median_len=80)
    out: dict[str, Any] = {}
    for name, layout in (("partitioned", Layout(partition="date")), ("one_file", Layout())):
        t0 = time.perf_counter()
        info = generate(cfg, root / name, progress=False, layout=layout)
        log = InteractionFiles(root / name)
        out[name] = {"write_s": time.perf_counter() - t0, "files": len(log.paths), "row_groups": len(log.units),
                     "bytes": sum(p.stat().st_size for p in log.paths)}
    out.update(users=info.num_users, events=info.num_events, layout="date partitions (UTC day of a user's last event)",
               synthetic={"num_users": users, "num_items": cfg.num_items, "median_len": cfg.median_len})
    return out


def throughput(data: Path, rank: int, world: int, epoch: int) -> dict[str, float]:
    """Samples/s, tokens/s and batches/s of one rank's reader over an epoch (its files' footers
    read before the clock starts), and the rows of the units it decodes, a sample."""
    reader = make_reader(data, rank, world)
    reader.set_epoch(epoch)
    units = {g for g, _ in reader._rank_samples()}  # the plan alone: reads nothing
    samples = tokens = n = 0
    t0 = time.perf_counter()
    for batch in reader:
        samples, tokens, n = samples + batch.batch_size, tokens + batch.seq.values().numel(), n + 1
    dt = time.perf_counter() - t0
    return {"samples_per_s": samples / dt, "tokens_per_s": tokens / dt, "batches_per_s": n / dt, "batches": n,
            "rows_decoded_per_sample": sum(reader.log.units[g].rows for g in units) / samples,
            "units_read": len(units)}


def training_need() -> dict[str, Any]:
    """The training step's consumption, from the train_ops benchmark's record."""
    from genrec.benchmarks.common import RESULTS

    d = json.loads((RESULTS / "train_ops.json").read_text())
    step_s = d["bookkeeping"]["mean_time_ms"]["step"] / 1e3
    return {"source": "benchmarks/results/train_ops.json", "config": d["config"], "date": d["date"],
            "cpu": d["machine"]["cpu"], "batch_size": d["batch_size"], "s_per_step": step_s,
            "samples_per_s": d["batch_size"] / step_s}


# ----- kill and resume ------------------------------------------------------------------------
def worker(data: Path, ckpt: Path, log: Path, every: int) -> None:
    """Reads one epoch of rank RESUME_RANK's batches into ``log``, checkpointing every
    ``every`` batches; resumes from ``ckpt`` when it exists."""
    reader = make_reader(data, RESUME_RANK, RESUME_WORLD)
    size = 0
    if ckpt.exists():
        state = json.loads(ckpt.read_text())
        reader.load_state_dict(state["reader"])
        size = state["log_bytes"]
    with open(log, "r+b" if log.exists() else "wb") as f:
        f.truncate(size)  # the batches after the checkpoint are redone, as a trainer redoes its steps
        f.seek(size)
        for batch in reader:
            crc = zlib.crc32(batch.seq.values().numpy().tobytes())
            f.write(f"{crc} {' '.join(map(str, batch.user_ids.tolist()))}\n".encode())
            f.flush()  # the parent sees every batch read, checkpointed or not
            if reader.batches_done % every == 0:
                os.fsync(f.fileno())
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"reader": reader.state_dict(), "log_bytes": f.tell()}))
                os.replace(tmp, ckpt)  # a checkpoint is whole or absent


def run_worker(data: Path, ckpt: Path, log: Path, every: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "genrec.benchmarks.data_reader", "--worker", str(data), "--ckpt", str(ckpt),
           "--log", str(log), "--every", str(every)]
    return subprocess.Popen(cmd, env={**os.environ, "TQDM_DISABLE": "1"})


def kill_and_resume(data: Path, tmp: Path, every: int) -> dict[str, Any]:
    """An uninterrupted epoch against one SIGKILLed mid-epoch and resumed in a fresh process."""
    t0 = time.perf_counter()
    if run_worker(data, tmp / "ref.json", tmp / "ref.log", every).wait() != 0:
        raise RuntimeError("the uninterrupted worker failed")
    ref_s = time.perf_counter() - t0
    ref = (tmp / "ref.log").read_bytes().splitlines()
    ckpt, log = tmp / "run.json", tmp / "run.log"
    proc = run_worker(data, ckpt, log, every)
    # kill past 40% of the epoch, half way between two checkpoints: batches read since the last
    # checkpoint are lost and read again
    lines, pos = 0, 0
    while lines < 0.4 * len(ref) or lines % every != every // 2:
        if proc.poll() is not None:
            raise RuntimeError("the worker ended before it could be killed")
        time.sleep(0.002)
        if log.exists():
            with open(log, "rb") as f:
                f.seek(pos)
                new = f.read()
            pos, lines = pos + len(new), lines + new.count(b"\n")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = log.read_bytes().count(b"\n")
    saved = json.loads(ckpt.read_text())["reader"]["batches_done"]
    if run_worker(data, ckpt, log, every).wait() != 0:
        raise RuntimeError("the resumed worker failed")
    got = log.read_bytes().splitlines()
    return {"world_size": RESUME_WORLD, "rank": RESUME_RANK, "checkpoint_every": every, "epoch_batches": len(ref),
            "batches_logged_at_kill": at_kill, "checkpoint_batches": saved, "redone_batches": at_kill - saved,
            "samples": sum(len(line.split()) - 1 for line in ref), "exact": got == ref,
            "first_difference": next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            if got != ref else None, "uninterrupted_s": ref_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=100_000, help="synthetic users (about 110 events each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=50, help="batches between the worker's checkpoints")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.ckpt, args.log, args.every)
        return

    from genrec.benchmarks.common import machine, today, update_results_md, write_json

    with tempfile.TemporaryDirectory(prefix="genrec-data-reader-") as tmp:
        root = Path(tmp)
        data = synthesize(root, args.users)
        print(json.dumps(data), flush=True)
        arms = {("partitioned", 1, 0): [], ("partitioned", 2, 0): [], ("partitioned", 2, 1): [],
                ("one_file", 1, 0): [], ("one_file", 2, 0): []}
        for rnd in range(args.rounds):  # arms interleaved, the order reversed every other round (ABBA): a
            # machine shared with other work moves them alike
            for layout, world, rank in list(arms)[:: 1 if rnd % 2 == 0 else -1]:
                arms[layout, world, rank].append(throughput(root / layout, rank, world, epoch=rnd))
                print(layout, world, rank, arms[layout, world, rank][-1], flush=True)
        resume = kill_and_resume(root / "partitioned", root, args.every)
        print(json.dumps(resume), flush=True)
    rows = []
    for (layout, world, rank), got in arms.items():
        med = {k: statistics.median(g[k] for g in got) for k in ("samples_per_s", "tokens_per_s", "batches_per_s",
                                                                 "rows_decoded_per_sample")}
        rows.append({"layout": layout, "world_size": world, "rank": rank, **med,
                     "samples_per_s_all": [g["samples_per_s"] for g in got]})
    payload = {"date": today(), "machine": machine(), "load_average": os.getloadavg(), "config": CONFIG,
               "command": f"python -m genrec.benchmarks.data_reader --users {args.users} --rounds {args.rounds} "
                          f"--every {args.every}",
               "data": data, "throughput": rows, "need": training_need(), "resume": resume}
    write_json("data_reader", payload)
    update_results_md()


# ----- RESULTS.md -----------------------------------------------------------------------------
def data_reader(d: dict) -> list[str]:
    """The RESULTS.md section of ``results/data_reader.json``."""
    from genrec.benchmarks.report import command, footer, num, table

    data, need, res = d["data"], d["need"], d["resume"]
    part = data["partitioned"]
    out = ["## Reading logs that outgrow one file (synthetic, date partitions)", "",
           f"Target (issue 35): a log of at least 10^7 events in 16+ files read faster than the training step "
           f"consumes it, and an exact resume across a kill. Log: {data['events']:,} events of {data['users']:,} "
           f"users in {part['files']} files ({part['row_groups']} row groups, {part['bytes'] / 2**20:.0f} MiB), "
           f"{data['layout']}; the reader of `{d['config']}` alone (batch 128, windows of 200 events), a whole "
           f"epoch, median of rounds.", ""]
    rows = []
    for r in d["throughput"]:
        who = "1 rank" if r["world_size"] == 1 else f"rank {r['rank']} of {r['world_size']}"
        rows.append(["date partitions" if r["layout"] == "partitioned" else "one file", who,
                     num(r["samples_per_s"], ",.0f"), num(r.get("tokens_per_s"), ",.0f"), num(r["batches_per_s"], ".1f"),
                     num(r["samples_per_s"] / need["samples_per_s"], ".0f", "x"),
                     num(r["rows_decoded_per_sample"], ".2f")])
    out += table(["layout", "reader", "samples/s", "tokens/s", "batches/s", "x the step's need",
                  "rows decoded a sample"], rows)
    out += ["", f"The step's need: {need['samples_per_s']:.0f} samples/s ({need['batch_size']} samples every "
            f"{need['s_per_step'] * 1e3:.0f} ms: the mean training step of `{need['config']}` on ML-1M, "
            f"`{need['source']}`, {need['date']}, {need['cpu']}).", "",
            f"Kill and resume (rank {res['rank']} of {res['world_size']}, {res['epoch_batches']} batches, "
            f"{res['samples']:,} samples, a checkpoint every {res['checkpoint_every']} batches): SIGKILLed after "
            f"{res['batches_logged_at_kill']} batches, resumed from the checkpoint at {res['checkpoint_batches']} "
            f"({res['redone_batches']} redone) in a fresh process: "
            + ("**the same samples in the same order** as an uninterrupted epoch." if res["exact"]
               else f"**differs** from an uninterrupted epoch at batch {res['first_difference']}.")]
    return out + footer(d, command(d, "python -m genrec.benchmarks.data_reader"))


def data_reader_summary(d: dict) -> tuple[str, str]:
    need = d["need"]["samples_per_s"]
    ranks = [r["samples_per_s"] for r in d["throughput"] if r["layout"] == "partitioned" and r["world_size"] > 1]
    return (f"{min(ranks):,.0f} samples/s a rank ({min(ranks) / need:.0f}x the step's need), "
            f"resume {'exact' if d['resume']['exact'] else 'NOT exact'}",
            ">= the step's need; exact resume")


if __name__ == "__main__":
    main()
