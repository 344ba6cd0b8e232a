"""Jagged <-> padded conversions.

A jagged batch is ``values`` [T, ...] (all sequences concatenated) plus ``offsets`` [B+1]
(sequence b is ``values[offsets[b]:offsets[b+1]]``). Example, B=2, lengths [2, 1]::

    values = [[a], [b], [c]], offsets = [0, 2, 3]
    jagged_to_padded(values, offsets, 2) -> [[[a], [b]], [[c], [0]]]
"""

from __future__ import annotations

import torch


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B+1] int64 offsets."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def jagged_index(offsets: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For every jagged row: (sequence index [T], position within its sequence [T])."""
    lengths = offsets[1:] - offsets[:-1]
    total = int(offsets[-1]) if total is None else total
    seg = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total
    )
    pos = torch.arange(total, device=offsets.device) - offsets[seg]
    return seg, pos


def jagged_to_padded(
    values: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    pad_value: float = 0.0,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[T, *D] jagged -> [B, max_len, *D] padded (rows past a sequence's end = pad_value).

    Sequences longer than ``max_len`` are an error, not a silent truncation.
    """
    seg, pos = index if index is not None else jagged_index(offsets, values.shape[0])
    b = offsets.numel() - 1
    out = values.new_full((b, max_len, *values.shape[1:]), pad_value)
    return out.index_put((seg, pos), values)


def padded_to_jagged(
    padded: torch.Tensor,
    offsets: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[B, L, *D] padded -> [T, *D] jagged (the inverse of :func:`jagged_to_padded`)."""
    seg, pos = index if index is not None else jagged_index(offsets)
    return padded[seg, pos]
