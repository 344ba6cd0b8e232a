"""Full-corpus ranking evaluation (the protocol of SASRec and HSTU).

For every user: score the whole catalogue with the user vector, drop the items already in
the user's (untruncated) history, and find the rank of the held-out target among the
rest, as the server's list would have it: a target that repeats a history item, or an item
outside the model's corpus (one its training never saw), can never be returned, so it ranks N
(a miss at every cut-off; ``target_ranks``). Ranks are 0-based: rank 0 is a hit at 1. Metrics are means over users (each with
its standard error, ``<metric>_se``: the spread of the per-user values over sqrt(users),
what a checkpoint choice on a few hundred validation users has to allow for):

    HR@K   = [rank < K]
    NDCG@K = [rank < K] / log2(rank + 2)      (one relevant item, so IDCG = 1)
    MRR    = 1 / (rank + 1)

A model with a semantic-ID decoder (``model.sid``) is also scored on its decoded ranking:
the beam's items, best first, with the same names prefixed ``gen_`` (``gen_ndcg@10``).

Example: ranks [0, 3, 20] -> HR@10 = 2/3, NDCG@10 = (1 + 1/log2(5) + 0) / 3, MRR = (1 + 1/4 + 1/21) / 3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from genrec.models.inputs import SequenceBatch


@dataclass(frozen=True)
class EvalConfig:
    hr_ks: tuple[int, ...] = (1, 10, 50, 200)
    ndcg_ks: tuple[int, ...] = (10, 50, 200)
    exclude_history: bool = True
    item_chunk: int = 65536  # corpus rows embedded per call
    # read the test split when training ends; false for runs that choose a recipe on validation
    # (`genrec eval --run DIR --split test` reads it later, once, for the run chosen)
    test: bool = True


class RankingMetrics:
    """Accumulates per-user values into sums and sums of squares; ``compute()`` gives the
    means and their standard errors."""

    def __init__(self, hr_ks: Iterable[int] = (1, 10, 50, 200), ndcg_ks: Iterable[int] = (10, 50, 200)) -> None:
        self.hr_ks, self.ndcg_ks = tuple(hr_ks), tuple(ndcg_ks)
        self.names = [f"hr@{k}" for k in self.hr_ks] + [f"ndcg@{k}" for k in self.ndcg_ks] + ["mrr"]
        self.sums = torch.zeros(len(self.names), dtype=torch.float64)
        self.squares = torch.zeros(len(self.names), dtype=torch.float64)
        self.count = 0

    def update(self, ranks: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        r = ranks.to(torch.float64)
        w = torch.ones_like(r) if weights is None else weights.to(torch.float64)
        gain = 1.0 / torch.log2(r + 2.0)
        cols = [(r < k).double() for k in self.hr_ks]
        cols += [gain * (r < k) for k in self.ndcg_ks]
        cols.append(1.0 / (r + 1.0))
        values = torch.stack(cols, 1)
        self.sums += (values * w[:, None]).sum(0)
        self.squares += (values.square() * w[:, None]).sum(0)
        self.count += float(w.sum())

    def state(self) -> torch.Tensor:
        """Sums, sums of squares and the count in one vector, for an all-reduce across ranks."""
        return torch.cat([self.sums, self.squares, torch.tensor([self.count], dtype=torch.float64)])

    def load_state(self, state: torch.Tensor) -> None:
        k = len(self.names)
        self.sums, self.squares, self.count = state[:k].clone(), state[k : 2 * k].clone(), float(state[-1])

    def compute(self) -> dict[str, float]:
        n = max(self.count, 1.0)
        mean = self.sums / n
        # sample variance of the per-user values (n - 1), over n: the variance of the mean
        var = ((self.squares - n * mean.square()) / max(n - 1.0, 1.0)).clamp(min=0.0)
        se = (var / n).sqrt()
        out = {name: float(m) for name, m in zip(self.names, mean)}
        out.update({f"{name}_se": float(e) for name, e in zip(self.names, se)})
        out["users"] = int(round(self.count))
        return out


def target_ranks(
    scores: torch.Tensor,
    targets: torch.Tensor,
    corpus_ids: torch.Tensor,
    seen_ids: torch.Tensor | None = None,
    seen_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """0-based rank of each target in the list a server would return.

    scores [B, N] over sorted ``corpus_ids`` [N]; targets [B] ids; seen_ids [E] with
    seen_lengths [B]. With the history given, its items are left out of the list, as
    serving's ``exclude_history`` leaves them out: a target that repeats one of them can
    never be returned, so it ranks N (a miss at every cut-off). Without it nothing is left
    out. A target outside the corpus ranks N as well: the server never returns an item its
    model does not know (few training users leave some held-out items unseen). Ties go
    against the target: every other item scored the same ranks ahead of it, so a model that
    cannot tell items apart (equal scores, e.g. the shared miss row of a managed-collision
    table) earns no hits from the ties.

    Example: corpus [10, 20, 30], scores [[0.1, 0.9, 0.5]], target 30 -> rank 1; with
    history [20] -> rank 0; with history [30] (a repeat) -> rank 3; target 40 -> rank 3.
    """
    n = corpus_ids.numel()
    tidx, known = corpus_columns(corpus_ids, targets)
    target_score = scores.gather(1, tidx[:, None])
    masked = seen_ids is not None and seen_ids.numel() > 0
    if masked:
        scores = mask_seen(scores, corpus_ids, seen_ids, seen_lengths)
    ranks = (scores >= target_score).sum(1) - 1  # the target's own entry does not count
    missed = ~known
    if masked:
        missed |= repeated_targets(targets, seen_ids, seen_lengths)
    return torch.where(missed, n, ranks)


def corpus_columns(corpus_ids: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``ids``' column in sorted ``corpus_ids`` [N] and whether it is there at all (a
    column of an id outside the corpus is a neighbour's: use it only where ``known``)."""
    col = torch.searchsorted(corpus_ids, ids).clamp(max=corpus_ids.numel() - 1)
    return col, corpus_ids[col] == ids


