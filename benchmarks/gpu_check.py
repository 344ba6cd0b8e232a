"""GPU checks for a lent accelerator machine, in one run that writes one JSON.

The machine's image has CUDA torch, triton and pytest (plus numpy, grpcio, pyarrow,
protobuf) but no TorchRec, fbgemm or SGLang, and cannot download anything. So nothing is
installed: this file is run by path, builds a *shim* (a temporary ``genrec/`` whose entries
are symlinks to the repository's folders, per pyproject.toml's ``package-dir``) and puts it
first on ``PYTHONPATH``, so ``genrec.kernels``, ``genrec.models``, ``genrec.quant`` and
``genrec.benchmarks`` import from the source tree as they do once installed.

Steps, each in its own process with its own timeout inside one overall budget (default
450 s, under the 8 minutes a check may take), so a hang costs one step, not the report:

1. ``kernel_tests``: ``tests/test_kernels.py`` with the Triton kernels compiled for the GPU;
2. ``attention``: HSTU attention forward + backward, reference vs torch.compile vs Triton
   (fp32, and Triton bf16), ML-1M shapes (``genrec.benchmarks.kernels.bench_attention``);
3. ``train_step_bf16``: a bf16-autocast AdamW training step of an HSTU tower on a plain
   ``nn.Embedding`` (no TorchRec), full-catalogue softmax: ms per step and the loss falling;
4. ``fp8``: ``quant.dense.Fp8WeightLinear`` against the bf16 layer;
5. ``paged``: incremental HSTU over a paged K/V pool, bf16 pool vs fp32 (``paged_check``),
   at the serving shape and at a small ragged one.

    python3 benchmarks/gpu_check.py [--out DIR] [--only paged,fp8] [--budget-s 450]
    python3 benchmarks/gpu_check.py --dry-run     # no CUDA: imports, arguments, tiny CPU runs

``--dry-run`` (run in CI by tests/test_gpu_check.py) builds the shim, imports every module
the steps import, collects the kernel tests, and runs steps 3-5 at tiny sizes on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("kernel_tests", "attention", "train_step_bf16", "fp8", "paged")
TIMEOUT_S = {"kernel_tests": 180, "attention": 110, "train_step_bf16": 60, "fp8": 30, "paged": 80}
# what the steps import besides the standard library and genrec itself
NEEDS = ("torch", "triton", "pytest", "numpy")
MODULES = ("genrec.kernels.hstu_attention", "genrec.kernels.triton_hstu", "genrec.benchmarks.kernels",
           "genrec.models.hstu", "genrec.quant.dense", "genrec.benchmarks.paged_check")


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools.package-dir]``: subpackage name -> folder. Parsed by
    pattern, not tomllib, so any Python 3 on the image reads it."""
    text = (root / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^"genrec\.([\w.]+)"\s*=\s*"([^"]+)"', section, flags=re.M))


def make_shim(root: Path, dest: Path) -> Path:
    """``dest/genrec/``: links to ``root/genrec/*`` and to each mapped folder; returns ``dest``."""
    pkg = dest / "genrec"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (root / "genrec").iterdir():
        if entry.name != "__pycache__" and not (pkg / entry.name).exists():
            (pkg / entry.name).symlink_to(entry)
    for name, folder in package_dirs(root).items():
        if "." in name:
            raise ValueError(f"package-dir maps a nested package ({name}); the shim links top-level ones only")
        link = pkg / name
        if not link.exists():
            link.symlink_to(root / folder, target_is_directory=True)
    return dest


# ----- the steps; each runs in a child process (``--step NAME``) and returns a JSON-able dict -----
def step_kernel_tests(device: str, tiny: bool) -> dict[str, Any]:
    # genrec imported from the shim (not the working directory, which -c puts first) before
    # pytest puts the repository root, whose genrec/ lacks the mapped folders, first on sys.path
    run = "import sys; sys.path.remove(\"\"); import genrec, pytest; sys.exit(pytest.main(sys.argv[1:]))"
    args = [sys.executable, "-c", run, "tests/test_kernels.py", "-q", "-p", "no:cacheprovider"]
    if tiny:
        args.append("--collect-only")
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    lines = [x for x in (p.stdout + p.stderr).strip().splitlines() if x.strip()]
    tail = [next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed|errors?)", x)), lines[-1] if lines else "")]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail[0])}
    collected = re.search(r"(\d+)(?: tests? collected)?$", tail[0]) if tiny else None
    if collected:
        counts["collected"] = int(collected.group(1))
    return {"returncode": p.returncode, "summary": tail[0], "counts": counts, "ok": p.returncode == 0}


def step_attention(device: str, tiny: bool) -> dict[str, Any]:
    from genrec.benchmarks.kernels import bench_attention

    if tiny:
        return {"ok": True, "imported": "bench_attention"}
    out = bench_attention(device, rounds=5, reps=20)
    return {**out, "ok": True}


