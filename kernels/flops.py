"""FLOPs of the kernels PyTorch's ``FlopCounterMode`` cannot see.

``torch.utils.flop_counter`` counts the aten ops it dispatches (matmuls, SDPA, convolutions).
An attention that runs in a native C++ call (``kernels.hstu_train``) or a Triton launch
(``kernels.triton_hstu``) dispatches none, so it counted zero: a model's FLOPs, and the MFU
divided from them, depended on which backend ran the attention. Those kernels report their
work here instead, and ``train.observe.stepstats.FlopCount`` adds it to the aten count.

What is counted is the attention's GEMM work over each sequence's causal triangle (the pairs
``j <= i`` every backend computes; pairs the mask zeroes inside it are computed too), as
FlashAttention counts causal attention: per pair and head ``2 dqk`` (scores) ``+ 2 dv`` (P v)
forward, twice that backward (dP and dS k; dS^T q and P^T dout). Nothing is computed while
no counter is open: the kernels' calls cost one list test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_open: list[list[int]] = []


def counting() -> bool:
    """Whether a counter is open (the kernels skip the arithmetic otherwise)."""
    return bool(_open)


def add(flops: int) -> None:
    """Adds ``flops`` to every open counter."""
    for c in _open:
        c[0] += flops


@contextlib.contextmanager
def counter() -> Iterator[list[int]]:
    """A counter open for the ``with`` block: ``c[0]`` holds the FLOPs reported in it."""
    c = [0]
    _open.append(c)
    try:
        yield c
    finally:
        _open.remove(c)


def causal_attention_flops(offsets: torch.Tensor, heads: int, dqk: int, dv: int, backward: bool = False) -> int:
    """FLOPs of one attention pass over the jagged batch ``offsets`` (see the module
    docstring): the forward's, or with ``backward`` the backward's (twice the forward)."""
    n = offsets.detach().to("cpu", torch.int64).diff()
    pairs = int((n * (n + 1) // 2).sum())
    return pairs * heads * 2 * (dqk + dv) * (2 if backward else 1)
