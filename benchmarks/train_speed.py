"""Training throughput: the default ML-1M HSTU step vs a naive padded eager HSTU.

Both run the same model (same parameters, same loss, same optimizer) on real ML-1M
batches in one process, interleaved round by round so machine noise hits both alike:

* naive: shuffled batches padded to max_seq_len (200), ``HSTUTower.forward_padded``
  (dense [B, L, L] attention over every padded slot), eager PyTorch, the full-softmax loss
  over materialised [tokens, catalogue] logits: the plain formulation;
* default: what ``genrec train --config configs/hstu.toml`` runs: length-sorted windows,
  jagged rows, attention padded only to each batch's longest sequence (+ compile when the
  config says so), the chunked full-softmax loss of ``kernels.softmax_ce``.

Measured for the shipped head (full softmax over the catalogue) and for the sampled-softmax
head (128 shared negatives, what large catalogues use), each pair in the same rounds. The
share of the step spent in the retrieval loss (identical work in both paths) is timed too:
it bounds what any tower speed-up can give.

    python -m genrec.benchmarks.train_speed [--steps 20] [--rounds 3] [--threads 2] [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from genrec.benchmarks.common import dataset, machine, today, update_results_md, write_json
from genrec.kernels.jagged import jagged_to_padded
from genrec.models.inputs import SequenceBatch
from genrec.models.recommender import GenerativeRecommender
from genrec.train.data.reader import make_reader
from genrec.train.job import build_model, load_job, resolve_precision
from genrec.train.loop.trainer import build_optimizer


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
    return plain_loss(model, h[valid], batch.targets)


def plain_loss(model: GenerativeRecommender, users: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The retrieval loss written the plain way: full softmax materialises the [T, N] logits
    (the default path uses kernels.softmax_ce); sampled softmax is the model's own."""
    head = model.head
    if head.cfg.loss != "full_softmax":
        return head.loss(users, targets, model.corpus_ids, model.sparse.lookup)
    items = head.normalize(model.sparse.lookup(model.corpus_ids))
    logits = head.scores(head.normalize(users), items)
    return F.cross_entropy(logits, torch.searchsorted(model.corpus_ids, targets))


def time_steps(step, batches: list[SequenceBatch]) -> float:
    """Seconds per step (the whole list; the first batch warms up and is not timed)."""
    step(batches[0])
    t0 = time.perf_counter()
    for b in batches[1:]:
        step(b)
    return (time.perf_counter() - t0) / (len(batches) - 1)


def measure(job, steps: int, rounds: int, label: str) -> dict:
    torch.manual_seed(0)
    model, emb = build_model(job)
    opt = build_optimizer(list(model.parameters()), job.train.optim)
    msl = job.model.max_seq_len
    fast_batches = [b for _, b in zip(range(steps + 1), make_reader(job.data, "train", emb, msl))]
    naive_batches = [b for _, b in zip(range(steps + 1), make_reader(replace(job.data, sort_window=0), "train", emb, msl))]

    amp = resolve_precision(job.train.precision, None) == "bf16"

    def step_with(loss_fn):
        def step(b: SequenceBatch) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    if job.train.compile:
        model.tower.compile(dynamic=True)
    prec = job.train.matmul_precision

    def under(precision: str, step):
        def run(b: SequenceBatch) -> None:
            torch.set_float32_matmul_precision(precision)
            step(b)
        return run

    # the naive path runs with torch's defaults (fp32 GEMMs at "highest"); the default path
    # with the config's matmul precision; the naive path is timed under it too, so the
    # ratio can be split into the GEMM setting and everything else
    naive = step_with(lambda b: naive_loss(model, b))
    naive_step, naive_same_step = under("highest", naive), under(prec, naive)
    fast_step = under(prec, step_with(lambda b: model(b)["loss"]))

    # the default path's retrieval loss alone (logits over the catalogue or the negatives, forward + backward)
    hidden = {id(b): torch.randn(b.targets.numel(), emb.item_table.dim, requires_grad=True) for b in fast_batches}
    loss_step = under(prec, step_with(
        lambda b: model.head.loss(hidden[id(b)], b.targets, model.corpus_ids, model.sparse.lookup)))
    naive_s, same_s, fast_s, loss_s = [], [], [], []
    for r in range(rounds):
        naive_s.append(time_steps(naive_step, naive_batches))
        if prec != "highest":
            same_s.append(time_steps(naive_same_step, naive_batches))
        fast_s.append(time_steps(fast_step, fast_batches))
        loss_s.append(time_steps(loss_step, fast_batches))
        print(f"{label} round {r}: naive {naive_s[-1]:.3f} s/step, default {fast_s[-1]:.3f} s/step, "
              f"loss alone {loss_s[-1]:.3f} s" + (f", naive at {prec} {same_s[-1]:.3f} s" if same_s else ""),
              flush=True)
    torch.set_float32_matmul_precision("highest")
    bs = job.data.batch_size
    n, f, ls = statistics.median(naive_s), statistics.median(fast_s), statistics.median(loss_s)
    out = {"naive_padded_eager": {"s_per_step": n, "sequences_per_s": bs / n, "all": naive_s,
                                  "matmul_precision": "highest"},
           "default": {"s_per_step": f, "sequences_per_s": bs / f, "all": fast_s, "matmul_precision": prec,
                       "compile": job.train.compile, "sort_window": job.data.sort_window},
           "loss_alone_s": ls, "loss_share_of_default_step": ls / f, "speedup": n / f}
    if same_s:
        m = statistics.median(same_s)
        out["naive_same_matmul_precision"] = {"s_per_step": m, "all": same_s, "matmul_precision": prec}
        out["speedup_same_matmul_precision"] = m / f
    return out


