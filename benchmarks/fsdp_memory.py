"""FSDP against DDP for an HSTU-large-sized tower on 2 ranks: per-rank memory and step time.

    python -m genrec.benchmarks.fsdp_memory [--layers 24 --dim 1024 --heads 8 --steps 3]

The shape (``configs/hstu_large_fsdp.toml``). 24 HSTU layers of width 1024 (8 heads of 128; ~5.2M weights a layer, 126M in the
tower): the depth and width at the top of the dense shapes HSTU is reported at, and the size
where the tower, not the tables, sets a rank's memory: fp32 weights + gradients + AdamW's two
moments are 16 bytes a weight, 2.0 GB per rank under DDP, before one activation is kept. On a
device of M bytes DDP stops at the tower whose 16 B/weight (+ DDP's gradient buckets) fills
M; FSDP divides that by the world size. The catalogue is small (a synthetic log of 2,000 items,
item table row-wise sharded by TorchRec as in every dmp run), so the dense part is what differs.

Each variant trains the same seeded model on the same batches with ``train.loop.parallel``'s
code (``parallelize``: DMP tables + DDP or FSDP2 dense), 2 processes over gloo:

* ``ddp``: the dense part replicated (today's default);
* ``fsdp``: fully sharded, fp32; ``fsdp_ac``: + activation checkpointing per layer;
  ``fsdp_bf16_ac``: + bf16 layer compute (fp32 master weights, reductions and logits).

Per rank it measures: dense parameter bytes held (a DTensor's local shard), gradient bytes,
optimizer-state bytes, activation bytes saved for backward in one forward (every tensor the
autograd graph saved, weights excluded, by storage), the largest transient all-gather (one
layer's unsharded weights, FSDP), peak RSS, and the median step time; and each step's loss
(FSDP's must equal DDP's within reduction order). On this 2-core machine both ranks share the
cores and gloo runs over loopback: the step-time ratio shows the overhead of FSDP's per-layer
all-gathers and reduce-scatters relative to compute, not a cluster's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _variant(dense: str, ac: bool, dtype: str = "fp32") -> list[str]:
    return [f'--train.parallel.dense="{dense}"', f"--train.parallel.activation_checkpointing={str(ac).lower()}",
            f'--train.parallel.fsdp_param_dtype="{dtype}"']


CONFIG = "configs/hstu_large_fsdp.toml"  # the shape (24 x 1024 by default); each variant sets its parallel keys
VARIANTS = {"ddp": _variant("ddp", False), "fsdp": _variant("fsdp", False), "fsdp_ac": _variant("fsdp", True),
            "fsdp_bf16_ac": _variant("fsdp", True, "bf16")}


def overrides(data: Path, a: argparse.Namespace) -> list[str]:
    return [f'--data.path="{data}"', f"--data.batch_size={a.batch}", f"--model.max_seq_len={a.seq}",
            "--model.input_dropout=0.0", f"--model.hstu.num_layers={a.layers}", f"--model.hstu.num_heads={a.heads}",
            f"--model.hstu.qk_dim={a.dim // a.heads}", f"--model.hstu.v_dim={a.dim // a.heads}",
            "--model.hstu.dropout=0.0", f'--embedding.tables=[{{name="item", features=["item"], dim={a.dim}, '
            'sharding="row_wise", init_std=0.02}]', "--train.optim.warmup_steps=0"]


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(ts: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts if t is not None)


def rss_mb(trim: bool = False) -> float:
    """This process's resident memory now; ``trim``: after handing freed heap back to the OS
    (glibc's malloc_trim), so it counts live memory rather than the allocator's high-water."""
    from genrec.train.loop.trainer import release_free_memory, rss_bytes

    if trim:
        release_free_memory()
    return (rss_bytes() or 0) / 2**20


def worker(a: argparse.Namespace) -> None:
    """One rank of one variant (under torchrun): trains ``a.steps`` + 1 steps, writes its figures."""
    import torch

    from genrec.train.data.reader import make_reader
    from genrec.train.job import build_model, load_job
    from genrec.train.loop.parallel import init_distributed, parallelize
    from genrec.train.loop.trainer import build_optimizer

    torch.set_num_threads(1)
    job = load_job(CONFIG, overrides(Path(a.data), a) + VARIANTS[a.variant])
    ctx = init_distributed(job.train.parallel)
    torch.manual_seed(0)
    model, emb = build_model(job, sparse_device=torch.device("meta"))
    per_rank = job.data.batch_size // ctx.world_size
    cfg = job.data.__class__(**{**job.data.__dict__, "batch_size": per_rank})
    reader = make_reader(cfg, "train", emb, job.model.max_seq_len, seed=0, rank=ctx.rank, world_size=ctx.world_size)
    batches = [b for _, b in zip(range(a.steps + 1), reader)]
    rss = {"built": rss_mb(trim=True)}
    par = parallelize(model, emb, job.train.parallel, job.train.optim.lr,
                      lambda ps: build_optimizer(list(ps), job.train.optim), ctx, per_rank)
    rss["parallelized"] = rss_mb(trim=True)
    tower_weights = sum(p.numel() for p in par.module.tower.parameters())  # DTensor numel: the whole tensor
    layer = par.module.tower.layers[0]
    layer_bytes = sum(p.numel() * (2 if job.train.parallel.fsdp_param_dtype == "bf16" else 4) for p in layer.parameters())

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        weights = {_local(p).untyped_storage().data_ptr() for p in par.module.parameters()}
        s = t.untyped_storage()
        if s.data_ptr() not in weights and not isinstance(t, torch.nn.Parameter):
            saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
        return t

    def layer_input(_: torch.nn.Module, args: tuple) -> None:
        # a checkpointed layer keeps its input for the recomputation outside autograd's saved
        # tensors (in checkpoint's frame); counted here, once per storage as everything else
        if torch.is_grad_enabled() and hooks_on[0]:
            s = args[0].untyped_storage()
            saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())

    hooks_on = [False]
    for lay in par.module.tower.layers:
        lay.register_forward_pre_hook(layer_input)
    times, losses, grads = [], [], 0
    for i, b in enumerate(batches):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if i == 1:
            hooks_on[0] = True
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = par.model(b)["loss"]
            hooks_on[0] = False
        else:
            loss = par.model(b)["loss"]
        loss.backward()
        if i == 1:
            grads = _bytes(p.grad for p in par.dense_params)
        par.optimizer.step()
        par.optimizer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        if i > 0:  # the first step builds optimizer state and warms caches
            times.append(time.perf_counter() - t0)
        rss[f"after_step_{i}"] = rss_mb(trim=True)
        losses.append(float(loss))
    state = par.dense_optimizer.state
    optim = sum(_bytes(v for v in s.values() if torch.is_tensor(v)) for s in state.values())
    out = {"rank": ctx.rank, "variant": a.variant, "tower_weights": tower_weights,
           "dense_param_bytes": _bytes(par.dense_params), "grad_bytes": grads, "optimizer_bytes": optim,
           "activation_bytes": sum(saved.values()), "largest_all_gather_bytes": layer_bytes if "fsdp" in a.variant else 0,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "live_rss_mb": rss,
           "s_per_step": statistics.median(times), "losses": losses,
           "tokens": int(sum(int(b.seq.lengths().sum()) for b in batches) // 2 // len(batches))}
    Path(a.out, f"{a.variant}.rank{ctx.rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def summarize(ranks: dict[str, list[dict]], a: argparse.Namespace) -> dict:
    base = ranks["ddp"]
    per = {}
    for name, rs in ranks.items():
        r = max(rs, key=lambda x: x["dense_param_bytes"] + x["optimizer_bytes"])  # the fuller rank
        po = r["dense_param_bytes"] + r["optimizer_bytes"]
        b = max(base, key=lambda x: x["dense_param_bytes"] + x["optimizer_bytes"])
        gaps = [abs(x - y) / abs(y) for x, y in zip(r["losses"], b["losses"])]
        per[name] = {
            "dense_param_mb": r["dense_param_bytes"] / 2**20, "grad_mb": r["grad_bytes"] / 2**20,
            "optimizer_mb": r["optimizer_bytes"] / 2**20, "activation_mb": r["activation_bytes"] / 2**20,
            "largest_all_gather_mb": r["largest_all_gather_bytes"] / 2**20,
            "param_optim_ratio_vs_ddp": po / (b["dense_param_bytes"] + b["optimizer_bytes"]),
            "param_optim_grad_act_ratio_vs_ddp": (po + r["grad_bytes"] + r["activation_bytes"])
            / (b["dense_param_bytes"] + b["optimizer_bytes"] + b["grad_bytes"] + b["activation_bytes"]),
            "peak_rss_mb_per_rank": [x["peak_rss_mb"] for x in rs],
            "live_rss_mb_per_rank": [x["live_rss_mb"][f"after_step_{a.steps}"] for x in rs],
            "live_rss_mb_stages_rank0": rs[0]["live_rss_mb"],
            "s_per_step_rounds": [max(x) for x in zip(*(y["s_per_step_rounds"] for y in rs))],
            "s_per_step": max(x["s_per_step"] for x in rs),
            "step_time_ratio_vs_ddp": max(x["s_per_step"] for x in rs) / max(x["s_per_step"] for x in base),
            "losses": r["losses"], "max_rel_loss_gap_vs_ddp": max(gaps)}
    r0 = base[0]
    return {"shape": {"layers": a.layers, "dim": a.dim, "heads": a.heads, "tower_weights": r0["tower_weights"],
                      "global_batch": a.batch, "max_seq_len": a.seq, "tokens_per_rank_step": r0["tokens"],
                      "steps_timed": a.steps, "rounds": a.rounds, "world_size": 2},
            "variants": per}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="global batch (users)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="launches of each variant, interleaved (step time: median)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--name", default="fsdp_memory", help="benchmarks/results/<name>.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    from genrec.benchmarks.common import ROOT, machine, today, update_results_md, write_json
    from genrec.train.data.synthetic import SyntheticConfig, generate

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate(SyntheticConfig(num_users=200, num_items=2000, num_topics=8, median_len=40, max_len=80, seed=3),
                 data, progress=False)
        ranks: dict[str, list[dict]] = {}
        names = [v.strip() for v in a.variants.split(",")]
        order = ["ddp"] + [n for n in names if n != "ddp"]
        for rnd in range(a.rounds):  # interleaved rounds: noise from the shared cores hits every variant alike
            for name in order if rnd % 2 == 0 else order[::-1]:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                       "genrec.benchmarks.fsdp_memory", "--worker", "--variant", name, "--data", str(data), "--out", tmp,
                       *(f"--{k}={getattr(a, k)}" for k in ("layers", "dim", "heads", "batch", "seq", "steps"))]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
                got = [json.loads(Path(tmp, f"{name}.rank{r}.json").read_text()) for r in range(2)]
                if name not in ranks:
                    ranks[name] = got
                for mine, new in zip(ranks[name], got):
                    mine.setdefault("s_per_step_rounds", []).append(new["s_per_step"])
                    mine["s_per_step"] = statistics.median(mine["s_per_step_rounds"])
                print(name, rnd, json.dumps({k: v for k, v in got[0].items() if k != "losses"}), flush=True)
    result = {"date": today(), "machine": machine(), **summarize(ranks, a)}
    write_json(a.name, result)
    update_results_md()


NAMES = {"ddp": "DDP", "fsdp": "FSDP", "fsdp_ac": "FSDP + act. ckpt", "fsdp_bf16_ac": "FSDP + act. ckpt + bf16"}


def fsdp_memory(d: dict) -> list[str]:
    """The DETAILS.md section of ``results/fsdp_memory.json`` (a list, no table: RESULTS.md,
    near its size limit, then carries the glance line alone)."""
    from genrec.benchmarks.report import command, footer, get, num

    sh = d.get("shape") or {}
    out = ["## FSDP memory", "",
           f"An HSTU tower of {num(sh.get('layers'), 'd')} layers x {num(sh.get('dim'), 'd')} "
           f"({num(get(sh, 'heads'), 'd')} heads; {num((sh.get('tower_weights') or 0) / 1e6, '.1f')}M weights) on "
           f"{num(sh.get('world_size'), 'd')} ranks over gloo, item table row-wise (TorchRec), the same seed and "
           f"batches ({num(sh.get('global_batch'), 'd')} users, ~{num(sh.get('tokens_per_rank_step'), 'd')} "
           "tokens a rank a step). Per rank (the fuller one): dense weights + AdamW state (the target: "
           "<= 0.55x DDP), gradients, activations saved for backward (weights excluded), the largest "
           "all-gather; the process's resident memory after the steps (freed heap handed back first: live "
           "memory, with the libraries and tables) and its peak (the allocator's high-water, which also "
           "holds the whole tower built on every rank before it is sharded, and the first optimizer "
           "step's temporaries); seconds a step (median of interleaved launches) and the ratio to DDP (2 "
           "cores shared by both ranks and other work: overhead, not speed-up), and the largest relative "
           "loss gap to DDP over the steps.", ""]
    for k, v in (d.get("variants") or {}).items():
        out.append(f"- **{NAMES.get(k, k)}**: weights {num(v.get('dense_param_mb'), '.0f')} MB + optimizer "
                   f"{num(v.get('optimizer_mb'), '.0f')} MB = {num(v.get('param_optim_ratio_vs_ddp'), '.3f')}x DDP; "
                   f"gradients {num(v.get('grad_mb'), '.0f')} MB, activations {num(v.get('activation_mb'), '.0f')} MB "
                   f"(all four: {num(v.get('param_optim_grad_act_ratio_vs_ddp'), '.3f')}x DDP), all-gather "
                   f"{num(v.get('largest_all_gather_mb'), '.0f')} MB; RSS after the steps "
                   f"{' / '.join(num(x, '.0f') for x in v.get('live_rss_mb_per_rank') or [])} MB, peak "
                   f"{' / '.join(num(x, '.0f') for x in v.get('peak_rss_mb_per_rank') or [])} MB; "
                   f"{num(v.get('s_per_step'), '.2f')} s/step ({num(v.get('step_time_ratio_vs_ddp'), '.2f')}x DDP); "
                   f"loss gap {num(v.get('max_rel_loss_gap_vs_ddp'), '.1e')}")
    return out + footer(d, command(d, "python -m genrec.benchmarks.fsdp_memory"))


def fsdp_memory_summary(d: dict) -> tuple[str, str]:
    """(headline, anchor): FSDP's weights + optimizer per rank against DDP's."""
    from genrec.benchmarks.report import get, num

    return (f"FSDP {num(get(d, 'variants.fsdp.param_optim_ratio_vs_ddp'), '.2f')}x weights+optim/rank",
            "DDP 1x")


if __name__ == "__main__":
    main()