def step_train_step_bf16(device: str, tiny: bool) -> dict[str, Any]:
    import torch

    from genrec.kernels.jagged import lengths_to_offsets
    from genrec.models.hstu import HSTUConfig, HSTUTower, JaggedMeta

    torch.manual_seed(0)
    items, d, users, cap = (500, 32, 4, 24) if tiny else (100_000, 256, 128, 200)
    layers, heads = (2, 2) if tiny else (4, 4)
    cfg = HSTUConfig(num_layers=layers, num_heads=heads, qk_dim=d // heads, v_dim=d // heads, dropout=0.0)
    emb = torch.nn.Embedding(items, d).to(device)
    tower = HSTUTower(cfg, d, max_seq_len=cap).to(device)
    opt = torch.optim.AdamW([*emb.parameters(), *tower.parameters()], lr=1e-3, fused=device == "cuda")
    lengths = torch.randint(cap // 4, cap + 1, (users,))
    tokens = int(lengths.sum())
    ids = torch.randint(1, items, (tokens + 1,), device=device)
    times = torch.cumsum(torch.randint(1, 3600, (tokens,)), 0).to(device)
    meta = JaggedMeta(lengths_to_offsets(lengths).to(device), int(lengths.max()), times, times + 30, None)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16)

    def step() -> float:
        with amp:
            h = tower(emb(ids[:-1]), meta)
            logits = h @ emb.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    losses = [step() for _ in range(3)]  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    reps = 2 if tiny else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        losses.append(step())
    sync()
    ms = (time.perf_counter() - t0) / reps * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    ok = all(map(lambda x: x == x, losses)) and losses[-1] < losses[0]
    return {"shape": {"items": items, "dim": d, "layers": layers, "heads": heads, "users": users, "tokens": tokens},
            "ms_per_step": round(ms, 3), "loss_first": losses[0], "loss_last": losses[-1], "peak_gib": peak, "ok": ok}


def step_fp8(device: str, tiny: bool) -> dict[str, Any]:
    import torch

    from genrec.quant.dense import Fp8WeightLinear, quantize_linear_weight

    n = 64 if tiny else 1024
    lin = torch.nn.Linear(n, n).to(device)
    x = torch.randn(64, n, device=device, dtype=torch.bfloat16)
    codes, scale = quantize_linear_weight(lin.weight.data, "fp8")
    layer = Fp8WeightLinear(codes, scale, lin.bias.data).to(device)
    ref = lin.to(torch.bfloat16)(x)
    err = float((layer(x) - ref).abs().max() / ref.abs().max())
    return {"in_out": n, "max_rel_err_vs_bf16": err, "ok": err < 0.1}


def step_paged(device: str, tiny: bool) -> dict[str, Any]:
    from genrec.benchmarks.paged_check import check

    shapes = {"small_ragged": (3, 257, 5, 7)} if tiny else {"serving": (64, 4000, 3, 200), "small_ragged": (3, 257, 5, 7)}
    out = {name: check(device, *shape, reps=2 if tiny else 10) for name, shape in shapes.items()}
    ok = all(r["bf16_vs_fp32_rel_err_new"] < 0.05 and r["bf16_vs_fp32_rel_err_candidates"] < 0.05 for r in out.values())
    return {**out, "ok": ok}


def run_step(name: str, device: str, tiny: bool, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs step ``name`` in a child process; its result, or why there is none."""
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--device", device, "--result", f.name]
        try:
            p = subprocess.run(cmd + (["--dry-run"] if tiny else []), cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=timeout)
            text = Path(f.name).read_text()
            res = json.loads(text) if text else {"ok": False, "error": (p.stdout + p.stderr)[-3000:]}
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def environment(device: str) -> dict[str, Any]:
    import importlib.util

    info: dict[str, Any] = {"python": sys.version.split()[0],
                            "missing": [m for m in NEEDS if importlib.util.find_spec(m) is None]}
    import torch

    info["torch"] = torch.__version__
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    if importlib.util.find_spec("triton") is not None:
        import triton

        info["triton"] = triton.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="folder for gpu_check.json ($OUT)")
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {list(STEPS)}")
    p.add_argument("--budget-s", type=float, default=450.0, help="all steps together (the check's limit is 8 min)")
    p.add_argument("--device", default=None, help="cuda (default) or cpu")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: imports, arguments, tiny CPU runs")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # a child process: run one step
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    steps = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"--only: unknown steps {unknown}; choose from {list(STEPS)}")
    if a.budget_s <= 0 or a.budget_s > 480:
        p.error("--budget-s must be in (0, 480]: a device check may take at most 8 minutes")
    device = a.device or ("cpu" if a.dry_run else "cuda")

    if a.step:  # child: the shim is on PYTHONPATH already
        res = globals()[f"step_{a.step}"](device, a.dry_run)
        Path(a.result).write_text(json.dumps(res))
        return 0

    shim = make_shim(ROOT, Path(tempfile.mkdtemp(prefix="genrec-shim-")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]), "PYTHONUNBUFFERED": "1"}
    if a.dry_run:
        env["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(shim), str(ROOT)]
    report: dict[str, Any] = {"dry_run": a.dry_run, "device": device, "environment": environment(device),
                              "budget_s": a.budget_s, "steps": {}}
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device: run with --dry-run (or --device cpu)")
    if a.dry_run:
        import importlib

        os.environ["TRITON_INTERPRET"] = "1"
        report["imports"] = {}
        for m in MODULES:
            try:
                report["imports"][m] = bool(importlib.import_module(m))
            except ImportError as e:  # recorded, so the JSON says what the image lacks
                report["imports"][m] = False
                report.setdefault("import_errors", {})[m] = repr(e)
    deadline = time.monotonic() + a.budget_s
    for name in steps:
        left = deadline - time.monotonic()
        if left < 5:
            report["steps"][name] = {"ok": False, "error": "skipped: the budget was spent"}
            continue
        report["steps"][name] = res = run_step(name, device, a.dry_run, min(TIMEOUT_S[name], left), env)
        print(f"{name}: {'ok' if res.get('ok') else 'FAILED'} ({res['seconds']} s)", flush=True)
    report["ok"] = (all(r.get("ok") for r in report["steps"].values()) and not report["environment"]["missing"]
                    and all(report.get("imports", {}).values()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'gpu_check.json'}: {'all ok' if report['ok'] else 'FAILURES'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
