"""Multi-task ranking head over target-aware candidates.

Candidates are appended to a user's history as target tokens (``num_targets``): the tower
lets each one see the history and itself only, so its output h_c is a history summary
*conditioned on that candidate* (HSTU's ranking setting, DLRMv3, MTGR). The head reads

    [h_c, e_c, h_c * e_c, context]  ->  MLP  ->  one logit per task

(e_c: the candidate's item row; context: the user's pooled sparse features, when the
model has them) and is trained with per-task binary cross-entropy, weighted per task.

:meth:`RankingHead.probabilities` is the one place logits become task probabilities
(evaluation, ``genrec eval`` and every serving engine call it): sigmoid, then the head's
calibrator (``models.calibration``), fitted after training and the identity until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from genrec.kernels import bf16_ops
from genrec.models.calibration import Calibrator
from genrec.models.dropout import Dropout


@dataclass(frozen=True)
class TaskConfig:
    """One action-prediction task: positive when any of ``actions`` is set on the event."""

    name: str
    actions: tuple[str, ...]
    weight: float = 1.0


@dataclass(frozen=True)
class RankingConfig:
    tasks: tuple[TaskConfig, ...] = ()
    hidden: tuple[int, ...] = (256, 128)
    dropout: float = 0.1
    # summed: one token per event, item row + action row (the default: half the tokens of
    # interleaving, so 4x less attention and 2x less everything else, and the history a
    # candidate sees is the same one retrieval encodes). interleaved: item token, then
    # action token, per event (HSTU's formulation; doubles the sequence).
    encoding: Literal["summed", "interleaved"] = "summed"
    retrieval_weight: float = 1.0
    use_context: bool = True
    # isotonic: a monotone map per task, fitted on rank_valid after training, applied to every
    # probability served (eCPM multiplies them, so they must be calibrated); none: raw sigmoids
    calibration: Literal["isotonic", "none"] = "isotonic"

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def task_masks(self, action_names: list[str]) -> dict[str, int]:
        """Task name -> bitmask over the dataset's action bits."""
        out = {}
        for t in self.tasks:
            missing = [a for a in t.actions if a not in action_names]
            if missing:
                raise ValueError(f"task '{t.name}': action '{missing[0]}' is not in the dataset's actions {action_names}")
            out[t.name] = sum(1 << action_names.index(a) for a in t.actions)
        return out


class RankingHead(nn.Module):
    """candidates' tower outputs [C, D], item rows [C, D], context [C, E] -> logits [C, tasks]."""

    def __init__(self, cfg: RankingConfig, dim: int, context_dim: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        layers: list[nn.Module] = []
        width = 3 * dim + context_dim
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.SiLU(), Dropout(cfg.dropout)]
            width = h
        layers.append(nn.Linear(width, len(cfg.tasks)))
        self.mlp = nn.Sequential(*layers)
        self.calibrator = Calibrator(len(cfg.tasks))
        self.weights = torch.tensor([t.weight for t in cfg.tasks])

    def forward(self, h: torch.Tensor, items: torch.Tensor, context: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dtype`` bf16 (inference): the MLP's GEMMs and SiLUs in bf16 (``kernels.bf16_ops``),
        logits in h's dtype."""
        items = items.to(h.dtype)  # embedding rows are fp32; the tower may run in bf16
        parts = [h, items, h * items]
        if context is not None:
            parts.append(context.to(h.dtype))
        x = torch.cat(parts, dim=-1)
        if dtype != torch.bfloat16:
            return self.mlp(x)
        layers = [m for m in self.mlp if isinstance(m, nn.Linear)]  # (dropout: identity in inference)
        for i, m in enumerate(layers):
            x = bf16_ops.linear(x, m.weight, m.bias, silu=i < len(layers) - 1)
        return x.to(h.dtype)

    def probabilities(self, logits: torch.Tensor, calibrated: bool = True) -> torch.Tensor:
        """Task probabilities [C, tasks] (fp32) of logits [C, tasks]: the sigmoid, then
        :meth:`calibrate` (skipped with ``calibrated=False``: what the calibrator is fit on)."""
        p = torch.sigmoid(logits.float())
        return self.calibrate(p) if calibrated else p

    def calibrate(self, p: torch.Tensor) -> torch.Tensor:
        """Uncalibrated probabilities p [C, tasks] -> calibrated [C, tasks] (fp32); unchanged
        with ``calibration = "none"`` or before the calibrator is fitted."""
        return self.calibrator(p) if self.cfg.calibration != "none" else p.float()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-task mean BCE (keys are task names) and their weighted sum under 'ranking'."""
        per_task = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(0)
        out = {t.name: per_task[i] for i, t in enumerate(self.cfg.tasks)}
        out["ranking"] = (per_task * self.weights.to(per_task.device)).sum()
        return out
