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
* a profile of ``--profile-steps`` steps (``train.observe.profiling``), its summary kept;
* precision, side by side (issue 47, ``precision`` in the JSON): the step as issue 47 found
  it (fp32, the coded PyTorch attention, PyTorch's dropout masks), the fp32 step now (the
  native attention and masks) and the bf16 step (``train.precision = "bf16"``: autocast
  tower, bf16 loss GEMMs), trainers built from the same seed (same initial weights), run on
  the same batches in alternating rounds, each with its own RNG stream; seconds a step (wall
  and process CPU time, the latter less moved by other work on a shared machine), each arm's
  speed-up over the first (median over rounds), MFU of each against the matmul peak of its
  precision measured in the same round (bf16 also against fp32's; the median over rounds of
  each round's ratio, since the machine's speed moves 2-3x between rounds; also against one
  peak measured after the rounds, as earlier records did), the loss of the fp32 and bf16 arms
  at every step (the same masks up to bf16 rounding: the trajectory within ``--loss-tol``),
  and each arm's peak RSS measured in a process of its own (one process holds every arm here).

    python -m genrec.benchmarks.train_ops [--steps 40] [--rounds 6] [--ab-steps 16] [--profile-steps 8]
        [--precision-rounds 8] [--precision-steps 3]

The matmul peak is measured afresh in the run (its cache in the temporary run folder), under
the same load as the steps it is compared with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import tempfile
import time
from collections.abc import Iterator
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


def build_trainer(config: str, run_dir: Path, threads: int, overrides: tuple[str, ...] = ()) -> tuple[Trainer, Any]:
    """The one-process trainer ``genrec train`` builds for ``config`` on ML-1M, training
    only, and its job config (``overrides``: dotted command-line overrides on top)."""
    job = load_job(config, [f'--data.path="{dataset("ml1m")}"', "--train.evaluate=false",
                            "--train.progress=false", f"--train.threads={threads}", *overrides])
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


# the arms of the precision comparison: the step as issue 47 found it (fp32, the coded PyTorch
# attention, dropout masks drawn by PyTorch's generator: `as_filed`), the fp32 step now (the
# native attention and masks where they build), and the bf16 step; speed-ups are over the first,
# the loss trajectory is compared between the last two (the same masks)
PRECISION_ARMS: dict[str, tuple[str, ...]] = {
    "as-filed": ('--train.precision="fp32"', '--model.hstu.attention_backend="coded"'),
    "fp32": ('--train.precision="fp32"',),
    "bf16": ('--train.precision="bf16"',),
}
BASE_ARM = "as-filed"


@contextlib.contextmanager
def as_filed(arm: str) -> Iterator[None]:
    """For the base arm, dropout draws its masks with PyTorch's generator, as the step did when
    issue 47 was filed (``kernels.dropout``'s fallback); other arms run unchanged."""
    if arm != BASE_ARM:
        yield
        return
    from genrec.kernels import dropout

    native = dropout.native_supported
    dropout.native_supported = lambda x: False
    try:
        yield
    finally:
        dropout.native_supported = native


