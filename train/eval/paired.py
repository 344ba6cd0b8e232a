"""Per-user ranks and paired differences: two recommenders read on the same users.

A table of means says which row is higher; whether the gap is more than noise needs the
per-user difference. Both recommenders rank each user's target in the list a server would
return (:func:`~genrec.train.eval.evaluate.target_ranks`, history excluded as
``EvalConfig.exclude_history`` says), so the means here are the evaluator's, and the
difference's standard error is over users (each user's two values are correlated: the
paired error is smaller than either mean's).

Example: ranks {1: 0, 2: 12} against {1: 3, 2: 12} -> HR@1 difference +0.5 +- 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from genrec.models.inputs import SequenceBatch
from genrec.train.eval.baselines import Baseline
from genrec.train.eval.evaluate import EvalConfig, RankingMetrics, target_ranks

PAIRED_KEYS = ("hr@1", "hr@10", "ndcg@10")


@torch.no_grad()
def model_ranks(model: torch.nn.Module, batches: Iterable[SequenceBatch], cfg: EvalConfig) -> dict[int, int]:
    """{user id: 0-based rank of the target} of a retrieval model (``corpus_ids``,
    ``item_embeddings``, ``user_embeddings``, ``head.scores``), as ``evaluate`` ranks it."""
    was_training = model.training
    model.eval()
    corpus = model.corpus_ids
    items = torch.cat([model.item_embeddings(corpus[i : i + cfg.item_chunk])
                       for i in range(0, corpus.numel(), cfg.item_chunk)])
    out: dict[int, int] = {}
    for batch in batches:
        scores = model.head.scores(model.user_embeddings(batch), items).float()
        seen = (batch.seen_ids, batch.seen_lengths) if cfg.exclude_history else (None, None)
        out.update(zip(batch.user_ids.tolist(), target_ranks(scores, batch.targets, corpus, *seen).tolist()))
    model.train(was_training)
    return out


def baseline_ranks(baseline: Baseline, batches: Iterable[SequenceBatch], cfg: EvalConfig) -> dict[int, int]:
    """{user id: rank} of a non-neural baseline, as ``evaluate_baseline`` ranks it (scores [B, N]
    from each user's last history item)."""
    out: dict[int, int] = {}
    for batch in batches:
        offsets = batch.seq.offsets()[: batch.batch_size + 1]
        scores = baseline.scores(batch.seq.values()[offsets[1:] - 1])
        seen = (batch.seen_ids, batch.seen_lengths) if cfg.exclude_history else (None, None)
        out.update(zip(batch.user_ids.tolist(), target_ranks(scores, batch.targets, baseline.corpus, *seen).tolist()))
    return out


def rank_metrics(ranks: dict[int, int], cfg: EvalConfig) -> dict[str, float]:
    """The evaluator's metrics (HR@k, NDCG@k, MRR, their standard errors, users) of per-user ranks."""
    m = RankingMetrics(cfg.hr_ks, cfg.ndcg_ks)
    m.update(torch.tensor([ranks[u] for u in sorted(ranks)]))
    return m.compute()


def _value(key: str, r: torch.Tensor) -> torch.Tensor:
    kind, k = key.split("@")
    hit = (r < int(k)).double()
    return hit if kind == "hr" else hit / torch.log2(r.double() + 2.0)


def paired_difference(a: dict[int, int], b: dict[int, int],
                      keys: Iterable[str] = PAIRED_KEYS) -> dict[str, tuple[float, float]]:
    """{metric: (mean of a - b over the users both ranked, its standard error)}."""
    users = sorted(a.keys() & b.keys())
    if len(users) < 2:
        raise ValueError(f"paired_difference needs at least 2 users ranked by both, got {len(users)}")
    ra, rb = torch.tensor([a[u] for u in users]), torch.tensor([b[u] for u in users])
    out = {}
    for key in keys:
        d = _value(key, ra) - _value(key, rb)
        out[key] = (float(d.mean()), float(d.std(unbiased=True)) / math.sqrt(len(users)))
    return out


def format_paired(name: str, other: str, diff: dict[str, tuple[float, float]], users: int) -> str:
    """One line: ``name - other`` per metric, difference +- standard error, in standard errors."""
    parts = [f"{k} {d:+.4f} +- {se:.4f} ({d / se:+.1f} se)" if se > 0 else f"{k} {d:+.4f}"
             for k, (d, se) in diff.items()]
    return f"{name} - {other}, paired over {users} users: " + ", ".join(parts)
