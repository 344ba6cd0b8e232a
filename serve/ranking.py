"""Ranking: what each work ranks, its candidates scored against the encoded histories, and the
final order.

    works + retrieval --Ranking.plan--> {work: (table rows, ids to return, bids)}
    --score (the packed path's, or :func:`score_jagged`)--> {work: task probabilities [c, tasks]}
    --Ranking.results--> one Result per work, ordered by its objective:
        "retrieval" the retrieval score; a task name its probability; "" / "ecpm":
        bid x the product of the objective tasks

A work its retrieval alone orders (Retrieve; a Recommend on a model without tasks or with the
objective "retrieval") keeps its retrieval order; a Recommend keeps its ``top_k`` first items
either way (the proto's contract), a Rank all its candidates in their ranked order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from genrec.models.recommender import GenerativeRecommender, HistoryState
from genrec.serve.contract import Result
from genrec.serve.requests import Work
from genrec.serve.retrieval import Pair, Retrieved, channels

Plan = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]  # work -> (table rows, ids to return, bids)


class Ranking:
    """The ranking decisions of a model with ``tasks`` (its task names, () for a retrieval-only
    model); eCPM multiplies ``objective_tasks`` (default: all, e.g. pCTR x pCVR)."""

    def __init__(self, tasks: tuple[str, ...], objective_tasks: tuple[str, ...] | None = None) -> None:
        self.tasks = tasks
        self.objective_tasks = objective_tasks or tasks

    def ranks(self, w: Work, retrieved: bool) -> bool:
        """Whether ``w`` is ranked (else its retrieval alone orders it)."""
        return w.kind != "retrieve" and not (retrieved and (not self.tasks or w.objective == "retrieval"))

    def plan(self, works: list[Work], retrieved: Mapping[int, Pair | Retrieved]) -> Plan:
        """What each work ranks: (table rows, ids to return, bids) -- its given candidates or
        what it retrieved; works that only retrieve rank nothing."""
        to_rank = {}
        for i, w in enumerate(works):
            if not self.ranks(w, i in retrieved):
                continue
            if w.candidates is not None:
                to_rank[i] = given(w.candidates, w)
            else:
                ids = retrieved[i][0]
                to_rank[i] = (ids, ids, np.ones(ids.size))
        return to_rank

    def order(self, objective: str, tasks: dict[str, np.ndarray], bids: np.ndarray,
              retrieval: np.ndarray | None) -> np.ndarray:
        """The value [c] the candidates are ordered by (higher first)."""
        if objective == "retrieval" and retrieval is not None:
            return retrieval.astype(np.float64)
        if objective in tasks:
            return tasks[objective].astype(np.float64)
        # default and "ecpm": bid x product of the objective tasks (bid = 1 when none given)
        value = bids.astype(np.float64).copy()
        for t in self.objective_tasks:
            value *= tasks[t]
        return value

    def results(self, works: list[Work], retrieved: Mapping[int, Pair | Retrieved], to_rank: Plan,
                probs: Mapping[int, np.ndarray]) -> list[Result]:
        """One Result per work: ranked ones ordered by their objective (``probs`` [c, tasks] of
        their candidates), the others in their retrieval order."""
        out = []
        for i, w in enumerate(works):
            got = channels(retrieved[i]) if i in retrieved else None
            if i not in to_rank:  # (a work not ranked is one that retrieved)
                out.append(retrieved_result(channels(retrieved[i]), w))
                continue
            _, ids, bids = to_rank[i]
            tasks = {t: probs[i][:, j] for j, t in enumerate(self.tasks)}
            out.append(ranked_result(w, ids, self.order(w.objective, tasks, bids, got.scores if got else None),
                                     tasks, got))
        return out


def given(candidates: np.ndarray, w: Work) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A work's given candidates to rank: (table rows, ids to return, bids; 1 where none came)."""
    ids = w.candidate_ids if w.candidate_ids is not None else candidates
    return candidates, ids, w.bids if w.bids is not None else np.ones(candidates.size)


def ranked_result(w: Work, ids: np.ndarray, value: np.ndarray, tasks: dict[str, np.ndarray],
                  got: Retrieved | None) -> Result:
    """A ranked work's result: its items ordered by ``value`` [c] (a Recommend's best ``top_k``,
    a Rank's all), with their task probabilities and retrieval scores (``got``)."""
    keep = np.argsort(-value, kind="stable")[: w.top_k] if w.kind == "recommend" else np.arange(value.size)
    return Result(ids[keep], value[keep], got.dense[keep] if got else None, {t: v[keep] for t, v in tasks.items()},
                  generative_scores=got.generative[keep] if got and got.generative is not None else None)


def retrieved_result(got: Retrieved, w: Work) -> Result:
    """The result of a work its retrieval alone orders (Retrieve; Recommend without ranking):
    a Recommend keeps the first ``top_k`` it retrieved, as a ranked one keeps its best ``top_k``."""
    keep = slice(w.top_k) if w.kind == "recommend" else slice(None)
    gen = got.generative[keep] if got.generative is not None else None
    return Result(got.ids[keep], got.scores[keep].astype(np.float64), got.dense[keep], generative_scores=gen)


def score_jagged(model: GenerativeRecommender, state: HistoryState, to_rank: Mapping[int, tuple[np.ndarray, ...]],
                 micro_batch: int, device: torch.device) -> dict[int, np.ndarray]:
    """Task probabilities {work: [c, tasks]} of every work's candidates (``to_rank[i][0]``, table
    rows) through ``model.score_candidates`` against the batch's encoded histories, in
    micro-batches of at most ``micro_batch`` candidates that mix users (the model's batch path)."""
    tasks = len(model.cfg.ranking.tasks)
    out = {i: np.zeros((0, tasks), np.float32) for i in to_rank}
    keys = [i for i in to_rank if to_rank[i][0].size]  # not those whose exclusions left nothing retrieved
    if not keys:
        return out
    items = torch.from_numpy(np.concatenate([to_rank[i][0] for i in keys])).to(device)
    owner = torch.from_numpy(np.concatenate([np.full(to_rank[i][0].size, i) for i in keys])).to(device)
    probs = torch.cat([model.score_candidates(state, items[s : s + micro_batch], owner[s : s + micro_batch])
                       for s in range(0, items.numel(), micro_batch)]).float().cpu().numpy()
    splits = np.cumsum([to_rank[i][0].size for i in keys])[:-1]
    return out | dict(zip(keys, np.split(probs, splits)))
