"""Checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout (one directory per step, written under a temporary name, its files and folder
fsynced, and renamed when every rank has finished, so neither a killed job nor a power loss
leaves a half-written ``step_*``; the parent folder is fsynced after the rename)::

    checkpoints/step_00001200/
      .metadata, __*_*.distcp        DCP: model and optimizer tensors (sharded or not)
      trainer_state.rank{r}.json     step, epoch, reader position, RNG states, early stopping

Tensors go through DCP; everything else is JSON, so no Python object is ever unpickled
from the trainer state. Loading works on any world size DCP can reshard to; the reader
position of rank r is taken from the same rank (or rank 0's epoch when the world changed).
"""

from __future__ import annotations

import base64
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from genrec.models.calibration import is_calibration_key
from genrec.train.data.schema import fsync_path

PREFIX = "step_"
DAMAGED = "damaged_"  # a checkpoint that failed to load on resume, set aside under this prefix
T = TypeVar("T")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> str:
    return _encode(torch.get_rng_state())


def set_rng_state(text: str) -> None:
    torch.set_rng_state(_decode(text))


def device_rng_state(device: torch.device | None) -> str | None:
    """The CUDA generator of ``device``, where dropout masks and sampled negatives are drawn
    when the model runs there (None on CPU, where the CPU generator draws them)."""
    if device is None or device.type != "cuda":
        return None
    return _encode(torch.cuda.get_rng_state(device))


def set_device_rng_state(text: str | None, device: torch.device | None) -> None:
    if text is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_decode(text), device)


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, oldest first."""
    if not root.exists():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / ".metadata").exists()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def model_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=False)
    if optimizer is None:
        msd, _ = get_state_dict(model, [], options=opts)
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd}


def fsync_tree(folder: Path) -> None:
    """Flushes every file below ``folder``, then each folder (deepest first, ``folder`` last):
    a rename of ``folder`` afterwards never publishes files whose bytes are still in the page cache."""
    for p in sorted(folder.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p.is_file() or p.is_dir():
            fsync_path(p)
    fsync_path(folder)


def save_checkpoint(root: Path, step: int, tensors: dict[str, Any], trainer_state: dict[str, Any],
                    rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Writes ``tensors`` (model / optimizer state) and the trainer state to ``root/step_<step>``
    atomically; returns its path. ``rank_tensors``: this rank's own tensors besides
    (``rank_tensors_file``; the MCH tables' eviction state, ``train.loop.mch_state``)."""
    rank, world = _rank_world()
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(tensors, checkpoint_id=tmp)
    body = {**trainer_state, "world_size": world, "rank": rank}
    (tmp / f"trainer_state.rank{rank}.json").write_text(json.dumps(body, indent=1))
    if rank_tensors:
        torch.save(rank_tensors, tmp / rank_tensors_file(rank))
    _barrier()
    if rank == 0:  # (every rank's files are written: the barrier above)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_path(root)  # the rename itself
    _barrier()
    return final


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (the ranks must agree on which checkpoint they resume)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def _why(e: BaseException) -> str:
    """A one-line reason: DCP's own exception (a BaseException) wraps each rank's cause."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, (cause, _) = next(iter(e.failures.items()))
        return f"rank {rank}: " + _why(cause)
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def load_newest(root: Path, load: Callable[[Path], T]) -> tuple[Path, T, list[tuple[Path, str]]] | None:
    """The newest finished checkpoint under ``root`` that ``load`` reads without an error on
    every rank: (its path, what ``load`` returned, the newer ones that failed with why, newest
    first), or None when ``root`` holds none. A damaged checkpoint (a truncated or missing
    file) is skipped for the one before it and, once one loads, set aside as
    ``damaged_step_*`` (kept for a look, no longer counted as a checkpoint). An incompatible
    one (another model or feature spec) is a config error and raises, as does a root where
    none loads. Every rank calls this."""
    found = complete_checkpoints(root)
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            out, why = load(path), ""
        except IncompatibleCheckpoint:
            raise
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - whatever a damaged file raises
            out, why = None, _why(e)
        if _everywhere(not why):
            _barrier()
            if _rank_world()[0] == 0:
                for bad, _ in damaged:
                    bad.rename(bad.with_name(DAMAGED + bad.name))
            _barrier()
            return path, cast(T, out), damaged
        damaged.append((path, why or "it failed to load on another rank"))
    if damaged:
        raise RuntimeError(f"no checkpoint under {root} loads: " +
                           "; ".join(f"{p.name}: {why}" for p, why in damaged))
    return None


def rank_tensors_file(rank: int) -> str:
    return f"rank_tensors.rank{rank}.pt"


def load_rank_tensors(path: Path) -> dict[str, torch.Tensor]:
    """This rank's own tensors of checkpoint ``path`` ({} where it has none)."""
    rank, _ = _rank_world()
    file = path / rank_tensors_file(rank)
    return torch.load(file, weights_only=True) if file.exists() else {}


