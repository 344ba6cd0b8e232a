"""What a bounded reach into long histories costs against full attention (issue 44): serving
(candidates against 8,192 cached events) and training (8,192-event sequences), one core.

    python -m genrec.benchmarks.long_bounded [--reps 7] [--window 512] [--block 64]

The tower of the synthetic ads model (HSTU, 2 layers, D 64, one head of 64), random weights
(speed only), once with full attention and once with ``hstu.window`` / ``hstu.summary_block``
(``kernels.hstu_bounded``):

* serving: ``HSTUTower.extend`` of 2,000 candidates against one user's encoded history of
  8,192 events (the K/V a cache holds), fp32 and bf16 (``backend="torch-bf16"``), variants
  interleaved, median of ``--reps``; the ratio bounded / full is the per-candidate cost;
* training: forward and backward of a batch of 2 sequences of 8,192 events (each position a
  query, as the trainer's step), in a fresh process per variant so that its peak RSS is its
  own: samples/s and peak memory.

Quality (validation NDCG@10 / AUC of a trained bounded model against full attention at 8k) is
not measured here. The result is merged into ``results/long_history.json`` under ``bounded``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HISTORY, CANDIDATES, TRAIN_LEN, TRAIN_BATCH, D = 8192, 2000, 8192, 2, 64


def tower(window: int, block: int, length: int) -> Any:
    import torch

    from genrec.models.hstu import HSTUConfig, HSTUTower

    torch.manual_seed(0)
    cfg = HSTUConfig(num_layers=2, num_heads=1, qk_dim=64, v_dim=64, dropout=0.0, window=window, summary_block=block)
    return HSTUTower(cfg, D, length + 1)


def history_meta(b: int, n: int) -> Any:
    import torch

    from genrec.kernels.jagged import lengths_to_offsets
    from genrec.models.hstu import JaggedMeta

    ts = torch.cumsum(torch.randint(0, 1200, (b * n,)), 0)
    return JaggedMeta(lengths_to_offsets(torch.full((b,), n)), n, ts, ts + 60, None)


def serving(reps: int, window: int, block: int) -> dict[str, Any]:
    """Median ms of extend per variant (full / bounded x fp32 / bf16), interleaved."""
    import torch

    towers = {"full": tower(0, block, HISTORY).eval(), "bounded": tower(window, block, HISTORY).eval()}
    towers["bounded"].load_state_dict(towers["full"].state_dict())
    x, meta = torch.randn(HISTORY, D), history_meta(1, HISTORY)
    cands, owner = torch.randn(CANDIDATES, D), torch.zeros(CANDIDATES, dtype=torch.long)
    with torch.inference_mode():
        hists = {k: t.encode_history(x, meta)[1] for k, t in towers.items()}
        runs = {(k, b): (lambda k=k, b=b: towers[k].extend(cands, hists[k], owner, backend=b))
                for k in towers for b in ("torch", "torch-bf16")}
        for f in runs.values():
            f()
        ms: dict[tuple, list[float]] = {k: [] for k in runs}
        for _ in range(reps):
            keys = list(runs)
            random.shuffle(keys)
            for k in keys:
                t0 = time.perf_counter()
                runs[k]()
                ms[k].append((time.perf_counter() - t0) * 1e3)
    med = {f"{k}/{b}": statistics.median(v) for (k, b), v in ms.items()}
    return {"history": HISTORY, "candidates": CANDIDATES, "ms": med,
            "us_per_candidate": {k: v / CANDIDATES * 1e3 for k, v in med.items()},
            "bounded_over_full": {b: med[f"bounded/{b}"] / med[f"full/{b}"] for b in ("torch", "torch-bf16")}}


def train_probe(window: int, block: int, steps: int) -> dict[str, float]:
    """In this process: ``steps`` forward + backward passes of TRAIN_BATCH sequences."""
    import torch

    torch.set_num_threads(1)
    m = tower(window, block, TRAIN_LEN).train()
    x = torch.randn(TRAIN_BATCH * TRAIN_LEN, D, requires_grad=True)
    meta = history_meta(TRAIN_BATCH, TRAIN_LEN)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m(x, meta).square().mean().backward()  # (warm-up)
    t0 = time.perf_counter()
    for _ in range(steps):
        m(x, meta).square().mean().backward()
    dt = (time.perf_counter() - t0) / steps
    return {"step_s": dt, "samples_per_s": TRAIN_BATCH / dt, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loaded_mib": before}


def training(window: int, block: int, steps: int) -> dict[str, Any]:
    out = {}
    for name, w in (("full", 0), ("bounded", window)):
        code = ("import json;from genrec.benchmarks.long_bounded import train_probe;"
                f"print(json.dumps(train_probe({w},{block},{steps})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return {"length": TRAIN_LEN, "batch": TRAIN_BATCH, "steps": steps, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block", type=int, default=64)
    args = ap.parse_args()
    import torch

    from genrec.benchmarks.common import RESULTS, machine, today

    torch.set_num_threads(1)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    load = os.getloadavg()
    res = {"date": today(), "machine": machine(), "window": args.window, "block": args.block,
           "command": " ".join(["python -m genrec.benchmarks.long_bounded", *sys.argv[1:]]),
           "serving": serving(args.reps, args.window, args.block),
           "training": training(args.window, args.block, args.steps), "load_avg": [load[0], os.getloadavg()[0]]}
    path = RESULTS / "long_history.json"
    d = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**d, "bounded": res}, indent=2) + "\n")
    print("\n".join(section(res)))


def section(b: dict) -> list[str]:
    """The DETAILS.md lines of ``long_history.json``'s ``bounded`` part."""
    from genrec.benchmarks.report import get, num

    if not b:
        return []
    s, t = b.get("serving") or {}, b.get("training") or {}
    ms = s.get("ms") or {}
    return ["", f"### Bounded reach: a window of {b.get('window')} events in full, blocks of {b.get('block')} "
            "summarized (issue 44)", "",
            f"Serving, {num(s.get('candidates'), ',d')} candidates against {num(s.get('history'), ',d')} cached events "
            f"(tower alone, one core): full {num(ms.get('full/torch'), '.1f')} ms fp32 / "
            f"{num(ms.get('full/torch-bf16'), '.1f')} ms bf16, bounded {num(ms.get('bounded/torch'), '.1f')} / "
            f"{num(ms.get('bounded/torch-bf16'), '.1f')} ms: per-candidate cost "
            f"{num(get(s, 'bounded_over_full.torch'), '.2f')}x / {num(get(s, 'bounded_over_full.torch-bf16'), '.2f')}x "
            "full attention's.", "",
            f"Training, forward + backward of {num(t.get('batch'), 'd')} sequences of {num(t.get('length'), ',d')} "
            f"events (tower alone, one core): full {num(get(t, 'full.samples_per_s'), '.2f')} samples/s, peak "
            f"{num(get(t, 'full.peak_mib'), ',.0f')} MiB; bounded {num(get(t, 'bounded.samples_per_s'), '.2f')} "
            f"samples/s, peak {num(get(t, 'bounded.peak_mib'), ',.0f')} MiB. Quality against full attention at 8k: not "
            f"measured yet. Load average {'-'.join(num(x, '.1f') for x in b.get('load_avg') or [])} (shared "
            f"machine). Date {b.get('date')}; command `{b.get('command')}`."]


if __name__ == "__main__":
    main()
