"""An exponential moving average of the weights (``train.ema_decay``), as checkpoints hold it.

After every optimizer step each trained tensor's average moves toward it:
``avg = d * avg + (1 - d) * w``, with ``d = min(decay, (1 + t) / (10 + t))`` at step ``t``
so the first steps do not drag the start's random weights along. Validation, the test and
every consumer of a checkpoint read the average: a checkpoint's ``model`` entries are the
averaged tensors (so ``genrec eval``, ``genrec quantize`` and serving load them unchanged),
and the weights the optimizer trains travel beside them under ``train_weights`` (read only
when training resumes, which then continues the same trajectory).

Wraps a checkpoint I/O object (``train.loop.checkpoint.PlainState`` or
``train.loop.parallel.Replicated``: unsharded tensors, the same on every rank). TorchRec's
sharded tables (DMP) are not averaged: ``train.loop.launch`` refuses that combination.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

RAW = "train_weights"


class AveragedWeights:
    """Checkpoint I/O (``state`` / ``load`` / ``init_optimizer_state``, for
    ``train.loop.checkpoint.restore``) over ``io``, plus :meth:`update` after each step and :meth:`applied` for evaluation."""

    def __init__(self, io: Any, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.io, self.decay, self.steps = io, decay, 0
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad and p.is_floating_point()}
        self.avg = {n: p.detach().clone() for n, p in self.params.items()}

    # ---- training ------------------------------------------------------------------------
    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.steps) / (10 + self.steps))
        avg, cur = list(self.avg.values()), [p.detach() for p in self.params.values()]
        torch._foreach_lerp_(avg, cur, 1.0 - d)
        self.steps += 1

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The module holds the averaged weights inside the block, its trained ones after."""
        with torch.no_grad():
            kept = {n: p.detach().clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                p.copy_(self.avg[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(kept[n])

    # ---- checkpoint I/O --------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``io``'s state with the averages as ``model`` entries and the trained weights under
        ``train_weights`` (also the template ``dcp.load`` fills in place)."""
        state = self.io.state()
        model = state["model"]
        missing = [n for n in self.avg if n not in model]
        if missing:  # averaged for validation but not written: the checkpoint would not be what was validated
            raise ValueError(f"trained tensors missing from the checkpoint's model state: {missing[:3]}")
        raw = {n: model[n] for n in self.avg}
        state["model"] = {**model, **{n: self.avg[n] for n in raw}}
        state[RAW] = raw
        state["ema_steps"] = torch.tensor(self.steps)
        return state

    def load(self, state: dict[str, Any]) -> None:
        """After ``dcp.load`` filled the template :meth:`state` returned: the averages already
        hold the checkpoint's model entries (they were the template's tensors); the module
        gets the trained weights (or, when only the model was loaded, the averages: the
        evaluation of a best checkpoint)."""
        raw = state.get(RAW, {})
        self.io.load({**state, "model": {**state["model"], **{n: raw.get(n, a) for n, a in self.avg.items()}}})
        if "ema_steps" in state:
            self.steps = int(state["ema_steps"])

    def init_optimizer_state(self) -> None:
        self.io.init_optimizer_state()