def load_trainer_state(path: Path) -> dict[str, Any]:
    rank, world = _rank_world()
    own = path / f"trainer_state.rank{rank}.json"
    state = json.loads((own if own.exists() else path / "trainer_state.rank0.json").read_text())
    if state.get("world_size") != world or state.get("rank") != rank:
        state["reader"] = {**state.get("reader", {}), "world_size": -1}  # reader restarts the epoch
    return state


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restores model (and optimizer) tensors from ``path``; returns this rank's trainer state."""
    PlainState(model, optimizer).restore(path, with_optimizer=optimizer is not None)
    state = load_trainer_state(path)
    written = int(state.get("world_size", 1))
    sparse = getattr(model, "sparse", None)
    if written > 1 and _rank_world()[1] == 1 and getattr(sparse, "mc_ec", None) is not None:
        # TorchRec's sharded MCH gives each shard its own miss row; one process has one
        warnings.warn(f"{path}: managed-collision tables were trained on {written} ranks, where ids without a row "
                      f"read their shard's miss row (one per shard); here they all read the table's last row, so "
                      f"those ids score differently than in training", stacklevel=2)
    return state


class PlainState:
    """What a checkpoint holds of an unsharded (or DDP/FSDP) model and its optimizer.

    ``train.loop.parallel.Parallelized`` offers the same four methods for a DMP model."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer

    def state(self) -> dict[str, Any]:
        return model_optim_state(self.model, self.optimizer)

    def load(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or "optim" not in state:
            set_state_dict(self.model, [], model_state_dict=state["model"], optim_state_dict={})
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def init_optimizer_state(self) -> None:
        """get_state_dict already creates missing optimizer state."""

    def restore(self, path: Path, with_optimizer: bool = True) -> None:
        restore(self, path, with_optimizer)


class IncompatibleCheckpoint(ValueError):
    """A checkpoint was written for another model or feature spec."""


def check_compatible(path: Path, model_state: dict[str, Any]) -> None:
    """Compares the checkpoint's tensor shapes with the model's before loading anything;
    names the first table (or tensor) that differs."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in model_state.items():
        full = f"model.{key}"
        shape = list(getattr(value, "size", lambda: ())())
        what = f"table '{key.split('.')[-2]}'" if ".embeddings." in key or ".embedding_bags." in key else f"tensor '{key}'"
        if full not in stored:
            raise IncompatibleCheckpoint(f"{path}: {what} is not in this checkpoint (a different feature spec or model)")
        got = list(getattr(stored[full], "size", []))
        if got != shape:
            raise IncompatibleCheckpoint(
                f"{path}: {what} has shape {got} in the checkpoint but {shape} in this config "
                f"(a different feature spec: num_embeddings or dim changed)")


def restore(io: Any, path: Path, with_optimizer: bool = True) -> None:
    """Loads checkpoint ``path`` into ``io`` (PlainState or Parallelized), resharding as needed.
    A checkpoint written before the ranking head had a calibrator leaves it unfitted (identity)."""
    if with_optimizer:
        io.init_optimizer_state()
    state = io.state()
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    # the calibrator's buffers, when absent, keep their values: io.load below sets them to themselves
    loaded = {k: v for k, v in state["model"].items() if not is_calibration_key(k) or f"model.{k}" in stored}
    check_compatible(path, loaded)
    if not with_optimizer:
        state = {"model": state["model"]}
    else:  # entries besides the model that this checkpoint was written without (say, weight averages)
        state = {k: v for k, v in state.items()
                 if k == "model" or k in stored or any(s.startswith(k + ".") for s in stored)}
    dcp.load({**state, "model": loaded}, checkpoint_id=path)
    io.load(state)


