"""benchmarks/gpu_check.py, the lent GPU machine's one check, passes its dry run here: the
genrec.* shim imports every module the steps use, arguments are checked, the kernel tests
collect, and the train-step, fp8 and paged steps run at tiny sizes on the CPU. Run by path
and from a clean environment (no PYTHONPATH), as on the device image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_dry_run_passes(tmp_path: Path) -> None:
    p = _run("--dry-run", out=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["ok"] and all(report["imports"].values())
    assert set(report["steps"]) == {"kernel_tests", "attention", "train_step_bf16", "fp8", "paged"}
    assert report["steps"]["kernel_tests"]["counts"]["collected"] > 20
    assert report["steps"]["train_step_bf16"]["loss_last"] < report["steps"]["train_step_bf16"]["loss_first"]


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    p = _run("--dry-run", "--only", "kernels", out=tmp_path)
    assert p.returncode == 2 and "unknown steps ['kernels']" in p.stderr
    p = _run("--dry-run", "--budget-s", "900", out=tmp_path)
    assert p.returncode == 2 and "at most 8 minutes" in p.stderr
