"""Failure diagnosis with names: non-finite losses and gradients, loss spikes, resumes.

Every diagnosis is one JSON line in ``RUN/diagnosis.jsonl`` (``kind``, ``rank``, ``time``,
``message`` and its fields) and, printed, one line that starts ``diagnosis:``.

* **non-finite** (``kind: "nonfinite"``): each step checks its loss and its gradients' global
  norm (the one clipping computes, or computed alone without clipping) before the optimizer
  steps; the normal path costs that one check. When either is not finite, the step's
  weights (a DCP checkpoint of model and optimizer, ``RUN/diagnosis/step_<N>``) and batch
  (``RUN/diagnosis/nonfinite_step<N>_rank<r>.safetensors`` + ``.json``, no pickle) are saved,
  and the batch runs again from the step's RNG state with a forward hook on every submodule
  (the first, in order of completion, whose output holds a NaN/inf is named, with whether
  its inputs were finite) and a gradient hook on every parameter (the first whose gradient
  arrives non-finite in the backward is named), under DDP's ``no_sync`` so the re-run stays
  on this rank. The job then stops with ``NonFiniteError``; no weights are updated by the
  bad step. Distributed, every rank takes that decision from the gradient norm, which is
  the same on every rank after DDP's all-reduce (a rank's NaN loss reaches every rank's
  gradients), so every rank re-runs its batch alike. With fused (in-backward) sparse
  optimizers (DMP) the tables' rows were already updated inside the bad step's backward:
  the saved weights are those after it, for the tables only.
* **replay**: ``genrec train --resume RUN --train.replay=RUN/diagnosis/nonfinite_step<N>_rank<r>.json``
  (or ``--config`` with the run's config) loads the saved weights, the batch and the RNG
  state and runs that step again: it stops with the same diagnosis, or says the step came
  out finite. In one process the named rank's batch is replayed; under torchrun with the
  run's world size, each rank its own.
* **loss spike** (``kind: "loss_spike"``): a step's loss above ``train.loss_spike_factor``
  times the median of the rank's last 100 losses (after 20 steps) is flagged; training goes on.
* **resume** (``kind: "resumed"``): what a (re)started job resumed from: the checkpoint's
  path, step and epoch, torchrun's restart count, and a world size other than the one that
  wrote it; a restart that finds no checkpoint says it starts over.
* **damaged checkpoint** (``kind: "damaged_checkpoint"``): a newer checkpoint that failed to
  load on resume (a truncated or missing file): its path, why, and the one resumed instead.

Hangs and stragglers are ``train.observe.watchdog``'s.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors.torch import load_file, save_file

from genrec.models.inputs import SequenceBatch
from genrec.train.loop.parallel import no_sync
from genrec.train.observe import faults
from genrec.train.observe.logs import log

SPIKE_WINDOW, SPIKE_WARMUP = 100, 20


class NonFiniteError(RuntimeError):
    """A step's loss or gradient was not finite; the message is the diagnosis."""


def _clean(v: Any) -> Any:
    """JSON without NaN tokens: non-finite floats as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class DiagnosisLog:
    """Appends diagnoses to ``RUN/diagnosis.jsonl`` (every rank, one ``write`` each, so lines
    from ranks do not interleave) and prints them."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path, self.dir, self.rank = run_dir / "diagnosis.jsonl", run_dir / "diagnosis", rank

    def write(self, kind: str, line: str, printed: bool = True, **fields: Any) -> None:
        rec = {"kind": kind, "rank": self.rank, "time": time.time(), "message": line, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(_clean(rec), default=str) + "\n")
        level = logging.INFO if kind == "resumed" else logging.WARNING
        log.log(level, f"diagnosis: {line}", extra={"all_ranks": True, "file_only": not printed})


# ----- finding the first non-finite value ------------------------------------------------------
def all_finite(obj: Any) -> bool:
    """Whether every floating-point value in ``obj`` (tensors, containers, KJT / jagged
    values) is finite; other values count as finite. TorchRec's lazy awaitables are skipped."""
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(all_finite(v) for v in obj)
    if "Awaitable" in type(obj).__name__:
        return True
    values = getattr(obj, "values", None)
    if callable(values) and hasattr(obj, "lengths"):  # KeyedJaggedTensor, JaggedTensor
        return all_finite(values())
    return True


