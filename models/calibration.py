"""Post-hoc calibration of the ranking head's probabilities: one monotone map per task.

The ads ranking orders candidates by eCPM = bid x pCTR x pCVR, which compares
probabilities across candidates with different bids: they have to be calibrated (mean
predicted = observed rate), not only well ordered. Training fits one map per task on the
validation split's (probability, label) pairs of the chosen checkpoint
(:func:`fit_isotonic`):

1. Isotonic regression by pool-adjacent-violators (:func:`pav`): the least-squares
   non-decreasing fit, a step function over blocks of consecutive predictions.
2. Blocks lighter than ``min_block`` examples (or 1/``max_knots`` of the data) are pooled
   with their neighbours: a block of two extreme examples would otherwise pull half of
   its large neighbour toward its rate in step 4, and a few hundred knots are plenty.
3. Each block's rate is shrunk toward the task's base rate by ``prior`` pseudo-examples,
   then PAV runs again on the shrunk rates: a block with no positive in validation would
   otherwise predict exactly 0, and one positive landing there later costs unbounded log
   loss.
4. Steps would tie every candidate inside a block, and eCPM would lose the model's order
   there. The calibrator is instead the piecewise-linear curve through the blocks' centres
   (mean prediction, rate), "centred isotonic regression" (Oron & Flournoy 2017): strictly
   increasing between its first and last knot, constant (clipped) outside them.

The knots live in module buffers of a fixed size (``knots_x``, ``knots_y``: [tasks,
max_knots], padded with the last knot; ``counts``: [tasks], 0 = unfitted = identity), so a
training checkpoint, the serving artifact's dense tensors and every engine carry the map
with the model, in no format of its own.

Example (``prior=0, min_block=1``): p = [0.1, 0.2, 0.3, 0.4], y = [0, 1, 0, 1] -> PAV
blocks {0.1} -> 0, {0.2, 0.3} -> 0.5, {0.4} -> 1; knots at x = 0.1, 0.25, 0.4.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

MAX_KNOTS = 256  # a buffer shape: checkpoints and artifacts of one model must agree on it


def is_calibration_key(key: str) -> bool:
    """Whether a state-dict key is a calibrator's (checkpoints and artifacts written before
    calibration existed lack these: loading leaves the calibrator unfitted)."""
    return "calibrator" in key.split(".")


def pav(y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: the weighted least-squares non-decreasing fit to y [n], in
    the order given, with weights w [n] > 0, as blocks: (values [b], weights [b], end index
    [b], exclusive). Neighbouring values strictly increase (equal neighbours are pooled)."""
    values: list[float] = []
    weights: list[float] = []
    ends: list[int] = []
    for i in range(y.size):
        v, wt = float(y[i]), float(w[i])
        while values and values[-1] >= v:  # a violation: pool with the previous block
            pv, pw = values.pop(), weights.pop()
            ends.pop()
            v, wt = (pv * pw + v * wt) / (pw + wt), pw + wt
        values.append(v)
        weights.append(wt)
        ends.append(i + 1)
    return np.array(values), np.array(weights), np.array(ends, dtype=np.int64)


