"""Shared benchmark plumbing: datasets from ../shared/data, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from genrec.serve.affinity import pin_threads

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
SHARED = Path(os.environ.get("GENREC_SHARED_DATA", ROOT.parent / "shared" / "data"))


def pin_process(cpus: Any) -> None:
    """Pins every thread of this process to ``cpus`` (and so the threads it starts later).
    ``os.sched_setaffinity(0, ...)`` moves the calling thread only: gRPC's own threads (its
    event engine and timers, which do the load generator's I/O), started at the first call and
    kept for the process's life, would stay where they were started. The calling thread is
    moved first, by the one call that raises on a set of CPUs it cannot use (``pin_threads``
    passes over threads that end meanwhile)."""
    cpus = tuple(sorted(set(cpus)))
    os.sched_setaffinity(0, cpus)
    pin_threads(os.getpid(), cpus)


def dataset(name: str, cache: Path = ROOT / "data") -> Path:
    """A converted dataset directory for 'ml1m', 'beauty' or 'kuairand', converting once from
    SHARED (KuaiRand-Pure: SHARED/kuairand-pure, else the release unpacked in data/raw/kuairand)."""
    from genrec.train.data.convert import convert_kuairand, convert_movielens, convert_sequences

    out = cache / name
    if (out / "dataset.json").exists():
        return out
    if name == "ml1m":
        convert_movielens(SHARED / "ml-1m", out)
    elif name == "beauty":
        convert_sequences(SHARED / "amazon-beauty" / "sequences.txt", out)
    elif name == "kuairand":
        raw = [p for p in (SHARED / "kuairand-pure", cache / "raw" / "kuairand") if p.is_dir()]
        if not raw:
            raise FileNotFoundError(
                f"KuaiRand-Pure is not on this machine: unpack KuaiRand-Pure.tar.gz (zenodo.org/records/10439422, "
                f"CC BY-SA 4.0) into {cache / 'raw' / 'kuairand'} or {SHARED / 'kuairand-pure'}")
        convert_kuairand(raw[0], out)
    else:
        raise ValueError(f"unknown dataset {name}; expected ml1m, beauty or kuairand")
    return out


def machine() -> dict[str, Any]:
    import torch

    from genrec.train.runs.directory import cpu_identity

    cpu, isa = cpu_identity()
    return {
        "cpu": cpu,
        "isa": isa,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),  # < cores when pinned (taskset) beside other work
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def today() -> str:
    return time.strftime("%Y-%m-%d")


def shown_path(path: str | Path) -> str:
    """A path as a results file keeps it: relative to the repository when inside it, else its
    last two parts (a run's name/stamp): a tracked file names no machine's directories."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(Path(*p.parts[-2:]))


def invocation() -> str | None:
    """How this process was started, as the command that runs it again (``python -m <module>
    <arguments>``); None when it was not started as a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name:
        return None
    return " ".join([f"python -m {spec.name.removesuffix('.__main__')}", *map(shlex.quote, sys.argv[1:])])


def write_json(name: str, payload: Any) -> Path:
    """``results/<name>.json``; a dict payload that names no ``command`` records this process's
    (:func:`invocation`): the pages quote it, and a default would drop the flags a run was given."""
    if isinstance(payload, dict) and "command" not in payload and (cmd := invocation()):
        payload = {**payload, "command": cmd}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def update_results_md() -> None:
    """Regenerates RESULTS.md and DETAILS.md beside it from every ``results/*.json``
    (``benchmarks/report.py``, the one renderer of the pages). Call it after ``write_json``."""
    import fcntl

    from genrec.benchmarks import report

    # benchmarks may run side by side (one per core): serialise the rewrites on RESULTS.lock
    with open(RESULTS_MD.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        report.write(RESULTS, RESULTS_MD.parent)
