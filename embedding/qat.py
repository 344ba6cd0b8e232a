"""Quantization-aware training for embedding rows.

fbgemm stores an n-bit row as codes plus a per-row fp16 scale and bias (the row's min):
``x_hat = code * scale + bias``, ``scale = (max - min) / (2^n - 1)``. During training,
:func:`fake_quantize_rows` replaces each looked-up row by that reconstruction in the
forward pass and passes the gradient straight through (STE), so the float table learns
rows that survive the serving artifact's quantization.

Example: a row [0.0, 0.5, 1.0] at 2 bits -> scale 1/3, codes [0, 2, 3] -> [0, 0.667, 1.0].
"""

from __future__ import annotations

import torch


def fake_quantize_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, D] rows -> rows rounded to the n-bit row-wise grid (gradient: identity)."""
    lo = x.detach().amin(dim=-1, keepdim=True).half().float()
    hi = x.detach().amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.clamp(torch.round((x.detach() - lo) / scale), 0, 2**bits - 1)
    return x + (codes * scale + lo - x).detach()
