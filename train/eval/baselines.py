"""Non-neural baselines under the same protocol as the models.

* ``popular``: the most interacted items of the training split, unseen only.
* ``transition``: first-order item-to-item counts from the training split; a user's
  candidates are the successors of their last item, by count, then the rest by popularity.

The training split is the models': events[:-2] of users held out for validation, events[:-1]
of the others (``valid_users``, as ``data.valid_users``).

Both score the whole corpus, so the same ``target_ranks`` (history removed) ranks them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch

from genrec.train.data.files import InteractionFiles
from genrec.train.data.reader import SequenceReader, train_events
from genrec.train.data.schema import arrow_errors
from genrec.train.eval.evaluate import EvalConfig, RankingMetrics, target_ranks


class Baseline:
    """Counts from the training part of every sequence; scores [B, N] over ``corpus``."""

    def __init__(self, data_path: str | Path, kind: Literal["popular", "transition"],
                 valid_users: float = 1.0) -> None:
        self.kind = kind
        with arrow_errors(Path(data_path) / "items.parquet"):
            items = pq.read_table(Path(data_path) / "items.parquet").column("item_id").to_numpy()
        self.corpus = torch.from_numpy(np.sort(items))
        pop = np.zeros(items.size, np.float64)
        pairs = []
        corpus_np = self.corpus.numpy()
        for _, grp in InteractionFiles(data_path).tables(["user_id", "item_ids"]):  # either layout
            col, users = grp.column("item_ids").combine_chunks(), grp.column("user_id").to_pylist()
            off, vals = col.offsets.to_numpy(), col.values.to_numpy()
            for b in range(len(off) - 1):
                end = off[b] + train_events(users[b], off[b + 1] - off[b], valid_users)
                seq = np.searchsorted(corpus_np, vals[off[b] : end])
                np.add.at(pop, seq, 1.0)
                if kind == "transition" and seq.size > 1:
                    pairs.append(seq[:-1] * items.size + seq[1:])
        self.pop = torch.from_numpy(pop / (pop.max() + 1.0))  # < 1: a fill below any count
        if kind == "transition":
            keys, counts = np.unique(np.concatenate(pairs) if pairs else np.zeros(0, np.int64), return_counts=True)
            src, dst = keys // items.size, keys % items.size
            starts = np.searchsorted(src, np.arange(items.size + 1))
            self.succ = (torch.from_numpy(starts), torch.from_numpy(dst), torch.from_numpy(counts.astype(np.float64)))

    def scores(self, last_items: torch.Tensor) -> torch.Tensor:
        b = last_items.numel()
        scores = self.pop.expand(b, -1).clone()
        if self.kind == "transition":
            starts, dst, counts = self.succ
            src = torch.searchsorted(self.corpus, last_items)
            for row, s in enumerate(src.tolist()):
                lo, hi = int(starts[s]), int(starts[s + 1])
                scores[row, dst[lo:hi]] += counts[lo:hi]
        return scores


def evaluate_baseline(baseline: Baseline, reader: SequenceReader, cfg: EvalConfig | None = None) -> dict[str, float]:
    cfg = cfg or EvalConfig()
    metrics = RankingMetrics(cfg.hr_ks, cfg.ndcg_ks)
    for batch in reader:
        offsets = batch.seq.offsets()[: batch.batch_size + 1]
        last = batch.seq.values()[offsets[1:] - 1]
        scores = baseline.scores(last)
        seen = (batch.seen_ids, batch.seen_lengths) if cfg.exclude_history else (None, None)
        metrics.update(target_ranks(scores, batch.targets, baseline.corpus, *seen))
    return metrics.compute()
