"""Ranking-task metrics: AUC, per-user GAUC, log loss and normalized entropy.

For one binary task with predicted probabilities p and labels y over N examples:

    AUC     P(score of a random positive > score of a random negative), ties count 1/2
    GAUC    per-user AUC averaged with weights = the user's example count, over users
            that have both a positive and a negative (as in DIN, KDD 2018)
    logloss mean of -[y log p + (1 - y) log(1 - p)]
    NE      logloss / entropy of the base rate (He et al., ADKDD 2014): < 1 beats
            predicting the average CTR for everyone

Example: p = [0.9, 0.2, 0.6], y = [1, 0, 0] -> AUC = 1.0 (the positive outranks both).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties; NaN if one class is missing."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size, np.float64)
    sorted_scores = scores[order]
    # average rank within runs of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def gauc(scores: np.ndarray, labels: np.ndarray, users: np.ndarray) -> float:
    """Example-weighted mean of per-user AUC over users with both classes."""
    scores, labels, users = np.asarray(scores), np.asarray(labels).astype(bool), np.asarray(users)
    order = np.argsort(users, kind="mergesort")
    u = users[order]
    bounds = np.flatnonzero(np.r_[True, u[1:] != u[:-1], True])
    total, weight = 0.0, 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        y = labels[order[a:b]]
        if y.all() or not y.any():
            continue
        total += auc(scores[order[a:b]], y) * (b - a)
        weight += b - a
    return total / weight if weight else float("nan")


def logloss(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, np.float64), eps, 1 - eps)
    y = np.asarray(labels, np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def normalized_entropy(probs: np.ndarray, labels: np.ndarray) -> float:
    rate = float(np.mean(labels))
    if rate in (0.0, 1.0):
        return float("nan")
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return logloss(probs, labels) / base


class TaskMetrics:
    """Collects (prob, label, user) per task across batches; ``compute()`` -> metrics by task."""

    def __init__(self, tasks: list[str]) -> None:
        self.tasks = tasks
        self.probs: list[list[np.ndarray]] = [[] for _ in tasks]
        self.labels: list[list[np.ndarray]] = [[] for _ in tasks]
        self.users: list[np.ndarray] = []

    def update(self, probs: torch.Tensor, labels: torch.Tensor, users: torch.Tensor) -> None:
        """probs, labels [N, tasks]; users [N]."""
        p, y = probs.detach().float().cpu().numpy(), labels.detach().cpu().numpy()
        for t in range(len(self.tasks)):
            self.probs[t].append(p[:, t])
            self.labels[t].append(y[:, t])
        self.users.append(users.detach().cpu().numpy())

    def arrays(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
        return [cat(p) for p in self.probs], [cat(y) for y in self.labels], cat(self.users)

    def compute(self) -> dict[str, dict[str, float]]:
        probs, labels, users = self.arrays()
        out = {}
        for t, name in enumerate(self.tasks):
            p, y = probs[t], labels[t]
            out[name] = {"auc": auc(p, y), "gauc": gauc(p, y, users), "logloss": logloss(p, y) if y.size else float("nan"),
                         "ne": normalized_entropy(p, y) if y.size else float("nan"),
                         "positive_rate": float(y.mean()) if y.size else float("nan"), "examples": int(y.size)}
        return out


@torch.no_grad()
def evaluate_ranking(
    model: torch.nn.Module,
    batches,  # noqa: ANN001 - an iterable of SequenceBatch with candidates and labels
    tasks: list[str],
    device: torch.device | None = None,
    total_batches: int | None = None,
) -> dict[str, float]:
    """Per-task AUC / GAUC / logloss / NE of ``model.rank`` on held-out candidates, flat
    keys ``<task>/<metric>``; with oracle probabilities in the data, ``<task>/oracle_auc``."""
    was_training = model.training
    model.eval()
    ours, oracle = TaskMetrics(tasks), TaskMetrics(tasks)
    has_oracle = False
    done, last = 0, None
    for batch in batches:
        if device is not None:
            batch = batch.to(device)
        probs = model.rank(batch)
        done, last = done + 1, batch
        users = torch.repeat_interleave(batch.user_ids, batch.num_targets)
        ours.update(probs, batch.labels, users)
        if batch.oracle is not None and not torch.isnan(batch.oracle).all():
            has_oracle = True
            oracle.update(torch.nan_to_num(batch.oracle, nan=0.5), batch.labels, users)
    while total_batches is not None and done < total_batches:
        model.rank(last)  # a dummy forward: joins the other ranks' lookups (see train.evaluate)
        done += 1
    model.train(was_training)
    out: dict[str, float] = {}
    for task, m in ours.compute().items():
        out.update({f"{task}/{k}": v for k, v in m.items()})
    if has_oracle:
        for task, m in oracle.compute().items():
            out[f"{task}/oracle_auc"] = m["auc"]
            out[f"{task}/oracle_gauc"] = m["gauc"]
    return out