def _sums(a: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Sums of ``a`` [n] over consecutive blocks ending at ``ends`` [b] (exclusive)."""
    return np.add.reduceat(a, np.r_[0, ends[:-1]])


def _min_mass(weights: np.ndarray, mass: float) -> np.ndarray:
    """Ends of consecutive groups of ``weights`` [b] holding at least ``mass`` each, left
    to right; a lighter rest joins the last group (one group if all are lighter)."""
    ends, acc = [], 0.0
    for i, w in enumerate(weights.tolist()):
        acc += w
        if acc >= mass:
            ends.append(i + 1)
            acc = 0.0
    if not ends:
        return np.array([weights.size])
    ends[-1] = weights.size
    return np.array(ends)


def fit_isotonic(p: np.ndarray, y: np.ndarray, max_knots: int = MAX_KNOTS, prior: float = 1.0,
                 min_block: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """Knots (x [k], y [k], k <= max_knots, both strictly increasing) of the calibration
    curve for predictions p [n] and binary labels y [n] (see the module docstring)."""
    if p.size == 0:
        raise ValueError("calibration needs at least one (prediction, label) pair")
    order = np.argsort(p, kind="stable")
    p, y = p[order].astype(np.float64), y[order].astype(np.float64)
    # one point per distinct prediction: the map is a function of the prediction alone
    xs, start = np.unique(p, return_index=True)
    count = np.diff(np.r_[start, p.size]).astype(np.float64)
    positives = np.add.reduceat(y, start)
    _, _, ends = pav(positives / count, count)  # 1. the isotonic blocks
    ends = ends[_min_mass(_sums(count, ends), max(min_block, p.size / max_knots)) - 1]  # 2. no light ones
    n, k = _sums(count, ends), _sums(positives, ends)
    values, _, merged = pav((k + prior * y.mean()) / (n + prior), n + prior)  # 3. shrunk, isotonic again
    ends = ends[merged - 1]
    return _sums(xs * count, ends) / _sums(count, ends), values
class Calibrator(nn.Module):
    """Per-task monotone map of probabilities: p [C, tasks] -> calibrated [C, tasks].

    Example: ``cal = Calibrator(2); cal.fit(p, y)`` with p, y [N, 2] (numpy), then
    ``cal(torch.sigmoid(logits))`` -> [C, 2]; unfitted tasks pass through unchanged."""

    def __init__(self, tasks: int, max_knots: int = MAX_KNOTS) -> None:
        super().__init__()
        if max_knots < 2:
            raise ValueError(f"max_knots must be at least 2, got {max_knots}")
        self.register_buffer("knots_x", torch.zeros(tasks, max_knots))
        self.register_buffer("knots_y", torch.zeros(tasks, max_knots))
        self.register_buffer("counts", torch.zeros(tasks, dtype=torch.long))

    @property
    def fitted(self) -> torch.Tensor:
        """[tasks] bool: which tasks have a map (the others are the identity)."""
        return self.counts > 0

    def reset(self) -> None:
        """Every task back to the identity (a model that trains on is no longer calibrated)."""
        self.counts.zero_()

    @torch.no_grad()
    def fit(self, probs: np.ndarray, labels: np.ndarray, prior: float = 1.0, min_block: float = 10.0) -> None:
        """Fits every task on uncalibrated probabilities probs [N, tasks] and labels [N, tasks]
        (``prior``, ``min_block``: :func:`fit_isotonic`'s)."""
        probs, labels = np.asarray(probs), np.asarray(labels)
        tasks, max_knots = self.knots_x.shape
        if probs.shape != labels.shape or probs.ndim != 2 or probs.shape[1] != tasks:
            raise ValueError(f"probs {probs.shape} and labels {labels.shape} must both be [N, {tasks}]")
        for t in range(tasks):
            kx, ky = fit_isotonic(probs[:, t], labels[:, t], max_knots, prior, min_block)
            pad = max_knots - kx.size  # the last knot repeated: searchsorted needs sorted rows
            self.knots_x[t] = torch.from_numpy(np.r_[kx, np.full(pad, kx[-1])])
            self.knots_y[t] = torch.from_numpy(np.r_[ky, np.full(pad, ky[-1])])
            self.counts[t] = kx.size

    def validate(self) -> None:
        """Raises ValueError unless the buffers describe valid maps (for a loaded artifact)."""
        k = self.knots_x.shape[1]
        if bool(((self.counts < 0) | (self.counts > k)).any()):
            raise ValueError(f"calibrator counts must lie in [0, {k}], got {self.counts.tolist()}")
        for name in ("knots_x", "knots_y"):
            knots = getattr(self, name).float()
            if not bool(torch.isfinite(knots).all()) or bool((knots.diff(dim=1) < 0).any()):
                raise ValueError(f"calibrator {name} must be finite and non-decreasing along each task")

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        """Calibrated probabilities [C, tasks] (fp32) of probabilities p [C, tasks]."""
        p = p.float()
        x, y = self.knots_x.float(), self.knots_y.float()  # fp32 even in a bf16-cast head
        n = self.counts[:, None]  # [T, 1]
        q = p.t().clamp(x[:, :1], x.gather(1, (n - 1).clamp(min=0))).contiguous()  # [T, C], clipped to the knots
        # the segment [x_i, x_i+1] holding q: how many segment ends lie at or below it, capped at the
        # last real segment (the padding repeats the last knot, so q at that knot counts them all)
        i = torch.searchsorted(x[:, 1:].contiguous(), q, right=True).minimum((n - 2).clamp(min=0))
        dx, dy = x.diff(dim=1), y.diff(dim=1)
        slope = torch.where(dx > 0, dy / dx.clamp(min=torch.finfo(dx.dtype).tiny), 0.0)  # [T, K - 1]; 0 on padding
        out = y.gather(1, i) + (q - x.gather(1, i)) * slope.gather(1, i)
        return torch.where(self.fitted, out.t(), p)