def _arm_rss(config: str, threads: int, overrides: tuple[str, ...], steps: int, out: Any) -> None:
    """(A child process) ``steps`` steps of one arm; puts the process's peak RSS (MB) on ``out``."""
    import resource

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GENREC_CACHE"] = tmp
        t, _ = build_trainer(config, Path(tmp), threads, (*overrides, "--train.step_stats=false"))
        for _, batch in zip(range(steps), iter(t.train_reader)):
            t.train_step(batch)
    out.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def arm_peak_rss(config: str, threads: int, overrides: tuple[str, ...], steps: int = 4) -> float:
    """Peak RSS (MB) of a process that builds one arm's trainer and runs ``steps`` steps."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_arm_rss, args=(config, threads, overrides, steps, q))
    proc.start()
    try:
        while True:  # a child that fails says so instead of leaving the parent waiting
            with contextlib.suppress(queue.Empty):
                return float(q.get(timeout=5))
            if not proc.is_alive():
                raise RuntimeError(f"the memory probe of {overrides} exited with code {proc.exitcode}")
    finally:
        proc.join(timeout=60)


def compare_precisions(config: str, run_dir: Path, threads: int, rounds: int, steps: int,
                       loss_tol: float) -> dict[str, Any]:
    """The fp32 and bf16 steps side by side (see the module docstring): ``rounds`` rounds of
    ``steps`` batches, each round's batches run by both arms, the order alternating."""
    from genrec.train.observe.stepstats import count_model_flops, matmul_peak, measure_matmul_tflops

    trainers = {}
    for arm, over in PRECISION_ARMS.items():  # the same seed: the same initial weights and batches
        trainers[arm], _ = build_trainer(config, run_dir / arm, threads, (*over, "--train.step_stats=false"))
    first = trainers[BASE_ARM]
    batches = [b for _, b in zip(range(2 + rounds * steps), iter(first.train_reader))]
    seed_rng = torch.get_rng_state()
    rng = dict.fromkeys(trainers, seed_rng)
    wall: dict[str, list[float]] = {a: [] for a in trainers}
    cpu: dict[str, list[float]] = {a: [] for a in trainers}
    losses: dict[str, list[float]] = {a: [] for a in trainers}

    def run(arm: str, chunk: list) -> tuple[float, float]:
        torch.set_rng_state(rng[arm])
        w, c = time.perf_counter(), time.process_time()
        with as_filed(arm):
            for b in chunk:
                losses[arm].append(trainers[arm].train_step(b)["loss"])
        w, c = time.perf_counter() - w, time.process_time() - c
        rng[arm] = torch.get_rng_state()
        return w / len(chunk), c / len(chunk)

    for arm in trainers:  # warm-up (allocator, oneDNN primitives), the same two batches; not timed
        run(arm, batches[:2])
    dev = torch.device("cpu")
    dtypes = {a: torch.bfloat16 if a == "bf16" else torch.float32 for a in trainers}
    # each round's own matmul peaks: this machine moves 2-3x between rounds, so a step is compared
    # with the peak measured under the same load, beside it
    round_peaks: dict[torch.dtype, list[float]] = {dt: [] for dt in set(dtypes.values())}
    for r in range(rounds):
        chunk = batches[2 + r * steps: 2 + (r + 1) * steps]
        for arm in (list(trainers) if r % 2 == 0 else list(trainers)[::-1]):
            w, c = run(arm, chunk)
            wall[arm].append(w)
            cpu[arm].append(c)
        for dt, got in round_peaks.items():
            got.append(measure_matmul_tflops(dev, dt, seconds=0.15))
        print(f"precision round {r}: " + ", ".join(f"{a} {wall[a][-1] * 1e3:.0f} ms ({cpu[a][-1] * 1e3:.0f} ms cpu)"
                                                  for a in trainers)
              + "; peaks " + ", ".join(f"{str(dt).removeprefix('torch.')} {v[-1] * 1e3:.0f}" for dt, v in round_peaks.items())
              + " GFLOP/s", flush=True)
    # FLOPs of each timed batch (the same model FLOPs in both arms), counted on a model of its own
    # state: the fp32 arm's, its gradients dropped afterwards
    counter, _ = build_trainer(config, run_dir / "count", threads, ('--train.precision="fp32"', "--train.step_stats=false"))
    flops = []
    for b in batches[2:]:
        flops.append(count_model_flops(counter.model, b, contextlib.nullcontext)[0])
        counter.optimizer.zero_grad(set_to_none=True)
    per_round = [sum(flops[r * steps:(r + 1) * steps]) / steps for r in range(rounds)]
    peaks = {a: matmul_peak(dev, dtypes[a], run_dir) for a in trainers}
    fp32 = round_peaks[torch.float32]
    arms: dict[str, Any] = {}
    for a in trainers:
        rates = [f / w / 1e12 for f, w in zip(per_round, wall[a], strict=True)]
        own = round_peaks[dtypes[a]]
        achieved = statistics.median(rates)
        arms[a] = {"s_per_step": wall[a], "cpu_s_per_step": cpu[a], "median_s": statistics.median(wall[a]),
                   "tflops_median": achieved, "peak": peaks[a], "round_peaks_tflops": own,
                   # MFU: the median over rounds of each round's rate against that round's peak
                   "mfu": statistics.median(x / p for x, p in zip(rates, own, strict=True)),
                   "mfu_vs_fp32_peak": statistics.median(x / p for x, p in zip(rates, fp32, strict=True)),
                   "mfu_rounds": [x / p for x, p in zip(rates, own, strict=True)],
                   # against one peak measured after the rounds (the method of earlier records)
                   "mfu_single_peak": achieved / peaks[a]["tflops"], "loss": losses[a]}
    gaps = [abs(x - y) for x, y in zip(losses["fp32"], losses["bf16"], strict=True)]

    def ratios(times: dict[str, list[float]], arm: str) -> list[float]:
        return [a / b for a, b in zip(times[BASE_ARM], times[arm], strict=True)]

    speedups = {a: {"median": statistics.median(ratios(wall, a)), "range": [min(ratios(wall, a)), max(ratios(wall, a))],
                    "cpu_median": statistics.median(ratios(cpu, a))} for a in trainers if a != BASE_ARM}
    return {
        "rounds": rounds, "steps_per_round": steps, "threads": threads,
        "arms": arms,
        "base": BASE_ARM, "speedups": speedups,
        "bf16_over_fp32": statistics.median(a / b for a, b in zip(wall["fp32"], wall["bf16"], strict=True)),
        "flops_per_step_mean": statistics.fmean(flops),
        "loss_steps": len(gaps), "loss_max_abs_gap": max(gaps), "loss_tol": loss_tol,
        "loss_within_tol": max(gaps) <= loss_tol,
        "loss_first_last": {a: [losses[a][0], losses[a][-1]] for a in trainers},
        "compile": {"used": False, "why": "eager: neither arm compiles (train.compile = false); see the dated note"},
    }


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
    ap.add_argument("--precision-rounds", type=int, default=8, help="fp32 / bf16 side-by-side rounds (ABBA); 0: skip")
    ap.add_argument("--precision-steps", type=int, default=3, help="batches of each arm in a round")
    ap.add_argument("--loss-tol", type=float, default=0.01, help="largest |fp32 - bf16| loss at any compared step")
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
        precision = None
        if args.precision_rounds:
            precision = compare_precisions(args.config, run_dir / "precision", args.threads, args.precision_rounds,
                                           args.precision_steps, args.loss_tol)
            for arm, over in PRECISION_ARMS.items():
                precision["arms"][arm]["peak_rss_mb"] = arm_peak_rss(args.config, args.threads, over)

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
        "precision": precision,
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
        ["loop's achieved / peak", f"{d['tflops_median'] * 1e3:.0f} / {fl['peak_tflops'] * 1e3:.0f} GFLOP/s "
                            f"({fl['peak']['dtype']}, matmul precision {fl['peak']['matmul_precision']})"],
        ["loop's MFU (its intervals)", f"{d['mfu_median']:.1%}"],
        ["peak memory (RSS)", f"{num(d['peak_mem_mb'], '.0f')} MB"],
    ]) + [""]
    out += precision_section(d.get("precision"))
    summary = d.get("profile_summary", [])
    head = summary[: summary.index("")] if "" in summary else summary  # the lines above the operator table
    out += ["Profile (the operator table is in the run's profile summary):", "", *(f"- {line}" for line in head), ""]
    out += [f"Machine: {machine_text(d['machine'])}; {d['date']}. Command: `{d['command']}`.", ""]
    return out


