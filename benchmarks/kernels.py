"""Kernel benchmark: HSTU attention and a full training step, every backend side by side.

Shapes follow the shipped recipe (``configs/hstu.toml``: its heads, head sizes and
``max_seq_len``; B = 128 users, lengths drawn from ML-1M's capped distribution). Forward +
backward per call; median of repeated, interleaved rounds, reported as ratios to the eager
reference in the same run, with each path's rate over the causal triangle's GEMM FLOPs
(``kernels.flops``).

* reference: ``hstu_attention_reference`` (pure PyTorch, padded to the batch's longest);
* compiled: the same function under ``torch.compile`` (inductor: C++ on CPU, Triton on GPU);
* coded: ``hstu_attention_coded``, the PyTorch path training falls back to (one bias code per
  pair, causal query blocks, a hand-written backward), its per-batch codes built in every call
  (in a tower the first layer builds them for all);
* native: ``kernels.hstu_train``, what training runs on CPU (C++, one user's triangle at a
  time in cache), where its library builds;
* coded_bf16, native_bf16: the same two on bf16 q, k, v, as under the recipe's bf16 autocast
  (the native kernel's GEMMs as bf16 dot products where the CPU has AVX512-BF16:
  ``native_bf16_gemms`` in the result says whether it did);
* triton, triton_bf16: ``kernels.triton_hstu`` (GPU only; on CPU it only runs in the
  interpreter, which is a correctness tool, not a speed one, so it is not timed here).

The training step: the shipped recipe eager (its attention backend "auto": native on CPU),
with the pure-PyTorch attention instead, compiled, and eager under bf16 autocast as the
recipe's ``precision = "auto"`` trains where the CPU has native bf16 GEMMs.

    python -m genrec.benchmarks.kernels [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import tomllib
from pathlib import Path

import numpy as np
import torch

from genrec.benchmarks.common import dataset, machine, today, update_results_md, write_json
from genrec.kernels import flops, hstu_train
from genrec.kernels.hstu_attention import (
    AttentionPlan,
    hstu_attention_coded,
    hstu_attention_reference,
)
from genrec.kernels.jagged import lengths_to_offsets
from genrec.models.hstu import HSTUConfig

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "hstu.toml"


def recipe_shape(path: Path = RECIPE) -> dict:
    """The shipped recipe's attention shape: heads, qk / v head sizes, max_seq_len, time buckets
    (its ``[model.hstu]`` table read through ``HSTUConfig``, so unset keys take the tower's
    defaults; TOML directly, not ``load_job``, which imports torchrec: the GPU check runs this
    where only torch and Triton are installed)."""
    cfg = tomllib.loads(path.read_text())
    hstu = HSTUConfig(**cfg["model"]["hstu"])
    return {"heads": hstu.num_heads, "dqk": hstu.qk_dim, "dv": hstu.v_dim,
            "max_seq_len": cfg["model"]["max_seq_len"], "time_buckets": hstu.num_time_buckets}


def ml1m_lengths(batch: int, cap: int, seed: int) -> tuple[torch.Tensor, str]:
    """Training lengths drawn from ML-1M (or, where the data is absent, a log-normal with
    ML-1M's median 96 and spread), capped at ``cap``."""
    rng = np.random.default_rng(seed)
    try:
        from genrec.train.data.files import read_interactions

        col = read_interactions(dataset("ml1m"), ["item_ids"]).column("item_ids")
        lengths, source = np.diff(col.combine_chunks().offsets.to_numpy()) - 2, "ml-1m"
    except (FileNotFoundError, OSError, ImportError):
        lengths, source = np.round(96 * np.exp(0.95 * rng.standard_normal(6040))).astype(np.int64) + 18, "ml-1m-like"
    return torch.from_numpy(rng.choice(np.minimum(lengths, cap), size=batch)).long(), source


def attention_inputs(lengths: torch.Tensor, shape: dict, device: str, dtype: torch.dtype):
    """q, k [T, H, dqk], v [T, H, dv] (leaves, ``dtype``) and offsets; the bias weights,
    timestamps and lengths as keyword arguments. The same values for every dtype (seed 0)."""
    t, h, msl = int(lengths.sum()), shape["heads"], shape["max_seq_len"]
    g = torch.Generator().manual_seed(0)
    mk = lambda d: (torch.randn(t, h, d, generator=g) * 0.3).to(device, dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(shape["dqk"]), mk(shape["dqk"]), mk(shape["dv"])
    ts = torch.cumsum(torch.randint(0, 3600, (t,), generator=g), 0).to(device)
    kw = dict(max_seq_len=msl, alpha=shape["dqk"] ** -0.5,
              pos_weights=torch.randn(msl, generator=g).to(device).requires_grad_(),
              time_weights=torch.randn(shape["time_buckets"], generator=g).to(device).requires_grad_(),
              timestamps=ts, query_times=ts + 30, max_len=int(lengths.max()))
    return (q, k, v, lengths_to_offsets(lengths).to(device)), kw


def time_call(fn, reps: int, device: str) -> float:
    fn()  # warm-up (and compile)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def bench_attention(device: str, rounds: int, reps: int, shape: dict | None = None) -> dict:
    shape = shape or recipe_shape()
    lengths, source = ml1m_lengths(128, shape["max_seq_len"], seed=0)
    args, kw = attention_inputs(lengths, shape, device, torch.float32)
    args16, kw16 = attention_inputs(lengths, shape, device, torch.bfloat16)
    compiled = torch.compile(hstu_attention_reference, dynamic=True)

    def fwd_bwd(f, a, k):  # noqa: ANN001, ANN202
        def run() -> None:
            f(*a, **k).float().square().mean().backward()
        return run

    coded = lambda *a, **k: hstu_attention_coded(*a, plan=AttentionPlan(), **k)  # noqa: E731
    paths = {"reference": fwd_bwd(hstu_attention_reference, args, kw), "compiled": fwd_bwd(compiled, args, kw),
             "coded": fwd_bwd(coded, args, kw), "coded_bf16": fwd_bwd(coded, args16, kw16)}
    if device == "cpu" and hstu_train.supported(*args[:3], kw["max_len"]):
        native = lambda *a, **k: hstu_train.hstu_attention_native(*a, plan=AttentionPlan(), **k)  # noqa: E731
        paths["native"] = fwd_bwd(native, args, kw)
        paths["native_bf16"] = fwd_bwd(native, args16, kw16)
    if device == "cuda":
        from genrec.kernels.triton_hstu import triton_hstu_attention

        paths["triton"] = fwd_bwd(triton_hstu_attention, args, kw)
        paths["triton_bf16"] = fwd_bwd(triton_hstu_attention, args16, kw16)
    times = {k: [] for k in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(time_call(fn, reps, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    work = sum(flops.causal_attention_flops(args[3], shape["heads"], shape["dqk"], shape["dv"], backward=b)
               for b in (False, True))
    return {"shape": {"batch": 128, "tokens": int(lengths.sum()), "max_len": int(lengths.max()),
                      "heads": shape["heads"], "dqk": shape["dqk"], "dv": shape["dv"], "lengths_from": source,
                      "from": "configs/hstu.toml"},
            "gflop_per_call": work / 1e9,
            "native_bf16_gemms": hstu_train.bf16_gemms() if "native_bf16" in paths else None,
            "ms": {k: v * 1e3 for k, v in med.items()},
            "gflop_per_s": {k: work / v / 1e9 for k, v in med.items()},
            "speedup_vs_reference": {k: med["reference"] / v for k, v in med.items()}}


def bench_train_step(device: str, rounds: int, steps: int) -> dict:
    from genrec.train.data.reader import make_reader
    from genrec.train.job import build_model, load_job
    from genrec.train.loop.trainer import build_optimizer

    data = dataset("ml1m")
    # (compile, the tower's attention backend) per variant: "reference" is the config key
    # model.hstu.attention_backend, the pure-PyTorch path, against the default "auto"
    variants = {"eager": (False, "auto"), "eager_reference_attention": (False, "reference"), "compiled": (True, "auto"),
                "eager_bf16": (False, "auto")}
    batches, steps_of, warm = None, {}, {}
    for name, (comp, backend) in variants.items():
        job = load_job(RECIPE, [f'--data.path="{data}"', f'--model.hstu.attention_backend="{backend}"'])
        torch.manual_seed(0)
        model, emb = build_model(job)
        model = model.to(device)
        if batches is None:
            reader = make_reader(job.data, "train", emb, job.model.max_seq_len)
            batches = [b for _, b in zip(range(steps + 1), reader)]
        if comp:
            model.tower.compile(dynamic=True)
        opt = build_optimizer(list(model.parameters()), job.train.optim)

        cast = name.endswith("_bf16")

        def step(b, model=model, opt=opt, cast=cast) -> None:  # noqa: ANN001
            with torch.autocast(device, dtype=torch.bfloat16) if cast else contextlib.nullcontext():
                loss = model(b.to(device))["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps_of[name] = step
        t0 = time.perf_counter()
        for b in batches[:3]:  # warm-up: compile every shape bucket first
            step(b)
        warm[name] = time.perf_counter() - t0
    times = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved: machine noise hits every variant alike
        for name, step in steps_of.items():
            t0 = time.perf_counter()
            for b in batches[1:]:
                step(b)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / (len(batches) - 1))
    out = {name: {"s_per_step": statistics.median(t), "sequences_per_s": job.data.batch_size / statistics.median(t),
                  "warmup_s": warm[name]} for name, t in times.items()}
    out["compiled_speedup"] = out["eager"]["s_per_step"] / out["compiled"]["s_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-train-step", action="store_true", help="attention only (no torchrec / data needed)")
    args = ap.parse_args()
    att = bench_attention(args.device, args.rounds, args.reps)
    print("attention", att)
    step = None if args.no_train_step else bench_train_step(args.device, max(2, args.rounds // 2), args.steps)
    print("train step", step)
    result = {"date": today(), "machine": machine(), "device": args.device, "attention": att, "train_step": step}
    write_json("kernels" if args.device == "cpu" else f"kernels_{args.device}", result)
    update_results_md()


if __name__ == "__main__":
    main()
