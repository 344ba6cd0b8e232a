"""Training throughput: the default ML-1M HSTU step vs a naive padded eager HSTU.

Both run the same model (same parameters, same loss, same optimizer) on real ML-1M
batches in one process, interleaved round by round so machine noise hits both alike:

* naive: shuffled batches padded to max_seq_len (200), ``HSTUTower.forward_padded``
  (dense [B, L, L] attention over every padded slot), eager PyTorch: the formulation of
  the original HSTU code;
* default: what ``genrec train --config configs/hstu.toml`` runs: length-sorted windows,
  jagged rows, attention padded only to each batch's longest sequence (+ compile when the
  config says so).

    python -m benchmarks.train_speed [--steps 20] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from benchmarks.common import dataset, machine, today, update_results_md, write_json
from kernels.jagged import jagged_to_padded
from models.inputs import SequenceBatch
from models.recommender import GenerativeRecommender
from train.data.reader import make_reader
from train.job import build_model, load_job
from train.trainer import build_optimizer


def naive_loss(model: GenerativeRecommender, batch: SequenceBatch) -> torch.Tensor:
    """The padded formulation: every sequence padded to max_seq_len, dense masked attention."""
    n = model.cfg.max_seq_len
    lengths = batch.lengths
    offsets = batch.seq.offsets()[: batch.batch_size + 1]
    ids = jagged_to_padded(batch.seq.values(), offsets, n)  # pad id 0
    x = model.sparse.lookup(ids.reshape(-1)).view(*ids.shape, -1)
    pos = torch.arange(n)
    x = model.input_dropout(x * model.scale + model.pos_emb(pos)[None])
    valid = pos[None, :] < lengths[:, None]
    real = batch.has_time[:, None]
    ts = torch.where(real, jagged_to_padded(batch.timestamps, offsets, n), pos[None])
    qt = torch.where(real, jagged_to_padded(batch.query_times, offsets, n), pos[None] + 1)
    h = model.tower.forward_padded(x, lengths, ts, qt)
    return model.head.loss(h[valid], batch.targets, model.corpus_ids, model.sparse.lookup)


def time_steps(step, batches: list[SequenceBatch]) -> float:
    """Seconds per step (the whole list; the first batch warms up and is not timed)."""
    step(batches[0])
    t0 = time.perf_counter()
    for b in batches[1:]:
        step(b)
    return (time.perf_counter() - t0) / (len(batches) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/hstu.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = dataset("ml1m")
    job = load_job(args.config, [f'--data.path="{data}"'])
    torch.manual_seed(0)
    model, emb = build_model(job)
    opt = build_optimizer(list(model.parameters()), job.train.optim)
    msl = job.model.max_seq_len
    fast_reader = make_reader(job.data, "train", emb, msl)
    naive_reader = make_reader(replace(job.data, sort_window=0), "train", emb, msl)
    fast_batches = [b for _, b in zip(range(args.steps + 1), fast_reader)]
    naive_batches = [b for _, b in zip(range(args.steps + 1), naive_reader)]

    def step_with(loss_fn):
        def step(b: SequenceBatch) -> None:
            loss = loss_fn(b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    fast_model = model
    if job.train.compile:
        model.tower.compile(dynamic=True)
    naive_step, fast_step = step_with(lambda b: naive_loss(model, b)), step_with(lambda b: fast_model(b)["loss"])
    naive_s, fast_s = [], []
    for r in range(args.rounds):
        naive_s.append(time_steps(naive_step, naive_batches))
        fast_s.append(time_steps(fast_step, fast_batches))
        print(f"round {r}: naive {naive_s[-1]:.3f} s/step, default {fast_s[-1]:.3f} s/step")
    bs = job.data.batch_size
    naive_med, fast_med = statistics.median(naive_s), statistics.median(fast_s)
    result = {
        "date": today(),
        "machine": machine(),
        "config": args.config,
        "batch_size": bs,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "naive_padded_eager": {"s_per_step": naive_med, "sequences_per_s": bs / naive_med, "all": naive_s},
        "default": {"s_per_step": fast_med, "sequences_per_s": bs / fast_med, "all": fast_s,
                    "compile": job.train.compile, "sort_window": job.data.sort_window},
        "speedup": naive_med / fast_med,
        "goal": 3.0,
    }
    write_json("train_speed", result)
    m = result["machine"]
    update_results_md("train_speed", "\n".join([
        "## Training throughput (ML-1M HSTU step)",
        "",
        f"`python -m benchmarks.train_speed` — {today()}, {m['cpu']}, {m['threads']} threads, torch {m['torch']}.",
        "Same model, loss and optimizer; batches of 128 real ML-1M sequences; median of "
        f"{args.rounds} interleaved rounds of {args.steps} steps.",
        "",
        "| path | s/step | sequences/s | ratio |",
        "|---|---|---|---|",
        f"| naive padded eager HSTU (pad to 200) | {naive_med:.3f} | {bs / naive_med:.0f} | 1.00x |",
        f"| default (`{args.config}`) | {fast_med:.3f} | {bs / fast_med:.0f} | **{result['speedup']:.2f}x** |",
        "",
        "Goal: 3x or more.",
    ]))
    print(f"speedup {result['speedup']:.2f}x (naive {bs / naive_med:.0f} seq/s, default {bs / fast_med:.0f} seq/s)")


if __name__ == "__main__":
    main()
