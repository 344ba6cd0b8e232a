"""What the distant past of an 8,192-event history is worth, and what bounding the reach costs (issue 44).

    python -m genrec.benchmarks.long_quality [--users 256] [--eval-users 128] [--epochs 6]
                                             [--nproc 2] [--variants full,bounded,window] [--test]
                                             [--runs full=RUN,bounded=RUN,window=RUN]

(``--runs``: read runs trained already instead of training them.)

Data: the synthetic logs' long mode (``first_order`` process, ``long_len = 8192``, a catalogue
of 4,096 items in 32 topics), ``--users`` users to train on and twice ``--eval-users`` held out
whole: the first half validates, the second tests. A held-out user's events of kind
``resumed`` come back to a past-era interest, at the item after the last one consumed in it,
thousands of events earlier: the full history names that item, the last 512 events never hold
its topic. Each resumed event is one query (the history before it, as a server receives it);
each held-out user's last event is another (the ordinary case, mostly the recent interests).

Models (``configs/long_synthetic.toml``, the same schedule, seed and data for each):

* ``full``: every position attends to every earlier event (``hstu.window = 0``);
* ``bounded``: the config as shipped, the last 512 events in full and 64-event block summaries
  before them (``hstu.window = 512``): a candidate's cost does not grow with the history;
* ``window``: only the last 512 events (``max_seq_len = 512``, so the bounded pass's window
  holds every event: full attention over them; trained on a random 512-event window of each
  user per epoch, for 16 times the epochs, so it reads as many targets).

Beside them, the generator's process (:func:`process_ranks`): each target's rank under the
process that drew it, with and without the distant past: what the data lets a model gain.

Read from each: HR / NDCG / MRR of the served top-k (``model.user_embeddings`` on the query's
history, the catalogue scored in full, history items not excluded, as the config serves),
per query set, and each model's paired difference from ``full`` over the same queries. The
validation queries decide; ``--test`` reads the test queries once, for the finished recipe.
Training throughput (samples/s) and peak memory per rank come from each run's metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

NAME = "long_quality"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/long_synthetic.toml"
LONG = 8192
WINDOW = 512
KEYS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr")
PAIRED = ("hr@10", "ndcg@10", "hr@50", "ndcg@50")
SETS = ("resumed", "last")


def synth_config(users: int, seed: int = 0, topics: int = 32, long_return: float = 0.01):  # noqa: ANN201
    """The data's generator (a ``SyntheticConfig``): ``topics`` topics share the 4,096 items."""
    from genrec.train.data.synthetic import first_order

    return first_order(num_users=users, long_len=LONG, num_items=4096, num_topics=topics, long_recent=0.3,
                       long_quiet=1024, long_return=long_return, seed=seed)


def read_rows(path: Path, columns: tuple[str, ...] = ("user_id", "item_ids", "timestamps", "actions",
                                                     "resumed")) -> dict[str, list]:
    """``columns`` of the dataset at ``path``, as lists per column."""
    import pyarrow.parquet as pq

    return pq.read_table(path / "interactions.parquet", columns=list(columns)).to_pydict()


def write_rows(out: Path, rows: dict[str, list], extra_columns: dict[str, str] | None = None) -> None:
    """A dataset at ``out``: the events of ``rows`` and the ``extra_columns`` (name -> type) it holds."""
    from genrec.train.data.schema import DatasetWriter
    from genrec.train.data.synthetic import ACTIONS

    with DatasetWriter(out, source="synthetic", action_names=ACTIONS, extra_columns=extra_columns) as w:
        w.write({k: rows[k] for k in ("user_id", "item_ids", "timestamps", "actions", *(extra_columns or {}))})


def query_points(rows: dict[str, list], users: range, per_user: int = 64) -> Iterator[tuple[str, int, int, int]]:
    """(set, query id, row, target event) of every query of ``users`` (row indices): ``resumed``,
    a user's first ``per_user`` resumed events (query id ``64 * user + k``); ``last``, the user's
    last event (query id ``64 * user``)."""
    for i in users:
        uid = rows["user_id"][i]
        for k, t in enumerate(np.flatnonzero(np.asarray(rows["resumed"][i]))[: min(per_user, 64)]):
            yield "resumed", 64 * uid + k, i, int(t)
        yield "last", 64 * uid, i, len(rows["item_ids"][i]) - 1


