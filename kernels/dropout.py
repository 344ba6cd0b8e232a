"""Dropout for training on CPU: the mask drawn and applied in one native pass, and redrawn
(not kept) for the backward pass.

PyTorch's CPU generator draws one value at a time on one thread, several times the cost of
the pass that applies the mask, and the HSTU training step has seven masks over [tokens, 64]. The
native pass (``kernels/cpu/dropout.cpp``) decides element i from a counter-based hash of
(seed, i): one seed per call, drawn from PyTorch's default generator, so ``torch.manual_seed``
and a checkpoint's RNG state still make a run repeatable; the backward pass runs the same
hash with the same seed over the gradient, so no mask is kept between the passes.

Each element is kept with probability ``1 - round(p 2^32) / 2^32`` and scaled by
``1 / (1 - p)``: the distribution of ``nn.Dropout`` (to 2^-32 in p), a different random stream.
fp32 and bf16 (what autocast hands the HSTU layers' dropout). Where the pass is not built (no
compiler, ``GENREC_NATIVE=0``), for tensors it does not take (another dtype, not on CPU, not
contiguous) or in place, :func:`dropout` draws
``rand_like(x) >= p`` with PyTorch instead (the same distribution).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from genrec.kernels import native


@functools.cache
def _passes() -> dict[torch.dtype, ctypes._CFuncPtr] | None:
    """``genrec_dropout_<dtype>(n, x, y, seed, threshold, scale)`` by dtype, or None where not built."""
    lib = native.library("dropout")
    if lib is None:
        return None
    out = {}
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        f = getattr(lib, f"genrec_dropout_{name}")
        f.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float]
        f.restype = ctypes.c_int
        out[dtype] = f
    return out


def native_supported(x: torch.Tensor) -> bool:
    """Whether :func:`dropout` runs the native pass for ``x``: a contiguous fp32 or bf16 CPU tensor."""
    passes = _passes()
    return passes is not None and x.dtype in passes and x.device.type == "cpu" and x.is_contiguous()


def _apply(x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:
    y = torch.empty_like(x)
    _passes()[x.dtype](x.numel(), x.data_ptr(), y.data_ptr(), seed, threshold, scale)
    return y


class _HashedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.args = (seed, threshold, scale)
        return _apply(x, seed, threshold, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _apply(grad.contiguous(), *ctx.args), None, None, None


def dropout(x: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    """Training-time dropout of ``x`` (``0 < p < 1``): each element zeroed with probability
    ``p``, the rest scaled by ``1 / (1 - p)``; differentiable."""
    scale = 1.0 / (1.0 - p)
    if inplace or not native_supported(x):
        keep = torch.rand_like(x).ge_(p).mul_(scale)  # 0 or 1 / (1 - p)
        return x.mul_(keep) if inplace else x * keep
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64))  # PyTorch's generator: repeatable runs
    threshold = min(int(round(p * 2**32)), 2**32 - 1)
    return _HashedDropout.apply(x, seed, threshold, scale)
