"""Ranking-task metrics: AUC, per-user GAUC, log loss, normalized entropy and calibration.

For one binary task with predicted probabilities p and labels y over N examples:

    AUC     P(score of a random positive > score of a random negative), ties count 1/2
    GAUC    per-user AUC averaged with weights = the user's example count, over users
            that have both a positive and a negative (as in DIN, KDD 2018)
    logloss mean of -[y log p + (1 - y) log(1 - p)]
    NE      logloss / entropy of the base rate (He et al., ADKDD 2014): < 1 beats
            predicting the average CTR for everyone
    ECE     expected calibration error over 10 equal-mass bins: sort the examples by p,
            cut them into 10 bins of N/10 (deciles of the prediction; examples with equal
            p stay in one bin, the one their first falls in, so a bin may hold more or
            less than N/10), and take sum over bins of (bin size / N) * |mean p - mean y|.
            Equal mass, not equal width: ranking probabilities crowd near 0, where
            equal-width bins would put almost every example in the first one.
    ECE floor  the ECE a perfectly calibrated model with these predictions would still
            show on N examples (labels drawn from p, mean over draws): each bin's observed
            rate is a sample mean, so a finite split's ECE is never 0; an ECE near its
            floor is as calibrated as the split can tell.

:func:`evaluate_ranking` reports them for the served, calibrated probabilities
(``models.calibration``) under ``<task>/<metric>``, and NE and ECE of the raw sigmoids under
``<task>/ne_uncalibrated`` and ``<task>/ece_uncalibrated``: what calibration bought.

Example: p = [0.9, 0.2, 0.6], y = [1, 0, 0] -> AUC = 1.0 (the positive outranks both).
ECE of p = [0.1] * 10, y = [1, 0 x 9] is 0; of p = [0.5] * 10, same y, it is 0.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

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


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> tuple[np.ndarray, ...]:
    """Equal-mass bins of the prediction (see the module docstring): mean prediction [k],
    observed rate [k] and size [k] of each non-empty bin (k <= bins)."""
    p, y = np.asarray(probs, np.float64), np.asarray(labels, np.float64)
    order = np.argsort(p, kind="stable")
    ps = p[order]
    # an example's bin is that of the first example with its prediction: ties stay together
    # (a calibrated model ties all candidates below its first knot), whatever their labels' order
    which = np.searchsorted(ps, ps, side="left") * bins // max(p.size, 1)
    size = np.bincount(which, minlength=bins).astype(np.float64)
    sum_p, sum_y = np.bincount(which, ps, bins), np.bincount(which, y[order], bins)
    keep = size > 0
    return sum_p[keep] / size[keep], sum_y[keep] / size[keep], size[keep]


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error over ``bins`` equal-mass bins; NaN without examples."""
    if np.asarray(probs).size == 0:
        return float("nan")
    mean_p, rate, size = reliability(probs, labels, bins)
    return float((size * np.abs(mean_p - rate)).sum() / size.sum())


def ece_floor(probs: np.ndarray, bins: int = 10, draws: int = 20, seed: int = 0) -> float:
    """Mean ECE of labels drawn from ``probs`` themselves: the sampling-noise floor of
    :func:`ece` at this many examples; NaN without examples."""
    p = np.asarray(probs, np.float64)
    if p.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([ece(p, rng.random(p.size) < p, bins) for _ in range(draws)]))


@dataclass
class RankingPredictions:
    """A split's candidates as the model scored them (N candidates, T tasks)."""

    raw: np.ndarray  # [N, T] sigmoid of the logits, uncalibrated
    probs: np.ndarray  # [N, T] what serving returns: raw through the model's calibrator
    labels: np.ndarray  # [N, T] 0 / 1
    users: np.ndarray  # [N] each candidate's user (GAUC)
    oracle: np.ndarray | None = None  # [N, T] the data's true probabilities, when it has them


