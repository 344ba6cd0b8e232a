"""Training jobs that explain themselves, measured on the ML-1M HSTU recipe: what the
always-on step accounting costs, whether its parts add up, the recipe's MFU, and what
bounds its step (from a profile).

One process runs the training loop of ``genrec train --config configs/hstu.toml`` (its
``Trainer.run_epoch``, the run directory in a temporary folder):

* bookkeeping: ``--steps`` steps with the accounting on; each metrics.jsonl train record's
  parts against its step time;
* A/B, paired and interleaved: ``--rounds`` rounds, each running the same ``--ab-steps``
  batches twice, once with the accounting on (``train.step_stats = true``, the default) and
  once off (the reader put back to the round's start in between), the order alternating
  round by round (ABBA). Pairing on the batches matters: a step's time follows its batch's
  lengths (0.1-1.1 s here), so arms on different batches differ by more than the accounting
  could cost. The overhead is the median of the rounds' on/off ratios, with their range. A
  machine shared with other work still moves between the two halves of a round, so the
  accounting's direct cost is measured too: its own calls (the marks, phases and
  per-interval record of a step, without the step) timed over many iterations, against the
  step time;
* MFU: model FLOPs a step (counted once) over the step time, against the matmul peak;
* a profile of ``--profile-steps`` steps (``train.observe.profiling``), its summary kept.

    python -m genrec.benchmarks.train_ops [--steps 40] [--rounds 6] [--ab-steps 16] [--profile-steps 8]

The matmul peak is measured afresh in the run (its cache in the temporary run folder), under
the same load as the steps it is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from genrec.benchmarks.common import dataset, machine, today, write_json
from genrec.train.data.reader import make_reader
from genrec.train.job import build_model, load_job
from genrec.train.loop.trainer import Trainer, build_optimizer
from genrec.train.observe.profiling import StepProfiler
from genrec.train.observe.stepstats import PARTS, StepStats


def build_trainer(config: str, run_dir: Path, threads: int) -> tuple[Trainer, Any]:
    """The one-process trainer ``genrec train`` builds for ``config`` on ML-1M, training
    only, and its job config."""
    job = load_job(config, [f'--data.path="{dataset("ml1m")}"', "--train.evaluate=false",
                            "--train.progress=false", f"--train.threads={threads}"])
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(job.train.matmul_precision)
    torch.manual_seed(job.train.seed)
    model, emb = build_model(job)
    reader = make_reader(job.data, "train", emb, job.model.max_seq_len, seed=job.train.seed)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job.train.optim)
    return Trainer(job.train, job.eval, run_dir, model, model, optimizer, reader, {}, {}), job


def run_steps(t: Trainer, n: int) -> float:
    """Runs ``n`` training steps (across epochs) with the trainer's loop; seconds a step."""
    target = t.state.step + n
    t.cfg = replace(t.cfg, max_steps=target)
    start, begun = time.perf_counter(), t.state.step
    while t.state.step < target:
        t.run_epoch()
        if t.state.stopped:
            t.state.stopped = ""
        else:  # the epoch ran out first
            t.state.epoch += 1
            t.train_reader.set_epoch(t.state.epoch)
    return (time.perf_counter() - start) / (t.state.step - begun)


def paired_rounds(t: Trainer, rounds: int, n: int) -> dict[bool, list[float]]:
    """``rounds`` rounds of ``n`` steps in each arm (accounting on, off), both arms of a round
    on the same batches (the reader is put back to the round's start between them), the
    order alternating round by round (ABBA); seconds a step, by arm, in round order."""
    arms: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        reader, epoch = t.train_reader.state_dict(), t.state.epoch
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            t.train_reader.load_state_dict(reader)
            t.state.epoch = epoch
            t.stats.enabled = on
            arms[on].append(run_steps(t, n))
            print(f"round {r} {'on ' if on else 'off'}: {arms[on][-1] * 1e3:.0f} ms a step", flush=True)
    t.stats.enabled = True
    return arms