def queries(rows: dict[str, list], users: range, per_user: int = 64) -> dict[str, dict[str, list]]:
    """The query sets of ``users`` as dataset rows (:func:`query_points`): each target event
    with the history before it."""
    out = {s: {"user_id": [], "item_ids": [], "timestamps": [], "actions": []} for s in SETS}
    for name, qid, i, t in query_points(rows, users, per_user):
        out[name]["user_id"].append(qid)
        for c in ("item_ids", "timestamps", "actions"):
            out[name][c].append(rows[c][i][: t + 1])
    return out


def draw_users(root: Path, users: int, eval_users: int, cfg: Any, stamp_extra: dict,
               rows_of: Callable[[Path], dict[str, list]], write: Callable[[Path, dict[str, list]], None],
               held_out: Callable[[dict[str, list], str, range], None]) -> dict:
    """``root/all`` (``users`` + 2 x ``eval_users`` users of ``cfg``), ``root/train`` (the first
    ``users``, written by ``write``) and the held-out users of each split (``held_out(rows,
    split, span)``: the next ``eval_users`` validate, the last test). Drawn once: a stamp of the
    settings (with ``stamp_extra``) keeps it."""
    from genrec.train.data.synthetic import generate

    cfg = replace(cfg, num_users=users + 2 * eval_users)
    stamp = root / "synthetic.json"
    want = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__} | {"users": users, "eval_users": eval_users,
                                                                     **stamp_extra}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return want
    generate(cfg, root / "all", progress=False)
    rows = rows_of(root / "all")
    write(root / "train", {k: v[:users] for k, v in rows.items()})
    for split, span in (("valid", range(users, users + eval_users)),
                        ("test", range(users + eval_users, users + 2 * eval_users))):
        held_out(rows, split, span)
    stamp.write_text(json.dumps(want, indent=2) + "\n")
    return want


def make_data(root: Path, users: int, eval_users: int, cfg: Any, per_user: int = 64) -> dict:
    """``root/train`` (the first ``users`` users of ``cfg``'s rows) and
    ``root/{valid,test}_{resumed,last}``."""
    def held(rows: dict[str, list], split: str, span: range) -> None:
        for name, q in queries(rows, span, per_user).items():
            write_rows(root / f"{split}_{name}", q)

    return draw_users(root, users, eval_users, cfg, {"resumed_per_user": per_user}, read_rows, write_rows, held)


def process_ranks(rows: dict[str, list], users: range, distant: bool, cfg: Any = None,
                  per_user: int = 64) -> dict[str, dict[int, int]]:
    """Each query's rank under the generator's own process (``synth_config``: the first-order
    long mode), its mixtures estimated from the history as any model would have to: the next
    item's probability given the previous event, the recent interests (the topics of the last
    512 events) and, with ``distant``, the past era's (its topics' shares before the recent era)
    with the chance that one not seen since resumes at the item after its last one. Without
    ``distant``, what the last 512 events allow. Ties rank against the target, as the evaluator's
    ranks do. The reference for what the data lets a model gain from the distant past."""
    from genrec.train.data.synthetic import SyntheticWorld

    cfg = cfg or synth_config(1)  # the rows' generator (its long_len, eras and rates)
    world = SyntheticWorld(cfg)
    m, k = world.per_topic, cfg.num_topics
    zipf = world.zipf_probs()
    recent_from = cfg.long_len - max(1, round(cfg.long_recent * cfg.long_len))

    def rank(topics: np.ndarray, ranks: np.ndarray, t: int) -> int:
        topic, rk = topics[:t], ranks[:t]
        recent = np.bincount(topic[-WINDOW:], minlength=k) / min(t, WINDOW)
        prob = (1 - cfg.topic_stay) * recent[:, None] * zipf[None, :]
        prob[topic[-1]] += cfg.topic_stay * (1 - cfg.follow) * zipf
        prob[topic[-1], (rk[-1] + 1) % m] += cfg.topic_stay * cfg.follow
        if distant and t >= recent_from + cfg.long_quiet:
            past = np.bincount(topic[:recent_from], minlength=k) / recent_from
            last = np.full(k, -1)
            np.maximum.at(last, topic, np.arange(t))  # each topic's last event before t
            for tp in np.flatnonzero((last >= 0) & (last < recent_from)):
                prob[tp, (rk[last[tp]] + 1) % m] += cfg.long_return * past[tp]
        # item (topic, rank) at topic * m + rank: the whole catalogue
        return int((prob >= prob[topics[t], ranks[t]]).sum() - 1)

    out: dict[str, dict[int, int]] = {s: {} for s in SETS}
    row, parts = -1, None
    for name, qid, i, t in query_points(rows, users, per_user):
        if i != row:  # a user's items as (topic, rank), once for all its queries
            items = np.asarray(rows["item_ids"][i])
            row, parts = i, (world.item_topic(items), world.item_rank(items))
        out[name][qid] = rank(*parts, t)
    return out


