"""Performance-regression gate: the same short training and serving micro-benchmarks for two
commits, interleaved on one machine; each figure as a head/base ratio with its spread; the
gate fails only when a slowdown lies outside the noise.

    python -m genrec.benchmarks.gate --base main                  # head: this working tree
    python -m genrec.benchmarks.gate --base HEAD~1 --head HEAD    # two commits
    python -m genrec.benchmarks.gate --base HEAD --quick          # the CI smoke: two short rounds

Sides. The base (and the head, when ``--head`` names a revision) is checked out as a git
worktree under a temporary folder; ``--head worktree`` (the default) is this working tree,
uncommitted edits included. Each side gets an import shim (a ``genrec`` folder of symlinks to
its tree's folders, as its pyproject.toml maps them) and its measuring processes run
``python -P`` with only that shim on ``PYTHONPATH``; each reports the files its modules came
from and the gate checks they are the side's. The measuring code is ``gate_bench.py``, copied
from this tree, so both sides run the same benchmark (a base older than the gate too). One
synthetic dataset, job config and request file serve both sides; each side exports its own
serving artifact once.

Rounds. Each round starts a fresh worker per side (the two set up side by side), pins both to
one CPU and has them take turns: a block of training steps on the base, then on the head, then
the head, then the base (ABBA...), then blocks of engine calls likewise; who goes first
alternates round by round. A figure is CPU time per training step / per engine call (wall time
is reported beside it). A round's ratio is the median over its blocks of head / base; the two
sides of a block ran within the same second, so the machine's load weighs on both alike. What
blocks cannot cancel is each process's own speed (its memory layout: a few percent, constant
within the process): fresh processes every round turn it into noise that rounds average out.

Decision. Per figure, the ratio is the median of the rounds' ratios and its interval the
distribution-free one for a median (order statistics, at ``--confidence`` or the most the
rounds allow). A figure fails when the whole interval lies above ``1 + --tolerance``: a
slowdown the noise cannot explain. Exit status: 0 pass, 1 a figure failed, 2 the gate could
not run (a revision missing, a side's benchmark failing). ``--out``: the JSON report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from genrec.serve.affinity import pin_threads

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).with_name("gate_bench.py")
# figure -> the worker's block kind; a figure is CPU ms per training step / per engine call
FIGURES = {"train_step_ms": "train", "serve_batch_ms": "serve"}
SIDES = ("base", "head")

# the micro-benchmarks' job: a small joint retrieval + ranking HSTU (configs/gate.toml)
JOB = ROOT / "configs" / "gate.toml"


class GateError(RuntimeError):
    """The gate could not compare the two sides (exit status 2)."""


@dataclass(frozen=True)
class GateConfig:
    # a fresh worker process per side per round: a process's speed is a draw of its own (its
    # memory layout; the same in every block of that process), so rounds, not blocks, narrow
    # the interval
    rounds: int = 16
    blocks: int = 6  # blocks of each kind per round, the sides taking turns
    threads: int = 1  # torch threads of every measuring process, both sides
    train_steps: int = 8  # training steps in a block
    serve_batches: int = 8  # engine calls (of 8 requests) in a block
    # both sides' workers measure on this one CPU (-1: the last this process may use; None:
    # wherever the scheduler puts them): they take turns, so they never compete for it, and a
    # neighbour's load on one core or its hyperthread sibling weighs on both alike
    cpu: int | None = -1
    tolerance: float = 0.05  # a figure fails when its interval lies above 1 + tolerance
    confidence: float = 0.90
    timeout_s: float = 600.0  # one process's limit


QUICK = GateConfig(rounds=2, blocks=2)


@dataclass
class Side:
    name: str  # "base" or "head"
    rev: str  # as given
    sha: str
    tree: Path  # the source tree measured
    dirty: bool = False  # a working tree with uncommitted changes
    shim: Path | None = None
    args: tuple[str, ...] = ()  # more gate_bench.py worker arguments (the evidence's --train-method)


# -- git -------------------------------------------------------------------------------------

def git(repo: Path, *args: str) -> str:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if p.returncode:
        raise GateError(f"git {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip()


def resolve(repo: Path, rev: str) -> str:
    """The commit ``rev`` names, or a GateError that says how to get it."""
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except GateError:
        shallow = subprocess.run(["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True).stdout.strip() == "true"
        hint = (" This is a shallow clone: `git fetch --unshallow` (or fetch the base) first." if shallow
                else " Fetch it first, or name a commit of this clone.")
        raise GateError(f"revision {rev!r} is not a commit of {repo}.{hint}") from None


def side_of(repo: Path, name: str, rev: str, work: Path) -> Side:
    """``rev`` checked out as a worktree under ``work`` (``"worktree"``: ``repo`` as it is)."""
    if rev == "worktree":
        dirty = bool(git(repo, "status", "--porcelain", "--untracked-files=no"))
        return Side(name, rev, git(repo, "rev-parse", "HEAD"), repo, dirty)
    sha = resolve(repo, rev)
    tree = work / name
    git(repo, "worktree", "add", "--detach", "--quiet", str(tree), sha)
    return Side(name, rev, sha, tree)


def remove_worktree(repo: Path, tree: Path) -> None:
    """Removes a worktree the gate added (quietly: it may be half made)."""
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)


def make_shim(tree: Path, dest: Path) -> Path:
    """A folder holding ``genrec/``: symlinks to ``tree``'s ``genrec/`` files and to its
    top-level folders, as its pyproject.toml maps them (``genrec.train`` -> ``train/``). On
    ``PYTHONPATH`` (before the installed editable finder) it makes ``import genrec`` the tree's."""
    try:
        mapping = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise GateError(f"{tree}/pyproject.toml: no [tool.setuptools.package-dir] ({e}); the gate maps "
                        "the top-level folders to genrec.* from it") from None
    pkg = dest / "genrec"
    pkg.mkdir(parents=True)
    for entry in (tree / "genrec").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        sub = name.removeprefix("genrec.")
        if name.startswith("genrec.") and "." not in sub:
            (pkg / sub).symlink_to(tree / folder, target_is_directory=True)
    return dest


