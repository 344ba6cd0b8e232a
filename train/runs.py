"""``genrec runs list | show``: the run directories as a table, one run in full.

The run directory stays the source of truth (``config.toml``, ``version.json``,
``results.json``, ``metrics.jsonl``); nothing here writes. Columns of ``list``: the run (its
path under the root), when it started, the commit it ran (``+`` when the tree was dirty), the
dataset and a fingerprint of its manifest (``dataset.json``: two runs on the same data show the
same one), its status, the metric the checkpoint was chosen on with its best validation value,
that metric on the test split, and the training minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import tomllib
from pathlib import Path
from typing import Any


def find_runs(root: Path) -> list[Path]:
    """Every run directory (one holding ``config.toml``) under ``root``, oldest first."""
    runs = [p.parent for p in Path(root).rglob("config.toml") if (p.parent / "version.json").exists()]
    return sorted(runs, key=lambda p: (p / "config.toml").stat().st_mtime)


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def data_fingerprint(data_path: str) -> str:
    """The first 10 hex digits of the dataset manifest's sha256 ("?" when it is not there)."""
    manifest = Path(data_path) / "dataset.json"
    try:
        return hashlib.sha256(manifest.read_bytes()).hexdigest()[:10]
    except OSError:
        return "?"


def summary(run: Path, root: Path | None = None) -> dict[str, Any]:
    """One row of ``genrec runs list``."""
    cfg = tomllib.loads((run / "config.toml").read_text())
    version, results = _json(run / "version.json"), _json(run / "results.json")
    train = cfg.get("train", {})
    metric = train.get("early_stop_metric", "ndcg@10")
    data = cfg.get("data", {}).get("path", "?")
    if results:
        status = results.get("stopped", "finished")
    elif (run / "metrics.jsonl").exists():
        status = "no results (running or killed)"
    else:
        status = "not started"
    valid = results.get("valid") or {}
    test = results.get("test") or {}
    return {
        "run": str(run.relative_to(root)) if root is not None and run.is_relative_to(root) else str(run),
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime((run / "config.toml").stat().st_mtime)),
        "commit": (version.get("commit") or "?")[:8] + ("+" if version.get("dirty") else ""),
        "data": f"{data} ({data_fingerprint(data)})",
        "status": status,
        "metric": metric,
        "valid": valid.get(metric, (results.get("valid_peak") or {}).get(metric)),
        "test": test.get(metric),
        "minutes": results["train_seconds"] / 60 if "train_seconds" in results else None,
    }


def _cell(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))


def format_list(rows: list[dict[str, Any]]) -> str:
    keys = ["run", "started", "commit", "data", "status", "metric", "valid", "test", "minutes"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.1f}" if k == "minutes" and r[k] is not None else _cell(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def show(run: Path) -> str:
    """``genrec runs show``: the summary, then every validation and test metric of the results."""
    s = summary(run)
    out = [f"{k}: {f'{v:.1f}' if k == 'minutes' and v is not None else _cell(v)}" for k, v in s.items()]
    results = _json(run / "results.json")
    for split in ("valid", "test"):
        m = results.get(split) or {}
        names = sorted(k for k, v in m.items() if isinstance(v, float) and not k.endswith("_se"))
        if names:
            out += ["", f"{split}:"] + [f"  {k} = {m[k]:.4f}" + (f" +- {m[k + '_se']:.4f}" if k + "_se" in m else "")
                                        for k in names]
    files = sorted(p.name for p in run.iterdir())
    out += ["", "files: " + ", ".join(files)]
    return "\n".join(out)


def cmd_runs(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise SystemExit(f"genrec runs {args.runs_cmd} takes no config overrides: {overrides}")
    if args.runs_cmd == "show":
        run = Path(args.run)
        if not (run / "config.toml").exists():
            raise FileNotFoundError(f"{run}: not a run directory (no config.toml)")
        print(show(run))
        return 0
    root = Path(args.root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory of runs")
    print(format_list([summary(r, root) for r in find_runs(root)]))
    return 0