def amend_checkpoint(io: Any, path: Path, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrites checkpoint ``path`` with ``module``'s state entries ``tensors`` (say, a fitted
    calibrator's buffers) replaced and everything else as it was written: the whole checkpoint
    (model, optimizer, weight averages, every rank's trainer state) is restored into ``io``,
    the tensors are set, and it is saved again in place (atomically, as every save). Every
    rank calls this. ``module`` then holds the checkpoint's training weights (not its
    averages): restore the model again before evaluating it."""
    own = dict(module.named_buffers()) | dict(module.named_parameters())
    unknown = [k for k in tensors if k not in own]
    if unknown:
        raise KeyError(f"not tensors of the model: {unknown[:3]}")
    restore(io, path, with_optimizer=True)
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v)
    trainer_state = load_trainer_state(path)
    step = int(path.name[len(PREFIX) :])
    save_checkpoint(path.parent, step, io.state(), trainer_state)


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """A run directory (-> its best checkpoint, else its newest) or a checkpoint directory
    inside one -> (run dir, checkpoint)."""
    path = Path(path)
    if (path / "config.toml").exists():
        res = path / "results.json"
        best = json.loads(res.read_text()).get("best_checkpoint") if res.exists() else None
        found = path / "checkpoints" / best if best else latest_checkpoint(path / "checkpoints")
        if found is None or not found.exists():
            raise FileNotFoundError(f"{path}: the run has no finished checkpoint")
        return path, found
    if (path / ".metadata").exists() and (path.parent.parent / "config.toml").exists():
        return path.parent.parent, path
    raise FileNotFoundError(f"{path}: neither a run directory (config.toml) nor a checkpoint inside one")


def _stored_alike(path: Path, state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Splits a model's ``state`` into the tensors checkpoint ``path`` holds with the same name and
    shape (to read) and the names of the rest (left as initialised); none in common: refused."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    take, left = {}, []
    for key, value in state.items():
        meta = stored.get(f"model.{key}")
        # another model's calibration does not fit this one: it starts unfitted, and is fitted anew after training
        if meta is not None and not is_calibration_key(key) and list(getattr(meta, "size", [])) == list(getattr(value, "size", lambda: ())()):
            take[key] = value
        else:
            left.append(key)
    if not take:
        raise IncompatibleCheckpoint(f"{path}: none of this model's tensors is in the checkpoint")
    return take, left


def warm_start(model: torch.nn.Module, path: Path) -> list[str]:
    """Loads into ``model`` every tensor of checkpoint ``path`` that it has with the same name
    and shape (a fine-tune starting from another run: say, a dense run's tables and tower
    under a new decoder head); returns the names of the model's tensors left as initialised.
    The optimizer and trainer state start fresh."""
    msd, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=False))
    take, left = _stored_alike(path, msd)
    dcp.load({"model": take}, checkpoint_id=path)
    set_state_dict(model, [], model_state_dict=take, optim_state_dict={}, options=StateDictOptions(strict=False))
    return left


def warm_start_state(io: Any, path: Path) -> list[str]:
    """``warm_start`` for a checkpoint I/O object (``Parallelized``: a DMP model whose tables are
    sharded, the state keyed as ``io.state()["model"]``): every tensor of ``path`` this model
    has with the same name and shape is read into this rank's shards (DCP reshards); the rest,
    and the optimizer, start as initialised. Returns the names left as initialised."""
    state = io.state()["model"]
    take, left = _stored_alike(path, state)
    dcp.load({"model": take}, checkpoint_id=path)  # in place, into this rank's shards and replicas
    io.load({"model": {**state, **take}})
    return left


def prune_checkpoints(root: Path, keep: int, protect: set[Path]) -> None:
    """Deletes all but the newest ``keep`` finished checkpoints (and any in ``protect``, and the
    chosen checkpoint each kept one names: a resume that falls back to a kept checkpoint finds
    the best it knew of)."""
    rank, _ = _rank_world()
    if rank != 0:
        return
    done = complete_checkpoints(root)
    cut = max(len(done) - keep, 0)
    names = {p.name for p in protect} | {step_dir(root, s).name for s in map(_chosen, done[cut:]) if s >= 0}
    for p in done[:cut]:
        if p.name not in names:
            shutil.rmtree(p, ignore_errors=True)


def _chosen(path: Path) -> int:
    """The chosen (best) step a checkpoint's trainer state names; -1 for none or unreadable."""
    try:
        return int(json.loads((path / "trainer_state.rank0.json").read_text())["trainer"]["best_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