def repeated_targets(targets: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor) -> torch.Tensor:
    """[B] bool: the target is one of its user's history items (seen_ids [E], seen_lengths [B])."""
    row = torch.repeat_interleave(torch.arange(targets.numel(), device=targets.device), seen_lengths)
    hit = (seen_ids == targets[row]).long()
    return torch.zeros_like(targets).index_add_(0, row, hit) > 0


def mask_seen(scores: torch.Tensor, corpus_ids: torch.Tensor, seen_ids: torch.Tensor,
              seen_lengths: torch.Tensor) -> torch.Tensor:
    """``scores`` [B, N] over sorted ``corpus_ids`` with each user's seen items (seen_ids [E],
    seen_lengths [B]) at -inf (a new tensor; ids outside the corpus are ignored)."""
    row = torch.repeat_interleave(torch.arange(scores.shape[0], device=scores.device), seen_lengths)
    col, known = corpus_columns(corpus_ids, seen_ids)
    return scores.index_put((row[known], col[known]), torch.tensor(float("-inf"), dtype=scores.dtype))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[SequenceBatch],
    cfg: EvalConfig | None = None,
    device: torch.device | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    total_batches: int | None = None,
    ranks: dict[int, int] | None = None,
) -> dict[str, float]:
    """HR / NDCG / MRR of ``model`` over ``batches`` (a reader of the valid or test split).

    Distributed: ``reduce`` sums metric state across ranks; ``total_batches`` (the most any
    rank has) keeps ranks with fewer batches running dummy forwards, since lookups in
    sharded tables are collective calls every rank must join. ``ranks``: filled with each
    user's 0-based target rank (this rank's users; ``paired.model_ranks`` gives the same).
    """
    cfg = cfg or EvalConfig()
    was_training = model.training
    model.eval()
    corpus = model.corpus_ids
    items = torch.cat([model.item_embeddings(corpus[i : i + cfg.item_chunk])
                       for i in range(0, corpus.numel(), cfg.item_chunk)])
    metrics = RankingMetrics(cfg.hr_ks, cfg.ndcg_ks)
    decoder = getattr(model, "sid_head", None)
    generated = RankingMetrics(cfg.hr_ks, cfg.ndcg_ks) if decoder is not None else None
    done, last = 0, None
    for batch in batches:
        if device is not None:
            batch = batch.to(device)
        seen = (batch.seen_ids, batch.seen_lengths) if cfg.exclude_history else (None, None)
        if decoder is None:
            users = model.user_embeddings(batch)
        else:  # one tower pass for both channels
            states = model.user_states(batch)
            users = model.head.normalize(states.float())
            beams, _ = decoder.beam_search(states, model.cfg.sid.beam_width, seen if seen[0] is not None else None)
            generated.update(generated_ranks(beams, batch.targets, corpus.numel()).cpu())
        scores = model.head.scores(users, items).float()
        r = target_ranks(scores, batch.targets, corpus, *seen).cpu()
        metrics.update(r)
        if ranks is not None:
            ranks.update(zip(batch.user_ids.tolist(), r.tolist()))
        done, last = done + 1, batch
    while total_batches is not None and done < total_batches:
        model.user_embeddings(last)  # a dummy forward: joins the other ranks' lookups
        done += 1
    if reduce is not None:
        metrics.load_state(reduce(metrics.state()))
        if generated is not None:
            generated.load_state(reduce(generated.state()))
    model.train(was_training)
    out = metrics.compute()
    if generated is not None:  # the decoded ranking: "gen_" + the same names
        out.update({f"gen_{k}": v for k, v in generated.compute().items() if k != "users"})
    return out


def generated_ranks(items: torch.Tensor, targets: torch.Tensor, corpus_size: int) -> torch.Tensor:
    """0-based rank of each target in its user's decoded list items [B, K] (best first, -1
    padding); a target the beam did not reach ranks ``corpus_size`` (a miss at every cut-off:
    HR@K for K above the beam width, and MRR, are therefore lower bounds)."""
    hit = items == targets[:, None]
    first = torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(targets, corpus_size))
    return first


def format_table(rows: dict[str, dict[str, float]], keys: Iterable[str] | None = None) -> str:
    """A markdown table: one row per name, one column per metric. A row with decoded
    (``gen_``) metrics gets a second row, "<name> (generative)", with those."""
    keys = list(keys or ["hr@1", "hr@10", "hr@50", "hr@200", "ndcg@10", "ndcg@50", "ndcg@200", "mrr"])
    split = {}
    for name, m in rows.items():
        split[name] = m
        gen = {k[4:]: v for k, v in m.items() if k.startswith("gen_")}
        if gen:
            split[f"{name} (generative)"] = gen
    rows = split
    lines = ["| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, m in rows.items():
        vals = [f"{m[k]:.4f}" if isinstance(m.get(k), float) and not math.isnan(m[k]) else str(m.get(k, "")) for k in keys]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