# -- the measuring processes ----------------------------------------------------------------

def _env(side: Side, work: Path, cfg: GateConfig) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(side.shim), "OMP_NUM_THREADS": str(cfg.threads),
            "MKL_NUM_THREADS": str(cfg.threads), "TQDM_DISABLE": "1", "GENREC_CACHE": str(work / "cache")}


def _bench(mode: str, work: Path, cfg: GateConfig) -> list[str]:
    return [sys.executable, "-P", str(work / "gate_bench.py"), mode, "--job", str(work / "job.toml"),
            "--data", str(work / "data"), "--threads", str(cfg.threads)]


def _check_modules(side: Side, modules: dict[str, str]) -> None:
    tree = side.tree.resolve()
    wrong = {m: f for m, f in modules.items() if not Path(f).is_relative_to(tree)}
    if wrong:
        raise GateError(f"{side.name}: imported {wrong}, not from {tree}: the import shim did not take")


def _failed(side: Side, what: str, log: Path) -> GateError:
    tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:]) if log.exists() else ""
    return GateError(f"{side.name} ({side.rev}, {side.sha[:12]}) {what} failed; its code may predate what "
                     f"the benchmark uses (then pick a newer base). {log}:\n{tail}")


def prepare_side(side: Side, work: Path, cfg: GateConfig) -> str:
    """Trains and exports ``side``'s artifact (``gate_bench.py prepare``); its path."""
    out, log = work / f"{side.name}-prepared", work / f"{side.name}-prepare.log"
    with open(log, "w") as f:
        try:
            p = subprocess.run(_bench("prepare", work, cfg) + ["--out", str(out)], env=_env(side, work, cfg),
                               cwd=work, stdout=f, stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            raise _failed(side, f"prepare (over {cfg.timeout_s:.0f} s)", log) from None
    if p.returncode:
        raise _failed(side, "prepare", log)
    result = json.loads((out / "prepare.json").read_text())
    _check_modules(side, result["modules"])
    return result["artifact"]


class Worker:
    """One side's ``gate_bench.py worker`` for one round: started, then asked for blocks."""

    def __init__(self, side: Side, artifact: str, work: Path, cfg: GateConfig, tag: str) -> None:
        self.side, self.log = side, work / f"{side.name}-{tag}.log"
        cmd = _bench("worker", work, cfg) + [
            "--artifact", artifact, "--workload", str(work / "workload.jsonl"), "--steps", str(cfg.train_steps),
            "--serve-batches", str(cfg.serve_batches), *side.args]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(cmd, env=_env(side, work, cfg), cwd=work, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        # every wait has a limit: a hung worker is killed, its pipe closes and _read fails
        self.timer = threading.Timer(cfg.timeout_s, self.proc.kill)
        self.timer.start()

    def _read(self, what: str) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise _failed(self.side, f"worker {what} (exit {self.proc.returncode})", self.log)
        return json.loads(line)

    def ready(self, cpu: int | None) -> dict[str, str]:
        """Waits for the worker's start (built, warmed up), checks its modules, then pins its
        threads to ``cpu`` (it started on every CPU: the two sides' set-ups run side by side)."""
        modules = self._read("start")["modules"]
        _check_modules(self.side, modules)
        if cpu is not None:
            pin_threads(self.proc.pid, (cpu,))
        return modules

    def block(self, kind: str) -> dict[str, float]:
        self.proc.stdin.write(kind + "\n")
        return self._read(kind)

    def close(self) -> None:
        self.timer.cancel()
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def run_round(r: int, sides: dict[str, Side], arts: dict[str, str], work: Path, cfg: GateConfig) -> dict[str, Any]:
    """Round ``r``: a fresh worker per side (started together, the round's first side first),
    then ``cfg.blocks`` blocks of each kind, the sides taking turns (ABBA..., who starts
    alternating round by round). Per figure: the median over blocks of head / base (CPU time;
    wall time beside it) and each side's median ms."""
    workers: dict[str, Worker] = {}
    try:
        for name in SIDES if r % 2 == 0 else SIDES[::-1]:
            workers[name] = Worker(sides[name], arts[name], work, cfg, f"round{r}")
        cpu = sorted(os.sched_getaffinity(0))[cfg.cpu] if cfg.cpu is not None else None
        modules = {name: workers[name].ready(cpu) for name in SIDES}
        got: dict[str, dict[str, list[dict[str, float]]]] = {n: {k: [] for k in FIGURES.values()} for n in SIDES}
        for kind in FIGURES.values():
            for j in range(cfg.blocks):
                for name in SIDES if (r + j) % 2 == 0 else SIDES[::-1]:
                    got[name][kind].append(workers[name].block(kind))
    finally:
        for w in workers.values():
            w.close()
    row: dict[str, Any] = {"first": SIDES[r % 2], "modules": modules, "blocks": got}
    for fig, kind in FIGURES.items():
        b, h = got["base"][kind], got["head"][kind]
        row[fig] = {"ratio": statistics.median(y["cpu_ms"] / x["cpu_ms"] for x, y in zip(b, h)),
                    "wall_ratio": statistics.median(y["wall_ms"] / x["wall_ms"] for x, y in zip(b, h)),
                    "base_ms": statistics.median(x["cpu_ms"] for x in b),
                    "head_ms": statistics.median(y["cpu_ms"] for y in h)}
    return row


# -- the statistics --------------------------------------------------------------------------

def median_interval(xs: list[float], confidence: float) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the distribution-free interval for the median of ``xs``,
    the k-th smallest to the k-th largest, k as large as keeps the coverage >= ``confidence``
    (k = 1, min to max, when even that falls short: fewer than 5 values at 90%)."""
    n, s = len(xs), sorted(xs)

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k)) for any continuous law
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return statistics.median(s), s[k - 1], s[n - k], coverage(k)


def decide(ratios: list[float], tolerance: float, confidence: float) -> dict[str, Any]:
    """One figure's verdict from its rounds' head / base ratios: their median, its interval,
    and "slower" (a failure) only when the interval's low end is above ``1 + tolerance``;
    "faster" when its high end is below ``1 - tolerance``."""
    if not ratios:
        raise ValueError("decide: no rounds")
    med, lo, hi, cov = median_interval(ratios, confidence)
    verdict = "slower" if lo > 1 + tolerance else "faster" if hi < 1 - tolerance else "within noise"
    return {"ratio": med, "low": lo, "high": hi, "coverage": cov, "min": min(ratios), "max": max(ratios),
            "ratios": list(ratios), "verdict": verdict, "failed": verdict == "slower"}


def summary_line(name: str, f: dict[str, Any]) -> str:
    return (f"{name}: head/base {f['ratio']:.3f} ({f['coverage']:.0%} interval {f['low']:.3f}..{f['high']:.3f}, "
            f"rounds {len(f['ratios'])} ranging {f['min']:.3f}..{f['max']:.3f}; wall time {f['wall_ratio']:.3f}); "
            f"base {f['base_ms']:.2f} ms, head {f['head_ms']:.2f} ms -> {f['verdict']}{' (FAIL)' if f['failed'] else ''}")


# -- the gate --------------------------------------------------------------------------------

def prepare_inputs(work: Path) -> None:
    """What both sides read: the job config, a synthetic dataset, the request file, the
    measuring script (all made with this tree's code)."""
    from genrec.loadtest.workload import make_workload
    from genrec.train.data.synthetic import SyntheticConfig, generate

    shutil.copy(JOB, work / "job.toml")
    generate(SyntheticConfig(num_users=2000, num_items=5000, num_topics=16, median_len=40, max_len=200,
                             seed=0, chunk_users=1024), work / "data", progress=False)
    make_workload(work / "data", work / "workload.jsonl", n=256, history=100, retrieve_k=50, top_k=10,
                  with_actions=True)
    shutil.copy(BENCH, work / "gate_bench.py")


def run_gate(base: str, head: str = "worktree", cfg: GateConfig = GateConfig(), repo: Path = ROOT,
             log=print, side_args: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:  # noqa: ANN001
    """Measures ``base`` against ``head`` (a revision, or "worktree") round by round; the
    report (JSON-ready): both sides, every round's figures, each figure's verdict, ``failed``.
    ``log``: a print-like callable for progress; ``side_args``: more worker arguments by side."""
    from genrec.benchmarks.common import machine, today

    if cfg.rounds < 1 or cfg.blocks < 1:
        raise GateError("--rounds and --blocks must be at least 1")
    if cfg.cpu is not None and not -len(os.sched_getaffinity(0)) <= cfg.cpu < len(os.sched_getaffinity(0)):
        raise GateError(f"cpu {cfg.cpu}: this process may use {len(os.sched_getaffinity(0))} CPUs")
    repo = Path(git(repo, "rev-parse", "--show-toplevel"))
    work = Path(tempfile.mkdtemp(prefix="genrec-gate-"))
    sides: dict[str, Side] = {}
    started, load = time.time(), os.getloadavg()
    try:
        for name, rev in (("base", base), ("head", head)):
            sides[name] = side_of(repo, name, rev, work)
            sides[name].shim = make_shim(sides[name].tree, work / f"shim-{name}")
            sides[name].args = tuple((side_args or {}).get(name, ()))
        prepare_inputs(work)
        arts = {}
        for name, s in sides.items():
            log(f"{name}: {s.rev} ({s.sha[:12]}{', uncommitted changes' if s.dirty else ''}) at {s.tree}: preparing")
            arts[name] = prepare_side(s, work, cfg)
        rounds = []
        for r in range(cfg.rounds):
            rounds.append(run_round(r, sides, arts, work, cfg))
            log(f"round {r + 1}/{cfg.rounds}: " + "; ".join(
                f"{k} {rounds[-1][k]['base_ms']:.2f} -> {rounds[-1][k]['head_ms']:.2f} ms "
                f"(x{rounds[-1][k]['ratio']:.3f})" for k in FIGURES))
    finally:
        for s in sides.values():
            if s.tree != repo:
                remove_worktree(repo, s.tree)
        shutil.rmtree(work, ignore_errors=True)
    figures = {k: {**decide([r[k]["ratio"] for r in rounds], cfg.tolerance, cfg.confidence),
                   "wall_ratio": statistics.median(r[k]["wall_ratio"] for r in rounds),
                   "base_ms": statistics.median(r[k]["base_ms"] for r in rounds),
                   "head_ms": statistics.median(r[k]["head_ms"] for r in rounds)} for k in FIGURES}
    return {
        "date": today(), "machine": {**machine(), "threads": cfg.threads},
        "load_average": {"start": load, "end": os.getloadavg()}, "seconds": time.time() - started,
        "config": asdict(cfg),
        "sides": {n: {"rev": s.rev, "sha": s.sha, "dirty": s.dirty} for n, s in sides.items()},
        "modules": rounds[0]["modules"],  # where each side's workers loaded genrec from (checked)
        "rounds": [{k: v for k, v in r.items() if k != "modules"} for r in rounds],
        "figures": figures, "failed": any(f["failed"] for f in figures.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--base", required=True, help="the revision to compare against (a branch, tag or commit)")
    ap.add_argument("--head", default="worktree", help="a revision, or 'worktree' (default): this working tree")
    ap.add_argument("--quick", action="store_true", help=f"the smoke: {QUICK.rounds} rounds of short runs")
    ap.add_argument("--rounds", type=int, help=f"rounds (default {GateConfig.rounds}; --quick {QUICK.rounds})")
    ap.add_argument("--blocks", type=int, help=f"blocks of each kind per round (default {GateConfig.blocks})")
    ap.add_argument("--train-steps", type=int, help=f"training steps per block (default {GateConfig.train_steps})")
    ap.add_argument("--threads", type=int, help=f"torch threads (default {GateConfig.threads})")
    ap.add_argument("--tolerance", type=float, help=f"allowed slowdown beyond the noise (default {GateConfig.tolerance})")
    ap.add_argument("--confidence", type=float, help=f"the interval's coverage (default {GateConfig.confidence})")
    ap.add_argument("--out", type=Path, default=Path("runs/gate/report.json"), help="the JSON report (default: %(default)s)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else GateConfig()
    cfg = replace(cfg, **{k: getattr(args, k) for k in ("rounds", "blocks", "train_steps", "threads", "tolerance", "confidence")
                          if getattr(args, k) is not None})
    try:
        report = run_gate(args.base, args.head, cfg, log=lambda m: print(m, flush=True))
    except GateError as e:
        print(f"gate: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, f in report["figures"].items():
        print(summary_line(name, f))
    print(f"gate: {'FAIL' if report['failed'] else 'pass'} (tolerance {cfg.tolerance:.0%}); report {args.out}")
    return int(report["failed"])


if __name__ == "__main__":
    sys.exit(main())