def direct_cost(iterations: int = 20000, log_every: int = 20) -> dict[str, float]:
    """Microseconds a step of the accounting's own calls (on against off): the phases and
    marks a step makes and, once per ``log_every`` steps, the interval's record."""
    out = {}
    for enabled in (False, True):
        stats = StepStats(torch.device("cpu"), enabled)
        t = time.perf_counter()
        for i in range(iterations):
            for part in ("data", "optimizer", "forward", "backward", "optimizer"):
                with stats.phase(part):
                    pass
            stats.count_step()
            stats.mark("other")
            if i % log_every == 0:
                stats.take()
        out["on" if enabled else "off"] = 1e6 * (time.perf_counter() - t) / iterations
    out["cost_us"] = out["on"] - out["off"]
    return out


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/hstu.toml")
    ap.add_argument("--steps", type=int, default=40, help="accounted steps (bookkeeping, MFU)")
    ap.add_argument("--rounds", type=int, default=6, help="A/B rounds (ABBA)")
    ap.add_argument("--ab-steps", type=int, default=16, help="steps of each arm in a round")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        os.environ["GENREC_CACHE"] = tmp  # a matmul peak of this session's load
        t, job = build_trainer(args.config, run_dir, args.threads)
        run_steps(t, args.warmup)  # FLOP count, matmul peak, allocator and caches warm
        first = t.state.step
        print(f"accounted: {1e3 * run_steps(t, args.steps):.0f} ms a step", flush=True)
        accounted = (first, t.state.step)
        arms = paired_rounds(t, args.rounds, args.ab_steps)
        t.state.epoch += 1  # a profile stops at an epoch's end: give it a whole one
        t.train_reader.set_epoch(t.state.epoch)
        start = t.state.step + 2
        t.profiler = StepProfiler(f"{start}:{start + args.profile_steps}", run_dir, 0, None, t.stats)
        run_steps(t, args.profile_steps + 3)
        summary = (run_dir / "profile" / "summary_rank0.txt").read_text()
        recs = records(run_dir)

    ratios = [a / b for a, b in zip(arms[True], arms[False], strict=True)]
    on = statistics.median(arms[True])
    flops = next(r for r in recs if r["kind"] == "flops")
    # the train records of the accounted steps (the A/B's mix both arms in one interval)
    train = [r for r in recs if r["kind"] == "train" and "time_ms" in r and accounted[0] < r["step"] <= accounted[1]]
    gaps = [abs(sum(r["time_ms"][k] for k in PARTS) - r["time_ms"]["step"]) / r["time_ms"]["step"] for r in train]
    mean = {k: statistics.fmean(r["time_ms"][k] for r in train) for k in ("step", *PARTS)}
    direct = direct_cost()
    payload = {
        "date": today(),
        "machine": machine(),
        "load_average": os.getloadavg(),
        "config": args.config,
        "command": "python -m genrec.benchmarks.train_ops " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "config"),
        "batch_size": job.data.batch_size,
        "ab": {"rounds": args.rounds, "steps_per_arm": args.ab_steps, "on_s_per_step": arms[True],
               "off_s_per_step": arms[False], "overhead_median": statistics.median(ratios) - 1,
               "overhead_min": min(ratios) - 1, "overhead_max": max(ratios) - 1},
        "direct_cost": {**direct, "share_of_step": direct["cost_us"] * 1e-6 / on},
        "bookkeeping": {"records": len(train), "max_parts_gap": max(gaps), "mean_time_ms": mean},
        "flops": {k: flops[k] for k in ("flops_per_step", "counted", "peak_tflops", "peak", "compute_dtype", "device")},
        "tflops_median": statistics.median(r["tflops"] for r in train),
        "mfu_median": statistics.median(r["mfu"] for r in train),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in train),
        "profile_summary": summary.splitlines(),
    }
    print(json.dumps({k: v for k, v in payload.items() if k not in ("profile_summary", "ab")}, indent=1))
    print(json.dumps(payload["ab"], indent=1))
    print(summary)
    print(f"wrote {write_json('train_ops', payload)}")


def train_ops(d: dict) -> list[str]:
    from genrec.benchmarks.report import machine_text, num, table

    ab, bk, fl = d["ab"], d["bookkeeping"], d["flops"]
    parts = bk["mean_time_ms"]
    out = ["## Training jobs that explain themselves (ML-1M HSTU step, accounting on vs off)", "",
           "Targets (issue 35): the always-on accounting costs at most 2% of step time, and its parts add "
           "up to the step within 5%.", ""]
    out += table(["figure", "value"], [
        ["accounting cost (A/B, interleaved rounds)",
         f"{ab['overhead_median']:+.1%} median over {ab['rounds']} rounds "
         f"({ab['overhead_min']:+.1%} .. {ab['overhead_max']:+.1%})"],
        ["parts against the step time", f"largest gap {bk['max_parts_gap']:.1e} (relative)"],
        ["step split (ms)", ", ".join(f"{k} {v:.1f}" for k, v in parts.items())],
        ["model FLOPs per step", f"{fl['flops_per_step'] / 1e9:.1f} GFLOP ({fl['counted']})"],
        ["achieved / peak", f"{d['tflops_median'] * 1e3:.0f} / {fl['peak_tflops'] * 1e3:.0f} GFLOP/s "
                            f"({fl['peak']['dtype']}, matmul precision {fl['peak']['matmul_precision']})"],
        ["MFU", f"{d['mfu_median']:.1%}"],
        ["peak memory (RSS)", f"{num(d['peak_mem_mb'], '.0f')} MB"],
    ]) + [""]
    summary = d.get("profile_summary", [])
    head = summary[: summary.index("")] if "" in summary else summary  # the lines above the operator table
    out += ["Profile (the operator table is in the run's profile summary):", "", *(f"- {line}" for line in head), ""]
    out += [f"Machine: {machine_text(d['machine'])}; {d['date']}. Command: `{d['command']}`.", ""]
    return out


def train_ops_summary(d: dict) -> tuple[str, str]:
    return (f"accounting cost {d['ab']['overhead_median']:+.1%}; MFU {d['mfu_median']:.1%}",
            "<= 2% of step time")


if __name__ == "__main__":
    main()
