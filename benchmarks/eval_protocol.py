"""Evaluation as served, before and after: what counting repeated targets as hits overstated.

Before issue 40, ``target_ranks`` took a target's score before the history was masked, so a
target that repeats a history item was ranked among the unseen items: a hit offline that the
server, which leaves the history out, can never return. This benchmark scores one checkpoint
(and the two baselines) on the same test users three ways, side by side:

* ``served``: the rule now (history excluded; a repeated target is a miss);
* ``former``: the rule before (history excluded, a repeated target ranked by its score);
* ``no_exclusion``: nothing excluded (``eval.exclude_history = false``).

Data: the first-order synthetic process (``first_order()``, the demo's logs until 2026-12-05,
in ``data/synthetic_first_order``: Zipf draws repeat popular items) and the same generator
with repeat consumption on (``--repeat``): the recorded figures are on those rows. The model: the
demo's config (``configs/demo.toml``), trained ``--epochs`` epochs on each.

    python -m genrec.benchmarks.eval_protocol [--epochs 5] [--repeat 0.3]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from genrec.benchmarks.common import ROOT, machine, shown_path, today, update_results_md, write_json
from genrec.models.inputs import SequenceBatch
from genrec.train.eval.baselines import Baseline
from genrec.train.eval.evaluate import RankingMetrics, mask_seen, repeated_targets, target_ranks

RULES = ("served", "former", "no_exclusion")
KEYS = ("hr@1", "hr@10", "ndcg@10", "mrr")


def former_ranks(scores: torch.Tensor, targets: torch.Tensor, corpus: torch.Tensor, seen_ids: torch.Tensor,
                 seen_lengths: torch.Tensor) -> torch.Tensor:
    """The rule before issue 40, kept here only to measure what it overstated: the target's
    score taken before the history is masked, so a repeated target still ranks among the
    unseen items."""
    tidx = torch.searchsorted(corpus, targets)
    target_score = scores.gather(1, tidx[:, None])
    masked = mask_seen(scores, corpus, seen_ids, seen_lengths)
    own = (masked.gather(1, tidx[:, None]) == target_score).squeeze(1)
    return (masked >= target_score).sum(1) - own.long()


class ThreeRules:
    """One RankingMetrics per rule, fed the same score matrices; counts repeated targets."""

    def __init__(self) -> None:
        self.metrics = {r: RankingMetrics((1, 10), (10,)) for r in RULES}
        self.repeats = 0

    def update(self, scores: torch.Tensor, batch: SequenceBatch, corpus: torch.Tensor) -> None:
        seen = (batch.seen_ids, batch.seen_lengths)
        self.metrics["served"].update(target_ranks(scores, batch.targets, corpus, *seen))
        self.metrics["former"].update(former_ranks(scores, batch.targets, corpus, *seen))
        self.metrics["no_exclusion"].update(target_ranks(scores, batch.targets, corpus))
        self.repeats += int(repeated_targets(batch.targets, *seen).sum())

    def result(self) -> dict:
        out = {r: {k: round(v, 4) for k, v in m.compute().items() if k in KEYS}
               for r, m in self.metrics.items()}
        users = self.metrics["served"].count
        out["users"], out["repeated_targets"] = int(users), round(self.repeats / max(users, 1), 4)
        out["overstated_hr@10"] = round(out["former"]["hr@10"] / max(out["served"]["hr@10"], 1e-9), 3)
        return out


@torch.no_grad()
def score_run(job: Any, model: torch.nn.Module, emb: Any) -> dict:  # noqa: ANN401 - a run's JobConfig
    """The run's model (``load_run_model``) on the test split, three ways."""
    from genrec.train.data.reader import make_reader
    from genrec.train.data.schema import read_info
    from genrec.train.job import task_masks

    model.eval()
    corpus = model.corpus_ids
    items = model.item_embeddings(corpus)
    tasks = task_masks(job, read_info(job.data.path))
    rules = ThreeRules()
    for batch in make_reader(job.data, "test", emb, job.model.max_seq_len, tasks=tasks):
        rules.update(model.head.scores(model.user_embeddings(batch), items).float(), batch, corpus)
    return rules.result()


def score_baseline(data: Path, kind: str, job: Any, emb: Any) -> dict:  # noqa: ANN401
    """A baseline counted on the run's training span, on the same test users, three ways."""
    from genrec.train.data.reader import make_reader

    base = Baseline(data, kind, job.data.valid_users)
    rules = ThreeRules()
    for batch in make_reader(job.data, "test", emb, job.model.max_seq_len):
        offsets = batch.seq.offsets()[: batch.batch_size + 1]
        rules.update(base.scores(batch.seq.values()[offsets[1:] - 1]), batch, base.corpus)
    return rules.result()