def loss_error(precision: str) -> dict[str, dict[str, float]]:
    """The chunked full-softmax loss and its gradients at ``precision`` and at "highest" vs
    fp64, on an ML-1M-sized problem (unit vectors, temperature 0.05)."""
    from genrec.kernels.softmax_ce import softmax_cross_entropy

    g = torch.Generator().manual_seed(0)
    u = F.normalize(torch.randn(13_800, 64, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    it = F.normalize(torch.randn(3_706, 64, generator=g, dtype=torch.float64), dim=-1).requires_grad_()
    idx = torch.randint(3_706, (13_800,), generator=g)
    ref = F.cross_entropy(u @ it.t() * 20.0, idx)
    ref_g = torch.autograd.grad(ref, (u, it))
    out = {}
    for p in dict.fromkeys(["highest", precision]):
        torch.set_float32_matmul_precision(p)
        u32, it32 = u.detach().float().requires_grad_(), it.detach().float().requires_grad_()
        loss = softmax_cross_entropy(u32, it32, idx, 20.0)
        grads = torch.autograd.grad(loss, (u32, it32))
        rel = max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_g))
        out[p] = {"loss_abs_err": abs(loss.item() - ref.item()), "grad_rel_err": rel}
    torch.set_float32_matmul_precision("highest")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/hstu.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="also time the shipped config under bf16 autocast")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = dataset("ml1m")
    base = [f'--data.path="{data}"']
    shipped = load_job(args.config, base)
    variants = {f"shipped head ({shipped.model.retrieval.loss})": shipped,
                "sampled softmax, 128 negatives": load_job(args.config, base + [
                    '--model.retrieval.loss="sampled_softmax"', "--model.retrieval.num_negatives=128"])}
    if args.bf16:
        variants["shipped head, bf16 autocast (loss kept fp32)"] = load_job(
            args.config, base + ['--train.precision="bf16"'])
    res = {k: measure(j, args.steps, args.rounds, k) for k, j in variants.items()}
    err = loss_error(shipped.train.matmul_precision)
    bs = shipped.data.batch_size
    result = {"date": today(), "machine": machine(), "config": args.config, "batch_size": bs,
              "steps_per_round": args.steps, "rounds": args.rounds, "variants": res, "loss_error_vs_fp64": err,
              "speedup": next(iter(res.values()))["speedup"], "goal": 3.0}
    write_json("train_speed", result)
    update_results_md()
    for k, r in res.items():
        print(f"{k}: speedup {r['speedup']:.2f}x, loss share {100 * r['loss_share_of_default_step']:.0f}%")


if __name__ == "__main__":
    main()