def nonfinite_parameters(module: torch.nn.Module, limit: int = 10) -> list[str]:
    """Names of parameters holding a NaN or inf (weights broken by an earlier update)."""
    out = []
    for name, p in module.named_parameters():
        local = p.local_tensor() if hasattr(p, "local_tensor") else p
        if isinstance(local, torch.Tensor) and not all_finite(local.detach()):
            out.append(name)
            if len(out) == limit:
                break
    return out


class FirstNonFinite:
    """Hooks on every submodule's output and every parameter's gradient that remember the
    first non-finite one (forward: in order of completion, so the innermost module where it
    appeared; backward: in order of arrival, so the nearest to the loss)."""

    def __init__(self, module: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> None:
        self.output: dict[str, Any] | None = None
        self.grad: str | None = None
        self.handles = [m.register_forward_hook(self._output_hook(name or "(the model itself)"), with_kwargs=True)
                        for name, m in module.named_modules()]
        self.handles += [p.register_hook(self._grad_hook(name)) for name, p in params.items() if p.requires_grad]

    def _output_hook(self, name: str) -> Callable:
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if self.output is None and not all_finite(out):
                self.output = {"module": name, "module_type": type(mod).__name__,
                               "inputs_finite": all_finite(args) and all_finite(kwargs)}
        return hook

    def _grad_hook(self, name: str) -> Callable:
        def hook(g: torch.Tensor) -> None:
            if self.grad is None and not all_finite(g):
                self.grad = name
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ----- batches to and from files ----------------------------------------------------------------
def save_batch(batch: SequenceBatch, path: Path) -> dict[str, Any]:
    """Writes ``batch``'s tensors to ``path`` (safetensors); returns what rebuilds it with them
    (``load_batch``): the KJT keys and strides and the plain fields."""
    tensors, meta = {}, {"kjt": {}, "plain": {}}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            tensors[f.name] = v.detach().cpu().contiguous()
        elif v is not None and hasattr(v, "keys") and hasattr(v, "lengths"):  # KeyedJaggedTensor
            tensors[f"{f.name}.values"] = v.values().detach().cpu().contiguous()
            tensors[f"{f.name}.lengths"] = v.lengths().detach().cpu().contiguous()
            if v.weights_or_none() is not None:
                tensors[f"{f.name}.weights"] = v.weights().detach().cpu().contiguous()
            meta["kjt"][f.name] = {"keys": list(v.keys()), "stride": v.stride()}
        elif v is None or isinstance(v, (int, float, bool, str)):
            meta["plain"][f.name] = v
        else:
            raise TypeError(f"batch field {f.name} ({type(v).__name__}) cannot be saved")
    save_file(tensors, str(path))
    return meta


def load_batch(path: Path, meta: dict[str, Any]) -> SequenceBatch:
    from torchrec import KeyedJaggedTensor

    tensors = load_file(str(path))
    kw: dict[str, Any] = dict(meta["plain"])
    for name, k in meta["kjt"].items():
        kw[name] = KeyedJaggedTensor(keys=k["keys"], values=tensors[f"{name}.values"],
                                     lengths=tensors[f"{name}.lengths"], weights=tensors.get(f"{name}.weights"),
                                     stride=k["stride"])
    kw.update({k: v for k, v in tensors.items() if "." not in k})
    return SequenceBatch(**kw)


def _rng(state: torch.Tensor | None) -> str | None:
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode()


def _unrng(text: str | None) -> torch.Tensor | None:
    return None if text is None else torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


class SpikeDetector:
    """Flags a loss above ``factor`` x the median of the last ``window`` losses."""

    def __init__(self, factor: float, window: int = SPIKE_WINDOW, warmup: int = SPIKE_WARMUP) -> None:
        self.factor, self.warmup = factor, warmup
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> float | None:
        """The median ``loss`` is a spike against, else None; ``loss`` joins the window."""
        spike = None
        if self.factor > 0 and len(self.recent) >= self.warmup and math.isfinite(loss):
            med = statistics.median(self.recent)
            if med > 0 and loss > self.factor * med:
                spike = med
        if math.isfinite(loss):
            self.recent.append(loss)
        return spike


class Diagnoser:
    """The trainer's diagnosis: the per-step checks and what runs when one fails. It reads the
    trainer's model, module, optimizer, checkpoint I/O and state (``t`` below)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, device: torch.device | None,
                 spike_factor: float, module: torch.nn.Module) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.device = device if device is not None else torch.device("cpu")
        self.log = DiagnosisLog(run_dir, rank)
        self.dir = self.log.dir
        self.spikes = SpikeDetector(spike_factor)
        self.step = 0
        self.rng: torch.Tensor | None = None
        self.device_rng: torch.Tensor | None = None
        self.replaying: Path | None = None
        faults.install_nan(module, lambda: self.step)  # a test's nan fault (observe.faults)

    # ----- every step -------------------------------------------------------------------------
    def step_begins(self, step: int) -> None:
        """Keeps the RNG state the step starts from (a re-run must draw the same dropout and
        negatives): a few KB copied, no device sync."""
        self.step = step
        self.rng = torch.get_rng_state()
        if self.device.type == "cuda":
            self.device_rng = torch.cuda.get_rng_state(self.device)

    def nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
        """The step's check (one device sync on a GPU). Distributed, only the gradient norm
        decides: it is the same on every rank, so every rank stops, and re-runs, alike."""
        bad = grad_norm is not None and not bool(torch.isfinite(grad_norm))
        if self.world_size == 1:
            bad = bad or not bool(torch.isfinite(loss.detach()))
        return bad

    def after_step(self, step: int, loss: float) -> None:
        med = self.spikes.check(loss)
        if med is not None:
            self.log.write("loss_spike", f"loss spike at step {step} (rank {self.rank}): {loss:.4g} is "
                           f"{loss / med:.1f}x the median {med:.4g} of the last {len(self.spikes.recent) - 1} steps",
                           step=step, loss=loss, median=med, factor=self.spikes.factor)

    def damaged_checkpoint(self, path: Path, why: str, used: Path) -> None:
        """Says that checkpoint ``path`` failed to load (``why``) and ``used`` was resumed instead."""
        if self.rank != 0:
            return
        aside = path.with_name("damaged_" + path.name)
        self.log.write("damaged_checkpoint", f"checkpoint {path} is damaged and was skipped ({why}); resuming from "
                       f"the newest one that loads, {used.name}, instead (the damaged one is kept as {aside.name})",
                       checkpoint=str(path), why=why, used=str(used), kept_as=str(aside))

    def resumed(self, path: Path | None, step: int, epoch: int, written_world: int | None) -> None:
        """Says what a (re)started job resumed from (rank 0; the ranks share the checkpoint)."""
        if self.rank != 0:
            return
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        how = f" (torchrun restart {restart})" if restart else ""
        if path is None:
            if restart:
                self.log.write("resumed", f"restart {restart} found no checkpoint in {self.run_dir / 'checkpoints'}: "
                               "training starts over from step 0", checkpoint=None, step=0, restart=restart)
            return
        world = (f", written by {written_world} ranks, resumed on {self.world_size}"
                 if written_world not in (None, self.world_size) else "")
        self.log.write("resumed", f"resumed{how} from {path}: step {step}, epoch {epoch}{world}",
                       checkpoint=str(path), step=step, epoch=epoch, restart=restart,
                       world_size=self.world_size, written_world_size=written_world)

    # ----- a non-finite step ------------------------------------------------------------------
    def explain(self, t: Any, batch: SequenceBatch, losses: dict[str, torch.Tensor],
                grad_norm: torch.Tensor | None) -> NoReturn:
        """Saves the step's weights and batch, re-runs the batch with hooks, writes the
        diagnosis and raises ``NonFiniteError`` with it."""
        step = self.step
        values = {k: float(v.detach()) for k, v in losses.items()}
        norm = float(grad_norm) if grad_norm is not None else None
        broken = nonfinite_parameters(t.module)
        replay = self.replaying or self._save(t, batch, step)
        t.optimizer.zero_grad(set_to_none=True)
        found = self._rerun(t, batch)
        t.optimizer.zero_grad(set_to_none=True)
        bad = [k for k, v in values.items() if not math.isfinite(v)]
        what = f"non-finite {'loss (' + ', '.join(bad) + ')' if bad else 'gradient'} at step {step} (rank {self.rank})"
        parts = []
        if broken:
            parts.append(f"weights already non-finite: {', '.join(broken)}")
        if found.output is not None:
            o = found.output
            origin = "from finite inputs" if o["inputs_finite"] else "from non-finite inputs"
            parts.append(f"first non-finite output: {o['module']} ({o['module_type']}), {origin}")
        if found.grad is not None:
            parts.append(f"first non-finite gradient: {found.grad}")
        if found.output is None and found.grad is None and not broken:
            parts.append("this rank's forward and backward are finite when re-run: the non-finite gradient came from "
                         "another rank through the all-reduce" if self.world_size > 1 else
                         "the re-run is finite: not reproducible in this process (nondeterministic kernels?)")
        if self.replaying:
            parts.append(f"replayed from {replay}")
        else:
            parts.append(f"batch and weights saved; replay: genrec train --resume {self.run_dir} "
                         f"--train.replay={replay}")
        line = f"{what}: " + "; ".join(parts)
        self.log.write("nonfinite", line, step=step, epoch=t.state.epoch, losses=values, grad_norm=norm,
                       nonfinite_weights=broken, **(found.output or {}), parameter=found.grad, replay=str(replay),
                       replayed=self.replaying is not None)
        raise NonFiniteError(line)

    def _rerun(self, t: Any, batch: SequenceBatch) -> FirstNonFinite:
        """The step's forward and backward again, from its RNG state, with the hooks; every
        rank runs it (DMP's all-to-alls are collective), DDP's reduction left out."""
        self._set_rng(self.rng, self.device_rng)
        params = dict(t.module.named_parameters())
        found = FirstNonFinite(t.module, params)
        try:
            with no_sync(t.model):
                with t._autocast():
                    out = t.model(batch)
                loss = out["loss"]
                if loss.requires_grad:
                    loss.backward()
        finally:
            found.remove()
        return found

    def _save(self, t: Any, batch: SequenceBatch, step: int) -> Path:
        """The weights (before the step's update) as a checkpoint ``diagnosis/step_<N>``, every
        rank together, and this rank's batch; returns the JSON that replays them."""
        from genrec.train.loop import checkpoint as ckpt

        self.dir.mkdir(parents=True, exist_ok=True)
        weights = ckpt.save_checkpoint(self.dir, step, t.io.state(), {"trainer": dict(t.state.__dict__)})
        name = f"nonfinite_step{step}_rank{self.rank}"
        meta = save_batch(batch, self.dir / f"{name}.safetensors")
        body = {"step": step, "rank": self.rank, "world_size": self.world_size, "weights": weights.name,
                "batch": f"{name}.safetensors", "batch_meta": meta, "rng": _rng(self.rng),
                "device_rng": _rng(self.device_rng)}
        path = self.dir / f"{name}.json"
        path.write_text(json.dumps(body, indent=1) + "\n")
        return path

    def _set_rng(self, rng: torch.Tensor | None, device_rng: torch.Tensor | None) -> None:
        if rng is not None:
            torch.set_rng_state(rng)
        if device_rng is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(device_rng, self.device)

    # ----- replay -----------------------------------------------------------------------------
    def replay(self, t: Any, path: Path) -> dict[str, Any]:
        """Runs the saved step again (see the module docstring); returns the results of a
        replay that came out finite (one that does not raises ``NonFiniteError``)."""
        from genrec.train.loop import checkpoint as ckpt

        path = Path(path)
        if self.world_size > 1:  # each rank its own batch
            path = path.with_name(path.name.replace(f"_rank{json.loads(path.read_text())['rank']}", f"_rank{self.rank}"))
        meta = json.loads(path.read_text())
        weights = path.parent / meta["weights"]
        ckpt.restore(t.io, weights)
        t.state = type(t.state)(**{**ckpt.load_trainer_state(weights)["trainer"], "stopped": ""})
        batch = load_batch(path.parent / meta["batch"], meta["batch_meta"])
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        self._set_rng(_unrng(meta["rng"]), _unrng(meta.get("device_rng")))
        self.replaying = path
        losses = t.train_step(batch)  # raises NonFiniteError if the fault reproduces
        self.log.write("replay", f"replay of step {meta['step']} (rank {meta['rank']}, {path}) is finite: "
                       f"loss {losses['loss']:.6g}; the fault did not reproduce", step=meta["step"], losses=losses)
        return {"stopped": "replay", "epochs": t.state.epoch, "steps": t.state.step, "train_seconds": 0.0,
                "replay": {"step": meta["step"], "finite": True, "losses": losses}}
