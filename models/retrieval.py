"""Retrieval head: next-item prediction against the item table.

User vectors (tower outputs) and item vectors (rows of the item table, shared with the
input) are L2-normalised and compared by dot product over a temperature, as in HSTU.

Losses:
* ``full_softmax``: cross-entropy over the whole corpus. Exact; fine for catalogues of up
  to ~10^5 items on a CPU.
* ``sampled_softmax``: the positive against ``num_negatives`` sampled items, shared by
  every position of the batch (one [T, R] matmul instead of a [T, R, D] gather).
  ``uniform`` draws from the corpus; ``in_batch`` from the batch's own targets (popular
  items more often); ``mixed`` half of each. With ``logq_correction`` each negative logit
  is corrected by ``-log(R * q_j)``, q_j its sampling probability, so the loss estimates
  the full softmax instead of a popularity-skewed one.

Under bf16 autocast (``train.precision = "bf16"``) the full softmax runs its GEMMs in bf16
with fp32 accumulation and keeps its exp, normaliser and loss in fp32
(``kernels.softmax_ce``, ``gemm_dtype``); fp32 otherwise.

``exclude_history`` (full softmax): each position's softmax leaves out the items of the
history up to it (its own target excepted). Evaluation and serving never recommend an item
the user already has (full-corpus ranking with the history removed), so the loss need not
spend the model's capacity pushing those items below the target at every position. A
history of L events has L (L + 1) / 2 such (position, earlier event) pairs, ~40 bytes each
to list: 32M at 8k events, so the rows go through the loss in runs of at most
``EXCLUDE_CHUNK_PAIRS`` pairs (one run, the same single call, for histories of a few hundred).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from genrec.kernels.jagged import jagged_index, lengths_to_offsets
from genrec.kernels.softmax_ce import softmax_cross_entropy

# the most (position, earlier event) pairs of exclude_history listed at once (~40 bytes each
# while they are built): longer runs of rows go through the loss in pieces
EXCLUDE_CHUNK_PAIRS = 1 << 22


@dataclass(frozen=True)
class RetrievalConfig:
    loss: Literal["sampled_softmax", "full_softmax"] = "sampled_softmax"
    negatives: Literal["uniform", "in_batch", "mixed"] = "uniform"
    num_negatives: int = 128
    temperature: float = 0.05
    l2_norm: bool = True
    logq_correction: bool = False
    exclude_history: bool = False

    def __post_init__(self) -> None:
        if self.exclude_history and self.loss != "full_softmax":
            raise ValueError("retrieval.exclude_history needs loss = \"full_softmax\"")


def prefix_pairs(lengths: torch.Tensor, pos: torch.Tensor | None = None, first: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (event, earlier-or-same event) pair of jagged sequences of ``lengths`` [B]:
    rows and columns index the concatenated events; rows ascending. Lengths [2, 1] ->
    rows [0, 1, 1, 2], cols [0, 0, 1, 2]. With ``pos`` (positions in their sequences of the
    rows ``first ..``, a slice of the batch's): those rows' pairs only, rows counted from
    ``first``, columns from the batch's first event."""
    if pos is None:
        offsets = lengths_to_offsets(lengths)
        _, pos = jagged_index(offsets, int(offsets[-1]))
    counts = pos + 1
    n_pairs = int(counts.sum())
    local = torch.arange(pos.numel(), device=pos.device)
    rows = torch.repeat_interleave(local, counts, output_size=n_pairs)
    # pair k of row r is event (first + r - pos[r]) + (k - first pair of r), and the first
    # pair of r is cumsum(counts)[r] - counts[r]: so event = k + shift[r]
    shift = local.add_(first).sub_(pos).sub_(torch.cumsum(counts, 0).sub_(counts))
    return rows, torch.arange(n_pairs, device=pos.device).add_(shift[rows])


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs GEMMs in on ``device`` here, None where it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class RetrievalHead(nn.Module):
    def __init__(self, cfg: RetrievalConfig) -> None:
        super().__init__()
        if cfg.temperature <= 0:
            raise ValueError("retrieval.temperature must be positive")
        if cfg.loss == "sampled_softmax" and cfg.num_negatives < 1:
            raise ValueError("retrieval.num_negatives must be at least 1 for sampled_softmax")
        self.cfg = cfg

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if not self.cfg.l2_norm:
            return x
        # = F.normalize(x, dim=-1, eps=1e-6), without torch.functional.norm's Python dispatch
        # (serving normalizes one user vector per request, where that dispatch dominates)
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-6)

    def scores(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """users [B, D], items [N, D] (both already normalised) -> logits [B, N]."""
        return users @ items.t() / self.cfg.temperature

    def loss(
        self,
        users: torch.Tensor,
        targets: torch.Tensor,
        corpus_ids: torch.Tensor,
        lookup: Callable[[torch.Tensor], torch.Tensor],
        history: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Mean next-item loss. users [T, D] raw tower outputs, targets [T] item ids,
        corpus_ids [N] sorted ids of the catalogue, lookup: ids -> raw item rows.
        ``history = (item ids [T], lengths [B])``: the event each row follows, in the rows'
        order, per sequence; needed with ``exclude_history``."""
        users = self.normalize(users)
        if self.cfg.loss == "full_softmax":
            items = self.normalize(lookup(corpus_ids))
            index = torch.searchsorted(corpus_ids, targets)
            scale = 1.0 / self.cfg.temperature
            gemm = autocast_dtype(users.device)
            if self.cfg.exclude_history:
                if history is None:
                    raise ValueError("retrieval.exclude_history needs the batch's history items")
                t = users.shape[0]
                if history[0].numel() != t:
                    raise ValueError(f"history of {history[0].numel()} events for {t} rows")
                total = None
                for a, b, ex in self._seen(history, corpus_ids):  # each run's mean, weighted by its rows
                    part = softmax_cross_entropy(users[a:b], items, index[a:b], scale, exclude=ex, gemm_dtype=gemm)
                    part = part if b - a == t else part * ((b - a) / t)
                    total = part if total is None else total + part
                if total is not None:
                    return total
            # = F.cross_entropy(self.scores(users, items), index), without the [T, N] logits
            return softmax_cross_entropy(users, items, index, scale, gemm_dtype=gemm)
        neg_ids, log_q = self._sample(targets, corpus_ids)
        rows = self.normalize(lookup(torch.cat([targets, neg_ids])))
        pos_rows, neg_rows = rows[: targets.numel()], rows[targets.numel() :]
        pos = (users * pos_rows).sum(-1, keepdim=True) / self.cfg.temperature  # [T, 1]
        neg = self.scores(users, neg_rows)  # [T, R]
        if log_q is not None:
            neg = neg - log_q
        neg = neg.masked_fill(neg_ids[None, :] == targets[:, None], float("-inf"))
        logits = torch.cat([pos, neg], dim=1)
        return F.cross_entropy(logits, torch.zeros_like(targets))

    @staticmethod
    def _seen(history: tuple[torch.Tensor, torch.Tensor], corpus_ids: torch.Tensor,
              ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Runs of rows (a, b), each with the flat indices ``(row - a) * N + item row`` of its
        rows' histories so far (ids outside the catalogue left out), for
        :func:`softmax_cross_entropy`'s ``exclude``: at most ``EXCLUDE_CHUNK_PAIRS`` pairs a
        run (one run for all rows when they fit), a run listed only once the last is used."""
        ids, lengths = history
        n = corpus_ids.numel()
        if int(lengths.sum()) != ids.numel():
            raise ValueError(f"history of {ids.numel()} events, lengths sum to {int(lengths.sum())}")
        col = torch.searchsorted(corpus_ids, ids).clamp_(max=max(n - 1, 0))
        known = corpus_ids[col] == ids
        every = bool(known.all())
        t = ids.numel()
        _, pos = jagged_index(lengths_to_offsets(lengths), t)
        ends = torch.cumsum(pos + 1, 0)  # pairs of rows 0..r
        a = 0
        while a < t:
            done = int(ends[a - 1]) if a else 0
            b = max(int(torch.searchsorted(ends, done + EXCLUDE_CHUNK_PAIRS, right=True)), a + 1)
            rows, events = prefix_pairs(lengths, pos[a:b], a)
            flat = rows.mul_(n).add_(col[events])
            flat = flat if every else flat[known[events]]
            # grouped by row, ascending, which is what the kernel reads; it checks first <= last,
            # which a run of two rows or more meets (its first row's indices are all below N)
            yield a, b, flat.sort().values if b - a == 1 else flat
            a = b

    def _sample(
        self, targets: torch.Tensor, corpus_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r, kind = self.cfg.num_negatives, self.cfg.negatives
        n_batch = r if kind == "in_batch" else (r // 2 if kind == "mixed" else 0)
        n_uniform = r - n_batch
        parts, log_q = [], []
        if n_uniform:
            idx = torch.randint(corpus_ids.numel(), (n_uniform,), device=corpus_ids.device)
            parts.append(corpus_ids[idx])
            log_q.append(torch.full((n_uniform,), math.log(r / corpus_ids.numel()), device=targets.device))
        if n_batch:
            pick = targets[torch.randint(targets.numel(), (n_batch,), device=targets.device)]
            # q_j = (count of j among the targets) / T; counted by sorting, no table needed.
            uniq, counts = torch.unique(targets, return_counts=True)
            freq = counts[torch.searchsorted(uniq, pick)].to(torch.float32) / targets.numel()
            parts.append(pick)
            log_q.append(torch.log(r * freq))
        ids = torch.cat(parts)
        return ids, (torch.cat(log_q) if self.cfg.logq_correction else None)