def precision_section(p: dict | None) -> list[str]:
    """The fp32 / bf16 side-by-side table (issue 47), or nothing when the run skipped it."""
    if not p:
        return []
    from genrec.benchmarks.report import table

    arms = p["arms"]
    base = p["base"]
    out = [f"Training steps side by side (issue 47: at least 1.8x the step as it was, `{base}`; MFU at least 30%): "
           f"{p['rounds']} rounds of {p['steps_per_round']} batches, every arm on each round's batches, alternating "
           f"order, {p['threads']} threads:", ""]
    rows = []
    for name, a in arms.items():
        rows.append([name, f"{a['median_s'] * 1e3:.0f}", f"{a['tflops_median'] * 1e3:.0f}",
                     f"{a['mfu']:.1%} of {a['peak']['dtype']} "
                     + (f"{min(a['round_peaks_tflops']) * 1e3:.0f}-{max(a['round_peaks_tflops']) * 1e3:.0f} (by round)"
                        if "round_peaks_tflops" in a else f"{a['peak']['tflops'] * 1e3:.0f}"),
                     f"{a['mfu_vs_fp32_peak']:.1%}", f"{a.get('peak_rss_mb', float('nan')):.0f}",
                     f"{a['loss'][0]:.4f} -> {a['loss'][-1]:.4f}"])
    out += table(["arm", "ms/step (median)", "GFLOP/s", "MFU (own peak)", "MFU (fp32 peak)", "peak RSS MB",
                  "loss first -> last"], rows)
    said = "; ".join(f"{arm} {s['median']:.2f}x wall (rounds {s['range'][0]:.2f}-{s['range'][1]:.2f}x), "
                     f"{s['cpu_median']:.2f}x process CPU time" for arm, s in p["speedups"].items())
    out += ["", f"Speed-up over `{base}`: {said}. Loss gap between fp32 and bf16 over {p['loss_steps']} steps at most "
            f"{p['loss_max_abs_gap']:.4f} (tolerance {p['loss_tol']}: {'within' if p['loss_within_tol'] else 'OUTSIDE'}).",
            ""]
    return out


def train_ops_summary(d: dict) -> tuple[str, str]:
    p = d.get("precision")
    if p:
        best = max(p["speedups"], key=lambda a: p["speedups"][a]["median"])
        return (f"accounting {d['ab']['overhead_median']:+.1%}; {best} {p['speedups'][best]['median']:.2f}x "
                f"{p['base']}, MFU {p['arms'][best]['mfu']:.1%}", "<= 2%; >= 1.8x, MFU >= 30%")
    return (f"accounting cost {d['ab']['overhead_median']:+.1%}; MFU {d['mfu_median']:.1%}",
            "<= 2% of step time")


if __name__ == "__main__":
    main()
