"""Calibration after training: fit the ranking head's calibrator, keep it, show it.

Order (``Trainer.finish``): the chosen checkpoint is loaded -> :func:`fit_calibration`
scores the ``rank_valid`` split with it (uncalibrated sigmoids, every rank's share gathered
so that all ranks fit the same map) and fits ``model.ranking.calibrator`` (isotonic, see
``models.calibration``) -> the fitted buffers are written into that checkpoint
(``train.loop.checkpoint.amend_checkpoint``), so ``genrec eval``, ``genrec quantize`` and every
serving engine apply it -> the test split is scored once, calibrated (``evaluate_ranking``
reports the raw sigmoids' NE and ECE beside it).

Each split evaluated at the end gets a reliability diagram in the run directory
(``reliability_valid.png``, ``reliability_test.png``): per task, the observed rate against
the mean prediction of each decile, before and after calibration, and the diagonal.
The validation one shows the fit on its own data; the test one is the honest figure.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genrec.train.eval.ranking_metrics import (
    RankingPredictions,
    ece,
    predict_ranking,
    reliability,
    task_metrics,
)

Reduce = Callable[[torch.Tensor], torch.Tensor]


def gather_rows(x: np.ndarray, reduce: Reduce | None, rank: int, world: int,
                device: torch.device | None = None) -> np.ndarray:
    """Every rank's rows x [n_r, k] stacked in rank order, on every rank: two sum
    all-reduces (``reduce``) of zero-padded buffers, on ``device`` (NCCL reduces device
    tensors only). Alone (``world`` 1), x itself."""
    if reduce is None or world == 1:
        return x
    counts = torch.zeros(world, dtype=torch.long, device=device)
    counts[rank] = x.shape[0]
    counts = reduce(counts).cpu()
    start = int(counts[:rank].sum())
    buf = torch.zeros(int(counts.sum()), x.shape[1], dtype=torch.float64, device=device)
    buf[start : start + x.shape[0]] = torch.from_numpy(x.astype(np.float64)).to(buf.device)
    return reduce(buf).cpu().numpy()


@torch.no_grad()
def fit_calibration(
    module: torch.nn.Module,
    reader,  # noqa: ANN001 - the rank_valid SequenceReader
    tasks: list[str],
    device: torch.device | None = None,
    total_batches: int | None = None,
    reduce: Reduce | None = None,
    rank: int = 0,
    world: int = 1,
    plot: Path | None = None,
) -> dict[str, Any]:
    """Fits ``module.ranking.calibrator`` on ``reader``'s candidates (see the module
    docstring); returns what the run's results keep of it: per task the knots used and the
    fitting data's ECE / NE before and after (in-sample: the test's figures are the honest
    ones). ``plot``: the fitting data's reliability diagram, written there."""
    head = module.ranking
    pred = predict_ranking(module, reader, device, total_batches)
    # one array for the gather: raw [N, T] | labels [N, T] | user [N]
    width = pred.raw.shape[1]
    rows = gather_rows(np.concatenate([pred.raw, pred.labels, pred.users[:, None]], axis=1), reduce, rank, world,
                       device)
    raw, labels = rows[:, :width], rows[:, width : 2 * width]
    if raw.shape[0] == 0:
        raise ValueError("rank_valid has no candidates to fit the calibrator on (model.ranking.calibration = "
                         "'none' skips calibration)")
    head.calibrator.fit(raw, labels)
    calibrated = head.calibrate(torch.from_numpy(raw).float().to(head.calibrator.counts.device)).cpu().numpy()
    fitted = RankingPredictions(raw, calibrated, labels, rows[:, -1].astype(np.int64))
    if plot is not None:
        plot_reliability(fitted, tasks, plot)
    m = task_metrics(fitted, tasks)
    keys = ("ece", "ece_uncalibrated", "ne", "ne_uncalibrated")
    counts = head.calibrator.counts.tolist()
    return {"method": head.cfg.calibration, "split": "rank_valid", "examples": int(raw.shape[0]),
            "tasks": {t: {"knots": counts[i], **{k: m[f"{t}/{k}"] for k in keys}} for i, t in enumerate(tasks)}}


def plot_reliability(pred: RankingPredictions, tasks: list[str], out: Path, bins: int = 10) -> Path | None:
    """One panel per task: observed rate against mean prediction per equal-mass bin, for the
    raw and the calibrated probabilities, with the diagonal; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 4.0), squeeze=False)
    for t, (name, ax) in enumerate(zip(tasks, axes[0])):
        y = pred.labels[:, t]
        top = 0.0
        for probs, label, style in ((pred.raw[:, t], "uncalibrated", "s--"), (pred.probs[:, t], "calibrated", "o-")):
            if probs.size == 0:
                continue
            mean_p, rate, _ = reliability(probs, y, bins)
            ax.plot(mean_p, rate, style, ms=4, label=f"{label} (ECE {ece(probs, y, bins):.4f})")
            top = max(top, float(mean_p.max()), float(rate.max()))
        top = min(1.0, 1.05 * top) or 1.0  # ranking probabilities sit near 0: zoom to the data
        ax.plot([0, top], [0, top], color="grey", lw=1, label="perfectly calibrated")
        ax.set(xlim=(0, top), ylim=(0, top), xlabel="mean predicted probability (decile)",
               ylabel="observed rate", title=f"{name} ({y.size} candidates)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
