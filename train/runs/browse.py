"""``genrec runs list | show | compare``: the run directories as a table, one run in full, or
several side by side (config differences, metrics, validation curves overlaid).

The run directory stays the source of truth (``config.toml``, ``version.json``,
``results.json``, ``metrics.jsonl``, ``train.log``); nothing here writes. Columns of ``list``: the run (its
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


def last_failure(log: Path, width: int = 60) -> str | None:
    """What the newest attempt of a run died of (its ``train.log``'s "job failed" line, cut
    to ``width``), or None when the newest attempt did not fail (or there is no log)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if " job failed: " in line:
            why = line.split(" job failed: ", 1)[1]
            return why if len(why) <= width else why[: width - 3] + "..."
        if " genrec.train: run " in line:  # the newest attempt's first line: it has not failed (yet)
            return None
    return None


def summary(run: Path, root: Path | None = None) -> dict[str, Any]:
    """One row of ``genrec runs list``."""
    cfg = tomllib.loads((run / "config.toml").read_text())
    version, results = _json(run / "version.json"), _json(run / "results.json")
    train = cfg.get("train", {})
    metric = train.get("early_stop_metric", "ndcg@10")
    data = cfg.get("data", {}).get("path", "?")
    failed = last_failure(run / "train.log")
    if results:
        status = results.get("stopped", "finished")
    elif failed:
        status = f"failed: {failed}"
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


def flat_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as {dotted key: value}; the entries of an array of tables as ``name[i].key``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_keys(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # [[embedding.tables]]
            for i, x in enumerate(v):
                out.update(flat_keys(x, f"{key}[{i}]."))
        else:
            out[key] = v
    return out


def config_differences(have: dict[str, Any], want: dict[str, Any], skip: tuple[str, ...] = ()
                       ) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (have's value, want's value)} for the keys of two configs (nested, as
    ``to_dict`` or TOML gives them) whose values differ, leaving out keys starting with ``skip``."""
    a, b = flat_keys(have), flat_keys(want)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if not k.startswith(skip) and a.get(k) != b.get(k)}


def compare(runs: list[Path], out: Path | None = None) -> str:
    """``genrec runs compare``: the config keys whose values differ, a metric table (the best
    validation value of each run's early-stop metric and its test metrics), and, with ``out``
    and matplotlib, each run's validation curve of that metric overlaid in one PNG."""
    configs = [flat_keys(tomllib.loads((r / "config.toml").read_text())) for r in runs]
    names = [str(r) for r in runs]
    keys = sorted(set().union(*configs))
    differ = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    lines = ["config: " + ("the same" if not differ else f"{len(differ)} keys differ"), ""]
    if differ:
        lines += ["| key | " + " | ".join(names) + " |", "|" + "---|" * (len(runs) + 1)]
        lines += [f"| {k} | " + " | ".join(_cell(c.get(k, "(absent)")) for c in configs) + " |" for k in differ]
        lines.append("")
    rows = [summary(r) for r in runs]
    tests = [(_json(r / "results.json").get("test") or {}) for r in runs]
    metrics = [m for m in ("hr@10", "ndcg@10", "mrr", "gen_hr@10", "gen_ndcg@10") if any(m in t for t in tests)]
    lines += ["| run | metric | valid | " + " | ".join(f"test {m}" for m in metrics) + " | minutes |",
              "|" + "---|" * (len(metrics) + 4)]
    for r, t in zip(rows, tests):
        minutes = f"{r['minutes']:.1f}" if r["minutes"] is not None else ""
        lines.append(f"| {r['run']} | {r['metric']} | {_cell(r['valid'])} | "
                     + " | ".join(_cell(t.get(m)) for m in metrics) + f" | {minutes} |")
    if out is not None and _plot(runs, rows, out):
        lines += ["", f"curves: {out}"]
    return "\n".join(lines)


def _plot(runs: list[Path], rows: list[dict[str, Any]], out: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from genrec.train.runs.directory import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, row in zip(runs, rows):
        evals = [e for e in read_metrics(run / "metrics.jsonl")
                 if e.get("kind") == "eval" and e.get("split") == "valid" and row["metric"] in e]
        ax.plot([e["epoch"] for e in evals], [e[row["metric"]] for e in evals], marker="o", ms=3,
                label=f"{row['run']} ({row['metric']})")
    ax.set(xlabel="epoch", ylabel="validation", title="validation, each run's early-stop metric")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def cmd_runs(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise SystemExit(f"genrec runs {args.runs_cmd} takes no config overrides: {overrides}")
    if args.runs_cmd == "compare":
        runs = [Path(r) for r in args.runs]
        for run in runs:
            if not (run / "config.toml").exists():
                raise FileNotFoundError(f"{run}: not a run directory (no config.toml)")
        print(compare(runs, Path(args.out) if args.out else None))
        return 0
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
