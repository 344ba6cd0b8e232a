"""What a managed-collision (MCH) table keeps outside its state dict, kept with each checkpoint.

TorchRec's ``MCHManagedCollisionModule`` checkpoints its remap and per-id metadata as buffers,
but three things only in memory decide its next eviction: the ids (and their eviction-policy
metadata) recorded since the last eviction, how many there are, and the iteration it last
evicted at. A resumed process without them starts the eviction schedule over from the resume
step and forgets the ids seen before it: it no longer trains the model the uninterrupted run
trains. :func:`capture` reads them (one rank's modules; each rank writes its own file), and
:func:`apply` puts them back after the module's buffers are loaded. They are read through the
module's own attributes (``_history_accumulator``, ``_history_metadata``,
``_current_history_buffer_offset``, ``_input_history_buffer_size``, ``_last_eviction_iter``,
``_current_iter``), the TorchRec surface listed in docs/training.md.
"""

from __future__ import annotations

from typing import Any

import torch


def modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(name, module) of every MCH module in ``model`` (wrapped or sharded alike)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return [(n, m) for n, m in model.named_modules() if isinstance(m, MCHManagedCollisionModule)]


def capture(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each MCH module's eviction state (module docstring) as tensors; {} without MCH tables."""
    out: dict[str, torch.Tensor] = {}
    for name, m in modules(model):
        size, used = int(m._input_history_buffer_size), int(m._current_history_buffer_offset)
        out[f"{name}/meta"] = torch.tensor([m._last_eviction_iter, used, size, m._current_iter], dtype=torch.int64)
        if size > 0:
            out[f"{name}/ids"] = m._history_accumulator[:used].detach().cpu().clone()
            for key, buf in m._history_metadata.items():
                out[f"{name}/metadata/{key}"] = buf[:used].detach().cpu().clone()
    return out


def apply(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Puts :func:`capture`'s ``state`` back into ``model``'s MCH modules (their buffers loaded
    already); returns how many modules it restored. A module the state does not name is left as
    loaded (its schedule restarts)."""
    done = 0
    for name, m in modules(model):
        meta = state.get(f"{name}/meta")
        if meta is None:
            continue
        last, used, size, current = (int(x) for x in meta.tolist())
        m._current_iter, m._last_eviction_iter = current, last
        if size > 0:
            dev = m._current_iter_tensor.device
            m._input_history_buffer_size = size
            m._history_accumulator = torch.empty(size, dtype=torch.int64, device=dev)
            m._history_accumulator[:used] = state[f"{name}/ids"].to(dev)
            for key, _, is_history in m._eviction_policy.metadata_info:
                if is_history:
                    buf = torch.zeros(size, dtype=torch.int64, device=dev)
                    buf[:used] = state[f"{name}/metadata/{key}"].to(dev)
                    m.register_buffer(f"_history_{key}", buf, persistent=False)
                    m._history_metadata[key] = buf
            m._current_history_buffer_offset = used
        done += 1
    return done
