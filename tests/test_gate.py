"""benchmarks/gate.py: the decision rule on synthetic round timings, the import shim, the
missing-revision guard, and a quick run of the whole gate on this commit (the CI smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from genrec.benchmarks import gate

ROOT = Path(__file__).resolve().parents[1]


def ratios(n: int, slowdown: float, noise: float, seed: int) -> list[float]:
    """n rounds' head / base ratios: a true ratio of ``1 + slowdown`` and each round's
    log-normal noise of ``noise`` (the gate's rounds on a busy 2-core machine scatter about 0.05)."""
    rng = np.random.default_rng(seed)
    return ((1 + slowdown) * np.exp(rng.normal(0, noise, n))).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_a_15_percent_slowdown_fails(seed: int) -> None:
    f = gate.decide(ratios(16, 0.15, 0.06, seed), tolerance=0.05, confidence=0.9)
    assert f["failed"] and f["verdict"] == "slower", f
    assert 1.08 < f["ratio"] < 1.25


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("bias", "noise"), [(0.0, 0.0), (0.0, 0.06), (0.02, 0.08), (-0.02, 0.06)])
def test_an_unchanged_commit_passes(seed: int, bias: float, noise: float) -> None:
    """Noisy rounds, and a small order effect either way (``bias``), stay within the noise."""
    f = gate.decide(ratios(16, bias, noise, seed), tolerance=0.05, confidence=0.9)
    assert not f["failed"] and f["verdict"] == "within noise", f
    assert f["low"] <= f["ratio"] <= f["high"]


def test_outliers_alone_do_not_fail() -> None:
    """A slowdown the noise can explain is not a failure: rounds above the line are not enough
    while the interval reaches below it."""
    rs = [1.04, 0.98, 1.02, 1.8, 1.01, 0.99, 1.06, 1.4, 1.03, 1.0]  # two preempted rounds
    assert not gate.decide(rs, 0.05, 0.9)["failed"]
    assert gate.decide([r * 1.15 for r in rs], 0.05, 0.9)["failed"]


def test_a_speedup_is_reported_and_passes() -> None:
    f = gate.decide(ratios(10, -0.3, 0.02, 0), 0.05, 0.9)
    assert f["verdict"] == "faster" and not f["failed"]


@pytest.mark.parametrize(("n", "k", "coverage"), [(4, 1, 0.875), (5, 1, 0.9375), (10, 2, 0.9785), (12, 3, 0.9614)])
def test_median_interval_takes_the_tightest_order_statistics(n: int, k: int, coverage: float) -> None:
    xs = [float(i) for i in range(n, 0, -1)]  # n..1, unsorted on purpose
    med, lo, hi, cov = gate.median_interval(xs, 0.9)
    assert (lo, hi) == (float(k), float(n + 1 - k))
    assert cov == pytest.approx(coverage, abs=1e-4)
    assert med == pytest.approx((n + 1) / 2)


def test_decide_needs_rounds() -> None:
    with pytest.raises(ValueError, match="no rounds"):
        gate.decide([], 0.05, 0.9)


def test_the_shim_imports_the_tree_over_the_installed_package(tmp_path: Path) -> None:
    """A tree whose folders map to genrec.* (as pyproject.toml says): through its shim a
    ``python -P`` process imports that tree, not the installed (editable) genrec."""
    tree = tmp_path / "tree"
    (tree / "genrec").mkdir(parents=True)
    (tree / "genrec" / "__init__.py").write_text("")
    (tree / "trainer_code").mkdir()
    (tree / "trainer_code" / "__init__.py").write_text("MARK = 'the tree'\n")
    (tree / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"genrec.train" = "trainer_code"\n')
    shim = gate.make_shim(tree, tmp_path / "shim")
    p = subprocess.run([sys.executable, "-P", "-c", "import genrec.train as t, os; print(t.MARK, os.path.realpath(t.__file__))"],
                       env={**os.environ, "PYTHONPATH": str(shim)}, cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    mark, path = p.stdout.strip().rsplit(" ", 1)
    assert mark == "the tree" and Path(path).is_relative_to(tree.resolve()), p.stdout


def test_a_missing_base_says_how_to_get_it(tmp_path: Path) -> None:
    repo, clone = tmp_path / "repo", tmp_path / "clone"
    run = lambda *a, cwd=repo: subprocess.run(["git", *a], cwd=cwd, check=True, capture_output=True)  # noqa: E731
    repo.mkdir()
    run("init", "-q")
    for i in range(2):
        (repo / "f").write_text(str(i))
        run("add", "f")
        run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{i}")
    run("clone", "-q", "--depth", "1", f"file://{repo}", str(clone), cwd=tmp_path)
    with pytest.raises(gate.GateError, match="shallow clone"):
        gate.resolve(clone, "HEAD~1")
    with pytest.raises(gate.GateError, match="not a commit"):
        gate.resolve(repo, "no-such-branch")
    assert gate.resolve(repo, "HEAD~1") == gate.git(repo, "rev-parse", "HEAD~1")


@pytest.mark.serving  # builds each side's serving artifact and runs its engine
def test_quick_gate_on_this_commit(tmp_path: Path) -> None:
    """The smoke CI runs: HEAD against HEAD, two worktrees, two short rounds. The tolerance is
    wide (two rounds on a shared CI machine say little); the decision rule is tested above."""
    out = tmp_path / "report.json"
    rc = gate.main(["--base", "HEAD", "--head", "HEAD", "--quick", "--tolerance", "0.5", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["failed"] is False
    sha = gate.git(ROOT, "rev-parse", "HEAD")
    assert {n: s["sha"] for n, s in report["sides"].items()} == {"base": sha, "head": sha}
    assert [r["first"] for r in report["rounds"]] == ["base", "head"]  # who starts alternates
    for name in ("base", "head"):  # each side ran its own worktree's code
        assert all("genrec-gate-" in f and f"/{name}/" in f for f in report["modules"][name].values())
    for name, f in report["figures"].items():
        assert name in gate.FIGURES and len(f["ratios"]) == 2 and f["verdict"] == "within noise"
        assert f["base_ms"] > 0 and f["head_ms"] > 0 and f["low"] <= f["ratio"] <= f["high"]
    blocks = report["rounds"][0]["blocks"]
    assert [len(blocks[n]["train"]) for n in ("base", "head")] == [gate.QUICK.blocks] * 2
    assert report["machine"]["cpu"]