def dataset_for(repeat: float) -> Path:
    from genrec.train.data.synthetic import first_order, generate

    out = ROOT / "data" / ("synthetic_first_order" if repeat == 0 else f"synthetic_repeat{repeat:g}")
    if not (out / "dataset.json").exists():
        generate(first_order(repeat=repeat), out)
    return out


def main() -> None:
    from genrec.train.cli import load_run_model
    from genrec.train.job import load_job
    from genrec.train.loop.launch import run_training

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--repeat", type=float, default=0.3, help="the second dataset's repeat (first_order())")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    ap.add_argument("--out-dir", default="runs/benchmarks")
    args = ap.parse_args()
    records = []
    for repeat in (0.0, args.repeat):
        data = dataset_for(repeat)
        job = load_job(ROOT / "configs" / "demo.toml",
                       [f'--data.path="{data}"', f'--run.out_dir="{args.out_dir}"', f"--train.max_epochs={args.epochs}",
                        f"--run.name=eval_protocol_repeat{repeat:g}"]
                       + ([f"--train.threads={args.threads}"] if args.threads else []))
        run_dir, res = run_training(job)
        job, model, emb, _ = load_run_model(run_dir, None, None)  # once: the model and both baselines
        rows = {"hstu (demo config)": score_run(job, model, emb)}
        rows.update({f"{kind} baseline": score_baseline(data, kind, job, emb) for kind in ("popular", "transition")})
        records.append({"data": shown_path(data), "synthetic_repeat": repeat, "epochs": res["epochs"],
                        "run_dir": shown_path(run_dir), "rows": rows})
        print(records[-1])
    write_json("eval_protocol", {"date": today(), "machine": machine(),
                                 "command": f"python -m genrec.benchmarks.eval_protocol --epochs {args.epochs} "
                                            f"--repeat {args.repeat} --threads {args.threads}",
                                 "rules": list(RULES), "records": records})
    update_results_md()


# -- rendering (RESULTS.md / DETAILS.md) -------------------------------------------------------

def eval_protocol(d: dict) -> list[str]:
    """The section of ``results/eval_protocol.json``."""
    from genrec.benchmarks.report import command, footer, num, table

    rows = []
    for rec in d.get("records", []):
        for name, r in rec.get("rows", {}).items():
            rows.append([f"repeat {num(rec.get('synthetic_repeat'), '.1f')}", name,
                         num(100 * r.get("repeated_targets", float("nan")), ".1f", "%"),
                         *(num(r.get(rule, {}).get("hr@10")) for rule in RULES),
                         num(r.get("served", {}).get("ndcg@10")), num(r.get("former", {}).get("ndcg@10")),
                         num(r.get("overstated_hr@10"), ".2f", "x")])
    cmd = command(d, "python -m genrec.benchmarks.eval_protocol")
    return ["## Evaluation as served: what counting repeated targets overstated (synthetic logs)", "",
            "One checkpoint per dataset (the demo's config) and both baselines, the same test users scored three "
            "ways: as served (history excluded, a target that repeats a history item is a miss: the rule since "
            "2026-12-04), the former rule (history excluded but a repeated target still ranked by its score) and "
            "no exclusion. ML-1M and Amazon Beauty have no repeated targets: their figures are unchanged. Figures "
            "on synthetic data recorded before 2026-12-04 (ranking's retrieval NDCG@10) used the former rule.", "",
            *table(["data", "model", "repeated targets", "HR@10 served", "HR@10 former", "HR@10 no exclusion",
                    "NDCG@10 served", "NDCG@10 former", "former / served HR@10"], rows), *footer(d, cmd)]


def eval_protocol_summary(d: dict) -> tuple[str, str]:
    from genrec.benchmarks.report import num

    recs = d.get("records") or [{}]
    hstu = next(iter(recs[0].get("rows", {}).values()), {})
    return (f"demo logs ({num(100 * hstu.get('repeated_targets', float('nan')), '.0f', '%')} repeated targets): "
            f"HSTU HR@10 {num(hstu.get('served', {}).get('hr@10'))} as served",
            f"former rule {num(hstu.get('former', {}).get('hr@10'))} ({num(hstu.get('overstated_hr@10'), '.2f', 'x')})")


if __name__ == "__main__":
    main()
