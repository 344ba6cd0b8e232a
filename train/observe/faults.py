"""Test faults: the one hook through which a test breaks a training run on purpose.

Faults are armed by one environment variable, ``GENREC_FAULTS``, because the runs under
test are often ``torchrun`` children that a test cannot monkeypatch; this module is the
only place that reads it. Its value is a comma-separated list of ``KIND=ARGS``::

    GENREC_FAULTS="kill=1:7"                 rank 1 SIGKILLs itself after step 7
    GENREC_FAULTS="stall=1:6:12"             rank 1 sleeps 12 s in its first collective of step 6
    GENREC_FAULTS="nan=tower.layers.1:5"     that submodule outputs NaN at step 5
    GENREC_FAULTS="kill=0:6,nan=tower.layers.0:3"   several at once

Steps are numbered as ``metrics.jsonl`` numbers them (from 1). A ``kill`` fires on the first
attempt only (torchrun's restart count 0), so a restarted group can recover. In one process
a test arms faults with ``monkeypatch.setenv(faults.ENV, "nan=tower.layers.1:5")``; for
torchrun it passes ``{faults.ENV: "kill=1:7"}`` in the child's environment.

The training code asks three questions here and nothing else: :func:`kill_after_step`,
:func:`stall_seconds` and :func:`install_nan`. Unset, each is a no-op.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ENV = "GENREC_FAULTS"


@dataclass(frozen=True)
class Faults:
    """The armed faults; ``None`` where a kind is not armed."""

    kill: tuple[int, int] | None = None  # (rank, step)
    stall: tuple[int, int, float] | None = None  # (rank, step, seconds)
    nan: tuple[str, int] | None = None  # (dotted submodule path, step)


@functools.lru_cache(maxsize=8)
def parse(spec: str) -> Faults:
    """``"kill=1:7,stall=1:6:12"`` -> :class:`Faults`; a malformed value is an error that
    names the variable, so a test that mistypes it fails instead of passing unfaulted."""
    armed: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, args = part.partition("=")
        try:
            if kind == "kill":
                rank, step = args.split(":")
                armed["kill"] = (int(rank), int(step))
            elif kind == "stall":
                rank, step, seconds = args.split(":")
                armed["stall"] = (int(rank), int(step), float(seconds))
            elif kind == "nan":
                name, step = args.rsplit(":", 1)
                armed["nan"] = (name, int(step))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except ValueError as e:
            raise ValueError(f"{ENV}={spec!r}: cannot read {part!r} ({e}); expected kill=RANK:STEP, "
                             "stall=RANK:STEP:SECONDS or nan=MODULE:STEP, comma-separated") from e
    return Faults(**armed)


def armed() -> Faults:
    """The faults armed now (read on each call, so a test's ``monkeypatch.setenv`` applies)."""
    return parse(os.environ.get(ENV, ""))


def kill_after_step(rank: int, step: int) -> None:
    """SIGKILLs this process when ``kill=RANK:STEP`` names this rank and step, on the first
    attempt only, to exercise torchrun's restart and the resume from the last checkpoint."""
    kill = armed().kill
    if kill == (rank, step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def stall_seconds(rank: int, step: int) -> float:
    """How long this rank should sleep inside a collective of ``step`` (``stall=``); 0: none.
    The caller (the watchdog's collective marker) stalls once per step."""
    stall = armed().stall
    return stall[2] if stall is not None and stall[:2] == (rank, step) else 0.0


def install_nan(model: torch.nn.Module, current_step: Callable[[], int]) -> None:
    """With ``nan=MODULE:STEP`` armed, makes submodule MODULE of ``model`` output NaN while
    ``current_step()`` is STEP (a forward hook; its first output when it returns a tuple)."""
    nan = armed().nan
    if nan is None:
        return
    name, step = nan

    def hook(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
        if current_step() != step:
            return None
        if isinstance(out, torch.Tensor):
            return out * float("nan")
        return (out[0] * float("nan"), *out[1:])

    model.get_submodule(name).register_forward_hook(hook)
