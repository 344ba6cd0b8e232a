"""What the distant past of an 8,192-event history is worth to ranking, and what bounding the reach costs (issue 44).

    python -m genrec.benchmarks.long_ranking [--users 256] [--eval-users 128] [--epochs 6]
                                             [--nproc 2] [--variants full,bounded,window] [--test]
                                             [--runs full=RUN,bounded=RUN,window=RUN]

(``--runs``: read runs trained already instead of training them.)

Data: the synthetic logs' long mode with a dense distant signal (``long_quality.synth_config``
with 64 topics and ``long_return = 0.2``: each held-out user resumes about 12 past-era
interests, thousands of events after they were last seen). Every event is an impression; its
click follows the user's hidden preference, the average of both eras' interests, so a resumed
topic's click rate shows only in past-era clicks. ``--users`` users to train on, twice
``--eval-users`` held out whole: the first half validates, the second tests.

Requests: each of a held-out user's first 4 resumed events opens one request, the 16 events from
it on, ranked after every event before it (as a served Rank sees the log up to its time, and as
``rank_valid`` builds requests): the resumed events among ordinary recent ones.

Models (``configs/long_ranking_synthetic.toml``: the click and conversion heads over target-aware
candidates; the same schedule, seed and data for each):

* ``full``: every position, candidates included, attends to every earlier event (``hstu.window = 0``);
* ``bounded``: the config as shipped, the last 512 events in full and 64-event block summaries
  before them (``hstu.window = 512``);
* ``window``: only the last 512 tokens (``max_seq_len = 512``: a request's history is its last
  495 events), trained on the same cuts and candidates, so it reads the same labels.

Read from each: click and conversion AUC of its raw probabilities (calibration off: a monotone
map's plateaus would tie scores) over all candidates, the resumed ones and the others; each
model's difference from ``full`` with a bootstrap standard error over users (the same users and
candidates); beside them the AUC of the generator's true probabilities (``oracle_*``: what a
model that knew the hidden preference would reach). The validation users decide; ``--test`` reads
the test users once, for the finished recipe.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from genrec.benchmarks.long_quality import (
    WINDOW,
    arguments,
    draw_users,
    launch,
    read_rows,
    run_stats,
    synth_config,
    trained_runs,
    training_table,
    write_rows,
)

NAME = "long_ranking"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/long_ranking_synthetic.toml"
REQUEST = 16  # candidates a request
PER_USER = 4  # requests a held-out user: one from each of its first resumed events
T0 = 1_700_000_000  # every held-out user's first candidate at this time (its log shifted whole)
TASKS = ("click", "conversion")
SUBSETS = ("all", "resumed", "ordinary")
EXTRA = {"oracle_click": "float32", "oracle_conversion": "float32", "resumed": "int8"}
COLUMNS = ("user_id", "item_ids", "timestamps", "actions", *EXTRA)
_rows = functools.partial(read_rows, columns=COLUMNS)
_write = functools.partial(write_rows, extra_columns=EXTRA)


def held_out(rows: dict[str, list], users: range) -> tuple[dict[str, list], dict[int, np.ndarray]]:
    """The requests of the held-out ``users`` (row indices) as dataset rows, and {request id:
    resumed flag of each candidate}. A user's first ``PER_USER`` resumed events each open one
    request (id ``64 * user + k``): the ``REQUEST`` events from it on, after every event before
    it. Its row ends there and its times are shifted whole so the resumed event lands at ``T0``:
    one time cut (``T0``) then makes every request."""
    out: dict[str, list] = {c: [] for c in COLUMNS}
    flags: dict[int, np.ndarray] = {}
    for i in users:
        resumed = np.asarray(rows["resumed"][i])
        for k, t in enumerate(np.flatnonzero(resumed)[:PER_USER]):
            end = min(int(t) + REQUEST, resumed.size)
            times = np.asarray(rows["timestamps"][i][:end], np.int64)
            times = times - times[t] + T0
            acts = np.asarray(rows["actions"][i][:end])
            # the candidates as the reader picks them (at or after the cut, labelled), so an
            # event before t at the same second is read the same way here
            idx = np.flatnonzero((times >= T0) & (acts != 0))[:REQUEST]
            qid = 64 * rows["user_id"][i] + k
            flags[qid] = resumed[idx].astype(bool)
            out["user_id"].append(qid)
            out["timestamps"].append(times.tolist())
            for c in ("item_ids", "actions", "oracle_click", "oracle_conversion", "resumed"):
                out[c].append(rows[c][i][:end])
    return out, flags


def make_data(root: Path, users: int, eval_users: int, cfg: Any) -> dict:
    """``root/all`` (the generator's rows), ``root/train`` (the first ``users`` users, whole) and
    ``root/{valid,test}`` (:func:`held_out`)."""
    def held(rows: dict[str, list], split: str, span: range) -> None:
        _write(root / split, held_out(rows, span)[0])

    return draw_users(root, users, eval_users, cfg, {"per_user": PER_USER}, _rows, _write, held)


VARIANTS = {
    "full": ["--model.hstu.window=0"],
    "bounded": [],
    "window": [f"--model.max_seq_len={WINDOW}"],
}


def train(variant: str, root: Path, out_dir: Path, epochs: int, nproc: int) -> Path:
    """Trains ``variant`` (:data:`VARIANTS`, the same epochs for each: the same labels read)."""
    return launch(CONFIG, variant, VARIANTS[variant], root, out_dir, epochs, nproc)


def requests(job: Any, emb: Any, data: Path) -> Any:
    """A reader of every request of a held-out set (:func:`held_out`) for ``job`` 's model: the
    ``rank_valid`` split cut at ``T0``, so each request is built as ``rank_valid`` builds one
    (the history a served Rank reads, its candidates after it)."""
    from genrec.train.data.reader import make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.job import task_masks, tokens_per_event

    reader = make_reader(replace(job.data, path=str(data)), "rank_valid", emb, job.model.max_seq_len,
                         tasks=task_masks(job, read_info(data)), tokens_per_event=tokens_per_event(job))
    reader.cutoffs = (float(T0), float("inf"))
    return reader


def predict(run: Path, data: Path) -> Any:
    """The ``RankingPredictions`` of a run's checkpoint on a held-out set (:func:`requests`)."""
    from genrec.train.cli import load_run_model
    from genrec.train.eval.ranking_metrics import predict_ranking

    job, model, emb, _ = load_run_model(run, None, None)
    return predict_ranking(model.eval(), requests(job, emb, data))


def _per_user(pred: Any, flags: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(resumed flag [N], user index [N]) of the predictions' candidates, checked against
    :func:`held_out`: each request's candidates together and in order, as many as it counted;
    a user's requests (ids ``64 * user + k``) share its index."""
    ids = pred.users
    resumed = np.zeros(ids.size, bool)
    for q in dict.fromkeys(ids.tolist()):
        at = np.flatnonzero(ids == q)
        if at.size != flags[q].size or np.any(np.diff(at) != 1):
            raise RuntimeError(f"request {q}: {at.size} candidates read, {flags[q].size} expected, in one run")
        resumed[at] = flags[q]
    if set(flags) - set(ids.tolist()):
        raise RuntimeError(f"{len(set(flags) - set(ids.tolist()))} requests were not read")
    owners = ids // 64
    index = {u: k for k, u in enumerate(dict.fromkeys(owners.tolist()))}
    return resumed, np.array([index[u] for u in owners.tolist()])


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from genrec.train.eval.ranking_metrics import auc

    return float(auc(scores, labels))


def compare(preds: dict[str, Any], flags: dict[int, np.ndarray], draws: int = 200, seed: int = 0) -> dict:
    """Per task and candidate subset: each model's AUC, the oracle's, and each model's
    difference from ``full`` with its bootstrap standard error (users drawn with replacement,
    the same draws for every model)."""
    first = next(iter(preds.values()))
    resumed, user = _per_user(first, flags)
    for p in preds.values():
        if not np.array_equal(p.users, first.users) or not np.array_equal(p.labels, first.labels):
            raise RuntimeError("the models were read on different candidates")
    rng = np.random.default_rng(seed)
    n_users = int(user.max()) + 1
    members = [np.flatnonzero(user == k) for k in range(n_users)]
    boots = [np.concatenate([members[k] for k in rng.integers(0, n_users, n_users)]) for _ in range(draws)]
    subsets = {"all": np.ones(user.size, bool), "resumed": resumed, "ordinary": ~resumed}
    out: dict = {}
    for t, task in enumerate(TASKS):
        y = first.labels[:, t]
        scores = {v: p.raw[:, t] for v, p in preds.items()}
        if first.oracle is not None:
            scores["oracle"] = first.oracle[:, t]
        rows: dict = {}
        for name, mask in subsets.items():
            row = {}
            for v, s in scores.items():
                entry = {"auc": _auc(s[mask], y[mask]), "candidates": int(mask.sum()),
                         "positive_rate": float(y[mask].mean()) if mask.any() else None}
                if v not in ("full", "oracle") and "full" in scores:
                    diffs = []
                    for b in boots:
                        b = b[mask[b]]
                        diffs.append(_auc(s[b], y[b]) - _auc(scores["full"][b], y[b]))
                    d = np.asarray(diffs)[np.isfinite(diffs)]  # (a draw with one class has no AUC)
                    entry["vs_full"] = {"difference": entry["auc"] - _auc(scores["full"][mask], y[mask]),
                                        "se": float(np.std(d, ddof=1)) if d.size > 1 else float("nan")}
                row[v] = entry
            rows[name] = row
        out[task] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    from genrec.benchmarks.common import machine, shown_path, today, update_results_md, write_json

    args = arguments(__doc__, NAME).parse_args(argv)

    root = Path(args.data_dir or ROOT / "data" / args.name)
    out_dir = Path(args.out_dir or ROOT / "runs" / args.name)
    cfg = synth_config(1, topics=64, long_return=0.2)
    t0 = time.perf_counter()
    data = make_data(root, args.users, args.eval_users, cfg)
    print(f"data: {root} ({time.perf_counter() - t0:.0f}s)", flush=True)
    runs = trained_runs(args, root, out_dir, train)
    import torch

    torch.set_num_threads(2)
    every = _rows(root / "all")
    result: dict = {
        "date": today(),
        "machine": machine(),
        "command": " ".join(["python -m genrec.benchmarks.long_ranking", *sys.argv[1:]]),
        "data": data,
        "config": CONFIG,
        "runs": {v: {"run_dir": shown_path(r), **run_stats(r)} for v, r in runs.items()},
    }
    splits = {"valid": range(args.users, args.users + args.eval_users)}
    if args.test:
        splits["test"] = range(args.users + args.eval_users, args.users + 2 * args.eval_users)
    for split, span in splits.items():
        flags = held_out(every, span)[1]
        t1 = time.perf_counter()
        preds = {v: predict(r, root / split) for v, r in runs.items()}
        result[split] = compare(preds, flags)
        result[split]["requests"] = len(flags)
        result[split]["seconds"] = round(time.perf_counter() - t1, 1)
        for task in TASKS:
            for name in SUBSETS:
                print(f"{split:5s} {task:10s} {name:8s} " + " ".join(
                    f"{v}={row['auc']:.4f}" for v, row in result[split][task][name].items()), flush=True)
    write_json(args.name, result)
    update_results_md()
    return 0


# -- the report's section ---------------------------------------------------------------------

LABELS = {"full": "full attention", "bounded": "bounded (512 + summaries)", "window": "last 512 only",
          "oracle": "oracle (true probabilities)"}


def _table_rows(split: dict, task: str) -> list[list[str]]:
    """One row per model: AUC on all, resumed and ordinary candidates; the difference from full
    attention (bootstrap SE) on all and on the resumed ones."""
    from genrec.benchmarks.report import get, num

    def diff(v: str, name: str) -> str:
        d = get(split, f"{task}.{name}.{v}.vs_full.difference")
        return "-" if d is None else num(d, "+.4f") + " ± " + num(get(split, f"{task}.{name}.{v}.vs_full.se"), ".4f")

    return [[LABELS.get(v, v), *(num(get(split, f"{task}.{name}.{v}.auc")) for name in SUBSETS),
             diff(v, "all"), diff(v, "resumed")] for v in (get(split, f"{task}.all") or {})]


def long_ranking(d: dict) -> list[str]:
    """The results pages' section of ``results/long_ranking.json``."""
    from genrec.benchmarks.report import MISSING, command, footer, get, num, table

    head = ["model", "AUC: all", "AUC: resumed", "AUC: ordinary", "all - full", "resumed - full"]
    runs = d.get("runs") or {}
    data = d.get("data") or {}

    def counts(split: str) -> str:
        a, r = (get(d, f"{split}.click.{s}.oracle.candidates") for s in ("all", "resumed"))
        return f"{num(get(d, f'{split}.requests'), 'd')} requests, {num(a, 'd')} candidates, {num(r, 'd')} resumed"

    out = [f"## Ranking over 8,192-event histories (synthetic, {num(data.get('num_topics'), 'd')} topics, "
           f"long_return {data.get('long_return')})", "",
           f"{num(data.get('users'), 'd')} users of {num(data.get('long_len'), 'd')} events trained on; "
           f"{num(data.get('eval_users'), 'd')} others validate and as many test, held out whole. Each of a held-out "
           "user's first 4 resumed events (a past-era interest back after thousands of events; its clicks follow "
           "a preference only past-era clicks show) opens a request of the 16 events from it on, after every "
           f"event before it. Config `{d.get('config', MISSING)}`, one schedule for all; raw click probabilities "
           "(no calibration). Bounded: `hstu.window = 512` with 64-event block summaries; last 512 only: "
           "`max_seq_len = 512`. Differences from full attention with a bootstrap SE over users.", "",
           f"Click, validation ({counts('valid')}):", "", *table(head, _table_rows(d.get("valid") or {}, "click"))]
    if d.get("test"):
        out += ["", f"Click, test, read once ({counts('test')}):", "",
                *table(head, _table_rows(d["test"], "click"))]
    out += ["", "Conversion, validation:", "", *table(head, _table_rows(d.get("valid") or {}, "conversion")),
            "", "Training (each rank one core, DDP):", "",
            *training_table(runs, LABELS),
            *footer(d, command(d, "python -m genrec.benchmarks.long_ranking"))]
    return out


def long_ranking_summary(d: dict) -> tuple[str, str]:
    """(headline, anchor) of the page's table at the top."""
    from genrec.benchmarks.report import get, num

    v = d.get("valid") or {}
    return (f"valid click AUC bounded {num(get(v, 'click.all.bounded.auc'))}, last 512 "
            f"{num(get(v, 'click.all.window.auc'))}; resumed {num(get(v, 'click.resumed.bounded.auc'))} / "
            f"{num(get(v, 'click.resumed.window.auc'))}",
            f"full {num(get(v, 'click.all.full.auc'))}; resumed {num(get(v, 'click.resumed.full.auc'))}")


if __name__ == "__main__":
    sys.exit(main())
