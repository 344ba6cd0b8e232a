"""Compares a resumed (or killed and restarted) run with an uninterrupted one, for
tests/test_checkpoint.py and tests/test_distributed.py: the same steps with the same LR and
loss, and the same final checkpoint (every tensor of model and optimizer, the trainer's
early-stopping state, reader position and RNG state of every rank).

The runs must train on a schedule whose LR changes every step (warm-up, then decay): a
constant LR cannot tell a schedule restored wrongly from a right one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from genrec.train.loop import checkpoint as ckpt

# how a trainer's own warm-up + cosine decay is written in a test's TOML config
SCHEDULE = """
[train.optim]
schedule = "cosine"
warmup_steps = 5
min_lr_ratio = 0.1
"""


def train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's training records by step; a step logged twice (run again after a
    resume) keeps its last record."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r["kind"] == "train"}


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (sharded ones gathered), read in this process."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


# the trainer state of early stopping: what an evaluation changes
SELECTION = ("history", "best_metric", "best_se", "peak_epoch", "best_step", "best_epoch", "evals_since_best")


def trainer_states(path: Path, selection: bool = True) -> list[dict[str, Any]]:
    """Each rank's trainer state in checkpoint ``path``, less the wall-clock seconds (and,
    with ``selection`` false, the early-stopping state)."""
    states = [json.loads(p.read_text()) for p in sorted(path.glob("trainer_state.rank*.json"))]
    for s in states:
        for k in ("train_seconds", *(() if selection else SELECTION)):
            s["trainer"].pop(k)
    return states


def assert_same_trajectory(straight: Path, resumed: Path, evaluated_at_stop: bool = False) -> None:
    """The run directory ``resumed`` trained exactly as ``straight``: per logged step the same
    LR (every param group's) and the same loss, and the same final checkpoint.
    ``evaluated_at_stop``: the first part stopped (``max_steps``) rather than died, and so
    validated the model it stopped with, an evaluation the uninterrupted run has not made."""
    a, b = train_records(straight), train_records(resumed)
    assert sorted(b) == sorted(a)
    lrs = [a[s]["lr"] for s in sorted(a)]
    assert lrs[0] < max(lrs) > lrs[-1], f"the LR must warm up and decay to test a resume: {lrs}"
    for s in sorted(a):
        assert (b[s]["lr"], b[s].get("lr_groups")) == (a[s]["lr"], a[s].get("lr_groups")), f"LR at step {s}"
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5, abs=1e-6), f"loss at step {s}"
    last_a = ckpt.latest_checkpoint(straight / "checkpoints")
    last_b = ckpt.latest_checkpoint(resumed / "checkpoints")
    assert last_a is not None and last_b is not None and last_b.name == last_a.name
    ta, tb = checkpoint_tensors(last_a), checkpoint_tensors(last_b)
    assert sorted(tb) == sorted(ta) and any(k.startswith("model.") for k in ta)
    for k in ta:  # model and optimizer tensors: the same up to float noise
        torch.testing.assert_close(tb[k], ta[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # step, reader position, RNG state (and early stopping): the same, to the bit
    selection = not evaluated_at_stop
    assert trainer_states(last_b, selection) == trainer_states(last_a, selection)