VARIANTS = {
    "full": ["--model.hstu.window=0"],
    "bounded": [],
    "window": [f"--model.max_seq_len={WINDOW}", '--data.train_window="random"'],
}


def launch(config: str, variant: str, extra: list[str], root: Path, out_dir: Path, epochs: int, nproc: int) -> Path:
    """Trains ``config`` with ``extra`` overrides as run ``variant`` on ``root/train`` under
    torchrun (one thread per process); its run directory."""
    run_id = f"{variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [f'--data.path="{root / "train"}"', f'--run.out_dir="{out_dir}"', f"--run.name={variant}",
                 f"--run.id={run_id}", f"--train.max_epochs={epochs}", "--train.progress=false", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "genrec.cli", "train", "--config", str(ROOT / config), *overrides]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out_dir / variant / run_id


def train(variant: str, root: Path, out_dir: Path, epochs: int, nproc: int) -> Path:
    """Trains ``variant`` (:data:`VARIANTS`; the window for 16x the epochs: as many targets)."""
    scale = LONG // WINDOW if variant == "window" else 1
    return launch(CONFIG, variant, VARIANTS[variant], root, out_dir, epochs * scale, nproc)


def trained_runs(args: argparse.Namespace, root: Path, out_dir: Path,
                 train_fn: Callable[[str, Path, Path, int, int], Path]) -> dict[str, Path]:
    """{variant: run directory}: those ``--runs`` names, the other ``--variants`` trained now."""
    runs = {k: Path(v) for k, v in (x.split("=", 1) for x in args.runs.split(",") if x)}
    for v in args.variants.split(","):
        if v not in runs:
            runs[v] = train_fn(v, root, out_dir, args.epochs, args.nproc)
    return runs


def training_table(runs: dict, labels: dict[str, str]) -> list[str]:
    """The report's table of each run's epochs, samples/s and peak memory per rank, train time."""
    from genrec.benchmarks.report import num, table

    return table(["model", "epochs", "samples/s per rank", "peak MiB per rank", "train s"],
                 [[labels.get(v, v), num(r.get("epochs"), "d"), num(r.get("samples_per_s_per_rank"), ".2f"),
                   num(r.get("peak_mib_per_rank"), ".0f"), num(r.get("train_seconds"), ".0f")]
                  for v, r in runs.items()])