def task_metrics(pred: RankingPredictions, tasks: list[str]) -> dict[str, float]:
    """Flat ``<task>/<metric>`` of :class:`RankingPredictions`: auc, gauc, logloss, ne, ece
    (calibrated), ece_floor, ne_uncalibrated, ece_uncalibrated, positive_rate, examples, and with
    oracle probabilities oracle_auc, oracle_gauc."""
    out: dict[str, float] = {}
    nan = float("nan")
    for t, name in enumerate(tasks):
        p, r, y = pred.probs[:, t], pred.raw[:, t], pred.labels[:, t]
        some = y.size > 0
        m = {"auc": auc(p, y), "gauc": gauc(p, y, pred.users), "logloss": logloss(p, y) if some else nan,
             "ne": normalized_entropy(p, y) if some else nan, "ece": ece(p, y), "ece_floor": ece_floor(p),
             "ne_uncalibrated": normalized_entropy(r, y) if some else nan, "ece_uncalibrated": ece(r, y),
             "positive_rate": float(y.mean()) if some else nan, "examples": int(y.size)}
        if pred.oracle is not None:
            m["oracle_auc"] = auc(pred.oracle[:, t], y)
            m["oracle_gauc"] = gauc(pred.oracle[:, t], y, pred.users)
        out.update({f"{name}/{k}": v for k, v in m.items()})
    return out


@torch.no_grad()
def predict_ranking(
    model: torch.nn.Module,
    batches,  # noqa: ANN001 - an iterable of SequenceBatch with candidates and labels
    device: torch.device | None = None,
    total_batches: int | None = None,
) -> RankingPredictions:
    """``model.rank`` on every candidate of ``batches``, raw and through the model's calibrator.

    Distributed: ``total_batches`` (the most any rank has) keeps ranks with fewer batches
    running dummy forwards, since lookups in sharded tables are collective calls."""
    was_training = model.training
    model.eval()
    head = model.ranking
    raw, probs, labels, users, oracle = [], [], [], [], []
    has_oracle = False
    done, last = 0, None
    for batch in batches:
        if device is not None:
            batch = batch.to(device)
        p = model.rank(batch, calibrated=False)
        done, last = done + 1, batch
        raw.append(p.cpu().numpy())
        probs.append(head.calibrate(p).cpu().numpy())
        labels.append(batch.labels.float().cpu().numpy())
        users.append(torch.repeat_interleave(batch.user_ids, batch.num_targets).cpu().numpy())
        if batch.oracle is not None and not torch.isnan(batch.oracle).all():
            has_oracle = True
        if batch.oracle is not None:
            oracle.append(torch.nan_to_num(batch.oracle, nan=0.5).float().cpu().numpy())
    while total_batches is not None and done < total_batches:
        model.rank(last)  # a dummy forward: joins the other ranks' lookups (see train.evaluate)
        done += 1
    model.train(was_training)
    tasks = len(head.cfg.tasks)

    def cat(xs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return np.concatenate(xs) if xs else np.zeros(shape, np.float32)

    return RankingPredictions(cat(raw, (0, tasks)), cat(probs, (0, tasks)), cat(labels, (0, tasks)),
                              cat(users, (0,)).astype(np.int64),
                              cat(oracle, (0, tasks)) if has_oracle and len(oracle) == len(raw) else None)


def evaluate_ranking(
    model: torch.nn.Module,
    batches,  # noqa: ANN001 - an iterable of SequenceBatch with candidates and labels
    tasks: list[str],
    device: torch.device | None = None,
    total_batches: int | None = None,
    plot: Path | None = None,
) -> dict[str, float]:
    """:func:`task_metrics` of ``model`` on held-out candidates (a ``rank_*`` reader); with
    ``plot``, their reliability diagram, before and after calibration, as that PNG."""
    pred = predict_ranking(model, batches, device, total_batches)
    if plot is not None:
        from genrec.train.eval.calibrate import plot_reliability  # matplotlib, only when plotting

        plot_reliability(pred, tasks, plot)
    return task_metrics(pred, tasks)
