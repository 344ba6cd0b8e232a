"""Merged retrieval at 10^7 items (issue 45, item 4): the dense and the semantic-ID channels of
one finished generative run, and the recall of their union, on a sample of test users.

    python -m genrec.benchmarks.merged_scale --run runs/scale_10m_sid/RUN --max-users 2000

The run (configs/scale_10m_sid.toml) was started from a dense run (configs/scale_10m.toml) whose
item vectors gave the codebook (``genrec sid build``); those two are found through the run's
config (``train.init_from``, ``model.sid.codebook``) and their minutes and the codebook's stats
are recorded beside the recall. The test split is read once, for at most ``--max-users`` users
(every k-th of the split's file: deterministic): dense top-100 exact over the whole catalogue
(scored in blocks, benchmarks/sid_quality.py ``merged_recall``), the decoded top-50 (beam 50
over the trie), their union, and dense top-150. Writes results/merged_10m.json (DETAILS.md only).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from genrec.benchmarks.common import machine, shown_path, today, write_json


def _run(run_dir: Path) -> tuple[float | None, int | None]:
    """A finished run's (training minutes, steps), from its results.json (None: not there)."""
    res = run_dir / "results.json"
    if not res.exists():
        return None, None
    r = json.loads(res.read_text())
    return round(r["train_seconds"] / 60, 2), r.get("steps")


def measure(run_dir: Path, max_users: int, dense_k: int = 100, gen_k: int = 50, split: str = "test") -> dict[str, Any]:
    """The record of ``run_dir``: recall figures, the stages' minutes, peak RSS."""
    from genrec.benchmarks.sid_quality import merged_recall
    from genrec.train.job import load_job
    from genrec.train.loop.checkpoint import resolve_checkpoint

    job = load_job(run_dir / "config.toml")
    dense_run = Path(job.train.init_from)
    dense_dir = resolve_checkpoint(dense_run)[0] if dense_run.exists() else dense_run
    book = Path(job.model.sid.codebook).with_suffix(".json")
    codebook = json.loads(book.read_text()) if book.exists() else {}
    t0 = time.perf_counter()
    merged = merged_recall(run_dir, dense_k, gen_k, max_users=max_users, split=split)
    (dense_min, dense_steps), (gen_min, gen_steps) = _run(dense_dir), _run(run_dir)
    minutes = {"dense_train": dense_min,
               "sid_build": round((codebook.get("build", {}).get("load_seconds", 0)
                                   + codebook.get("build", {}).get("build_seconds", 0)) / 60, 2) or None,
               "generative_train": gen_min, "merged_recall": round((time.perf_counter() - t0) / 60, 2)}
    return {"date": today(), "machine": machine(), "shared_machine": True, "merged": merged,
            "minutes": minutes, "steps": {"dense": dense_steps, "generative": gen_steps},
            "peak_rss_mb": {"merged_recall": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                            "sid_build": codebook.get("build", {}).get("peak_rss_mb")},
            "codebook": codebook.get("stats"), "codebook_build": codebook.get("build"),
            "beam_width": gen_k, "dense_run": shown_path(dense_dir), "run_dir": shown_path(run_dir),
            "command": "python -m genrec.benchmarks.merged_scale " + " ".join(sys.argv[1:])}


def merged_scale_section(d: dict) -> list[str]:
    """DETAILS.md's section of results/merged_10m.json (report.py: DETAILS.md only)."""
    from genrec.benchmarks.report_format import command, footer, num, table

    m, c, mins = d.get("merged", {}), d.get("codebook") or {}, d.get("minutes", {})
    keys = [k for k in m if "recall" in k]
    stages = [[k.replace("_", " "), num(v, ".1f")] for k, v in mins.items()]
    sizes = "x".join(map(str, c.get("sizes", []))) or "missing"
    return ["## Merged retrieval at 10^7 items (dense + semantic IDs, test sample)", "",
            f"One generative run (configs/scale_10m_sid.toml) over a {num(m.get('catalogue'), ',d')}-item catalogue, "
            f"{num(m.get('users'), ',d')} test users (every {m.get('user_stride')}th of the split), test split read "
            "once; dense lists exact over the whole catalogue (the served ANN index returns about 0.96 of exact "
            "top-100), decoded: beam 50 over the trie, history left out. The machine was shared with other work.", "",
            *table(["recall of the test item", *keys], [["", *(num(m.get(k)) for k in keys)]]), "",
            f"Decoded items valid (catalogue, not in the history): {num(m.get('valid_share'), '.2%')} of "
            f"{num(m.get('decoded_items'), ',d')}. Codebook {sizes}: collision rate "
            f"{num(c.get('collision_rate'), '.1%')}, at most {num(c.get('max_collisions'), 'd')} items on one "
            f"3-level code. Peak RSS: recall {num(d.get('peak_rss_mb', {}).get('merged_recall'), ',d')} MB, "
            f"codebook build {num(d.get('peak_rss_mb', {}).get('sid_build'), ',d')} MB.", "",
            *table(["stage", "minutes"], stages),
            *footer(d, command(d, "python -m genrec.benchmarks.merged_scale"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a finished configs/scale_10m_sid.toml run")
    ap.add_argument("--max-users", type=int, default=2000)
    ap.add_argument("--name", default="merged_10m", help="results/<name>.json")
    ap.add_argument("--split", default="test", choices=["test", "valid"],
                    help="valid: for choices between runs, written to RUN/merged_valid.json, not to results/")
    args = ap.parse_args()
    record = measure(Path(args.run), args.max_users, split=args.split)
    if args.split == "test":
        path = write_json(args.name, record)
    else:
        path = Path(args.run) / "merged_valid.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("merged", "minutes", "peak_rss_mb")}, indent=1), f"\nwrote {path}")


if __name__ == "__main__":
    main()