def arguments(doc: str, name: str) -> argparse.ArgumentParser:
    """The options the long-history comparisons share (``name``: the default results name)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--eval-users", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--variants", default="full,bounded,window")
    ap.add_argument("--runs", default="", help="variant=RUN_DIR,...: evaluate these runs instead of training")
    ap.add_argument("--name", default=name, help="results/NAME.json, data/NAME, runs/NAME")
    ap.add_argument("--data-dir", default="", help="default: data/NAME")
    ap.add_argument("--out-dir", default="", help="default: runs/NAME")
    ap.add_argument("--test", action="store_true", help="read the test split too (once, the finished recipe)")
    return ap


def run_stats(run: Path) -> dict:
    """Throughput (samples/s per rank, each rank one core) and peak memory per rank of a run,
    from its results and per-interval metrics (the first interval, warm-up, left out)."""
    res = json.loads((run / "results.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if x.get("kind") == "train" and "samples_per_s" in x]
    sps = [x["samples_per_s"] for x in steps[1:]] or [x["samples_per_s"] for x in steps]
    # (one number a record from one process, one per rank from several)
    peak = max((float(np.max(x["peak_mem_mb"])) for x in steps if x.get("peak_mem_mb")), default=None)
    return {"epochs": res["epochs"], "steps": res["steps"], "train_seconds": res["train_seconds"],
            "samples_per_s_per_rank": round(float(np.median(sps)), 3) if sps else None,
            "peak_mib_per_rank": peak}


def load(run: Path) -> tuple:
    """(job, model in eval mode, embedding config) of a run's checkpoint: its own catalogue, the
    items of its train users."""
    from genrec.train.cli import load_run_model

    job, model, emb, _ = load_run_model(run, None, None)
    return job, model.eval(), emb


def ranks_of(loaded: tuple, data: Path) -> dict[int, int]:
    """{query id: rank} of a :func:`load` ed model on the query set ``data`` (its test split:
    the last event from the events before it)."""
    from genrec.train.data.reader import make_reader
    from genrec.train.eval.paired import model_ranks

    job, model, emb = loaded
    reader = make_reader(replace(job.data, path=str(data)), "test", emb, job.model.max_seq_len)
    return model_ranks(model, reader, job.eval)


def compare(models: dict[str, tuple], root: Path, split: str, every: dict[str, list], users: range, synth: Any,
            per_user: int = 64) -> dict:
    """Per query set: each :func:`load` ed model's metrics and its paired difference from
    ``full``, then the generator's process with and without the distant past
    (:func:`process_ranks` on ``every``, the rows of ``root/all``)."""
    from genrec.train.eval.evaluate import EvalConfig
    from genrec.train.eval.paired import paired_difference, rank_metrics

    cfg = EvalConfig(hr_ks=(1, 10, 50), ndcg_ks=(10, 50))
    process = {f"process_{'full' if d else 'window'}": process_ranks(every, users, d, synth, per_user)
               for d in (True, False)}
    out: dict = {}
    for name in SETS:
        ranks = {v: ranks_of(loaded, root / f"{split}_{name}") for v, loaded in models.items()}
        base = rank_metrics(ranks["full"], cfg) if "full" in ranks else None
        rows = {}
        for v, r in {**ranks, **{p: q[name] for p, q in process.items()}}.items():
            m = rank_metrics(r, cfg)
            row = {"queries": len(r), **{k: m[k] for k in KEYS}}
            if v in ranks and v != "full" and base is not None:
                diff = paired_difference(r, ranks["full"], PAIRED)
                row["vs_full"] = {k: {"difference": d, "se": se} for k, (d, se) in diff.items()}
                row["ratio_to_full"] = {k: (m[k] / base[k] if base[k] else None) for k in KEYS}
            rows[v] = row
        out[name] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    from genrec.benchmarks.common import machine, shown_path, today, update_results_md, write_json

    ap = arguments(__doc__, NAME)
    ap.add_argument("--topics", type=int, default=32, help="topics sharing the 4,096 items")
    ap.add_argument("--long-return", type=float, default=0.01,
                    help="the chance an event after the quiet start resumes a past-era interest")
    ap.add_argument("--resumed-per-user", type=int, default=64, help="resumed events read a held-out user")
    args = ap.parse_args(argv)

    root = Path(args.data_dir or ROOT / "data" / args.name)
    out_dir = Path(args.out_dir or ROOT / "runs" / args.name)
    cfg = synth_config(1, topics=args.topics, long_return=args.long_return)
    t0 = time.perf_counter()
    data = make_data(root, args.users, args.eval_users, cfg, args.resumed_per_user)
    print(f"data: {root} ({time.perf_counter() - t0:.0f}s)", flush=True)
    runs = trained_runs(args, root, out_dir, train)
    import torch

    torch.set_num_threads(2)
    models = {v: load(r) for v, r in runs.items()}
    every = read_rows(root / "all")
    result = {
        "date": today(),
        "machine": machine(),
        "command": " ".join(["python -m genrec.benchmarks.long_quality", *sys.argv[1:]]),
        "data": data,
        "config": CONFIG,
        "runs": {v: {"run_dir": shown_path(r), **run_stats(r)}
                 for v, r in runs.items()},
        "valid": compare(models, root, "valid", every, range(args.users, args.users + args.eval_users), cfg,
                         args.resumed_per_user),
    }
    if args.test:
        test = range(args.users + args.eval_users, args.users + 2 * args.eval_users)
        result["test"] = compare(models, root, "test", every, test, cfg, args.resumed_per_user)
    for split in ("valid", "test"):
        for name, rows in result.get(split, {}).items():
            for v, row in rows.items():
                print(f"{split:5s} {name:8s} {v:8s} n={row['queries']:4d} "
                      + " ".join(f"{k}={row[k]:.4f}" for k in KEYS), flush=True)
    write_json(args.name, result)
    update_results_md()
    return 0


# -- the report's section ---------------------------------------------------------------------

LABELS = {"full": "full attention", "bounded": "bounded (512 + summaries)", "window": "last 512 only",
          "process_full": "process, whole history", "process_window": "process, last 512"}


def _table_rows(split: dict) -> list[list[str]]:
    """One row per model: the resumed events' HR@50 and MRR, the last events' NDCG@10 and its
    paired difference from full attention."""
    from genrec.benchmarks.report import get, num

    resumed, last = split.get("resumed") or {}, split.get("last") or {}
    out = []
    for v, row in last.items():
        diff = get(row, "vs_full.ndcg@10.difference")
        out.append([LABELS.get(v, v), num(get(resumed, f"{v}.hr@50")), num(get(resumed, f"{v}.mrr")),
                    num(row.get("ndcg@10")),
                    "-" if diff is None else num(diff, "+.4f") + " ± " + num(get(row, "vs_full.ndcg@10.se"), ".4f")])
    return out


def long_quality(d: dict) -> list[str]:
    """The results pages' section of ``results/long_quality.json``."""
    from genrec.benchmarks.report import MISSING, command, footer, get, num, table

    head = ["model", "resumed: HR@50", "resumed: MRR", "last: NDCG@10", "last: NDCG@10 - full (paired)"]
    runs = d.get("runs") or {}
    data = d.get("data") or {}
    n = {s: (num(get(d, f"{s}.resumed.full.queries"), "d"), num(get(d, f"{s}.last.full.queries"), "d"))
         for s in ("valid", "test")}
    other = (f", {num(data.get('num_topics'), 'd')} topics, long_return {data.get('long_return')}"
             if (data.get("num_topics"), data.get("long_return")) != (32, 0.01) else "")
    out = [f"## Distant history's worth (synthetic, 8,192 events{other})", "",
           f"{num(data.get('users'), 'd')} users of {num(data.get('long_len'), 'd')} events trained on; "
           f"{num(data.get('eval_users'), 'd')} others validate and as many test, held out whole. Queries: "
           "each resumed event (a past-era interest resumed at the item after its last one, thousands of events "
           "back; the last 512 events never hold its topic) and each user's last event. Config "
           f"`{d.get('config', MISSING)}`, one schedule for all; the served top-k (history items not excluded). "
           "Process: each target's probability under the process that drew it, its mixtures estimated from "
           "the history (what the data allows a model). Bounded: `hstu.window = 512` with 64-event block "
           "summaries; last 512 only: `max_seq_len = 512`.",
           "", f"Validation ({n['valid'][0]} resumed, {n['valid'][1]} last events):", "",
           *table(head, _table_rows(d.get("valid") or {}))]
    if d.get("test"):
        out += ["", f"Test, read once ({n['test'][0]} resumed, {n['test'][1]} last events):", "",
                *table(head, _table_rows(d["test"]))]
    out += ["", "Training (each rank one core, DDP):", "",
            *training_table(runs, LABELS),
            *footer(d, command(d, "python -m genrec.benchmarks.long_quality"))]
    return out


def long_quality_summary(d: dict) -> tuple[str, str]:
    """(headline, anchor) of the page's table at the top."""
    from genrec.benchmarks.report import get, num

    v = d.get("valid") or {}
    return (f"valid NDCG@10 bounded {num(get(v, 'last.bounded.ndcg@10'))}; resumed HR@50 "
            f"{num(get(v, 'resumed.bounded.hr@50'))}", f"full {num(get(v, 'last.full.ndcg@10'))}; "
            f"{num(get(v, 'resumed.full.hr@50'))} (process {num(get(v, 'resumed.process_full.hr@50'))})")


if __name__ == "__main__":
    sys.exit(main())
