"""bf16 inference ops for scoring many candidates on CPU: the candidates' attention, a linear
layer and SiLU.

What the candidates' bf16 path (``candidate_precision = "bf16"``) runs: the candidates'
attention against a cached history in one native kernel (:func:`candidate_attention`, where
the CPU has AVX512-BF16), the tower's linear layers and the ranking head's MLP in bf16 with
fp32 accumulation inside the GEMM (oneDNN), and SiLU over their bf16 outputs in our own pass (``kernels/cpu/bf16_ops.cpp``: good to bf16's rounding, about half the cost of
oneDNN's SiLU epilogue and a quarter of PyTorch's fp32 SiLU over the same values). Where the
pass is not built vectorised for this CPU (no AVX512-BF16, no compiler, ``GENREC_NATIVE=0``),
PyTorch's SiLU runs instead, with the same results to bf16 rounding.

:func:`silu` is the same pass with a backward (``genrec_silu_backward_bf16``, the same
approximation), for training under bf16 autocast; the rest is inference only.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from genrec.kernels import native

# oneDNN's linear + pointwise op (what torch.compile's CPU backend fuses into); None where absent
linear_pointwise = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None) if (
    torch.backends.mkldnn.is_available()) else None


@functools.cache
def _silu_pass() -> ctypes._CFuncPtr | None:
    """``genrec_silu_bf16(n, x)``: SiLU over n bf16 values in place, where the pass builds
    vectorised (AVX512-BF16); None elsewhere."""
    lib = native.library("bf16_ops")
    if lib is None or not lib.genrec_bf16_vectorised():
        return None
    f = lib.genrec_silu_bf16
    f.argtypes, f.restype = [ctypes.c_int64, ctypes.c_void_p], ctypes.c_int
    return f


@functools.cache
def _silu_out_pass() -> ctypes._CFuncPtr | None:
    """``genrec_silu_bf16_out(n, x, y)``: y = SiLU(x) over n bf16 values, where the SiLU pass is
    vectorised; else None."""
    if _silu_pass() is None:
        return None
    f = native.library("bf16_ops").genrec_silu_bf16_out
    f.argtypes, f.restype = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return f


@functools.cache
def _silu_grad_pass() -> ctypes._CFuncPtr | None:
    """``genrec_silu_backward_bf16(n, x, g, out)`` where the SiLU pass is vectorised; else None."""
    if _silu_pass() is None:
        return None
    f = native.library("bf16_ops").genrec_silu_backward_bf16
    f.argtypes, f.restype = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    return f


@functools.cache
def _candidates_pass() -> ctypes._CFuncPtr | None:
    """``genrec_candidates_bf16`` where the SiLU pass is vectorised (the kernel is built only
    there); else None."""
    if _silu_pass() is None:
        return None
    f = native.library("bf16_ops").genrec_candidates_bf16
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    f.argtypes = [i64, i64, i64, i64, *[ptr, i64] * 3, ptr, ptr, i64, ptr, i64, f32, f32, f32, ptr, i64]
    f.restype = ctypes.c_int
    return f


def fused_candidates(qk_dim: int, v_dim: int) -> bool:
    """Whether :func:`candidate_attention` runs heads of these dims on this CPU."""
    return _candidates_pass() is not None and qk_dim % 2 == 0 and v_dim in (16, 32, 64, 128)


def candidate_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, own_k: torch.Tensor,
                        own_v: torch.Tensor, alpha: float, own_bias: float, scale: float,
                        out: torch.Tensor) -> torch.Tensor:
    """One user's candidates, one head, in one native pass (``kernels/cpu/bf16_ops.cpp``)::

        out = scale * (SiLU(alpha q k^T + bias) v + SiLU(alpha (q * own_k).sum(-1) + own_bias) own_v)

    q, own_k [c, d], own_v and ``out`` [c, dv], the history's keys k [n, d] and values v [n, dv],
    bias [n]: fp32, rows may be strided (unit last stride). The history's part runs in bf16 with
    fp32 sums: the scores stay in registers, SiLU runs on their fp32 sums (:func:`silu_`'s
    approximation) and they are rounded to bf16 once for the value GEMM, as the two-GEMM path
    rounds its score block; the candidates' own term stays in fp32. Only where
    :func:`fused_candidates` says so."""
    f = _candidates_pass()
    c, d = q.shape
    n, dv = v.shape
    if f is None or not fused_candidates(d, dv):
        raise ValueError(f"no native candidates' attention for dims {d} / {dv} here (see fused_candidates)")
    ts = (q, k, v, bias, own_k, own_v, out)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts):
        raise TypeError("candidate_attention takes fp32 CPU tensors")
    if (k.shape != (n, d) or bias.shape != (n,) or own_k.shape != (c, d) or own_v.shape != (c, dv)
            or out.shape != (c, dv) or not bias.is_contiguous() or any(t.stride(-1) != 1 for t in ts)):
        raise ValueError("candidate_attention: q, own_k [c, d], k [n, d], v [n, dv], bias [n], own_v, out [c, dv]")
    if f(c, n, d, dv, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
         bias.data_ptr(), own_k.data_ptr(), own_k.stride(0), own_v.data_ptr(), own_v.stride(0), alpha, own_bias,
         scale, out.data_ptr(), out.stride(0)):
        raise RuntimeError("genrec_candidates_bf16 refused its arguments")
    return out


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        y = torch.empty_like(x)
        _silu_out_pass()(x.numel(), x.data_ptr(), y.data_ptr())
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        g = g.to(torch.bfloat16).contiguous()
        out = torch.empty_like(x)
        _silu_grad_pass()(x.numel(), x.data_ptr(), g.data_ptr(), out.data_ptr())
        return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x``, differentiable: for a contiguous bf16 CPU tensor (the HSTU layers'
    projection under bf16 autocast) the native passes forward and backward where they are
    built (good to bf16's rounding), else PyTorch's."""
    if (_silu_grad_pass() is None or x.dtype != torch.bfloat16 or x.device.type != "cpu"
            or not x.is_contiguous()):
        return F.silu(x)
    return _Silu.apply(x)


def fast_silu() -> bool:
    """Whether :func:`silu_` runs the native pass on this CPU."""
    return _silu_pass() is not None


def silu_(x: torch.Tensor) -> torch.Tensor:
    """SiLU of ``x`` in place: the native pass for a contiguous bf16 CPU tensor where it is
    built, else PyTorch's."""
    f = _silu_pass()
    if f is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous():
        return F.silu(x, inplace=True)
    f(x.numel(), x.data_ptr())
    return x


def bucket(n: int) -> int:
    """n rounded up to one of few sizes: a multiple of 16 up to 128, then of an eighth to a
    sixteenth of n's power of two (at most 1/8 more work): 636 -> 640, 8,000 -> 8,192. oneDNN
    builds a kernel for every new bf16 GEMM shape (about 1 ms, measured; its cache holds 1,024),
    and serving's row counts change from call to call."""
    step = 16 if n <= 128 else 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def zero_padded(t: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` [m, ...] in ``dtype`` (default its own) with zero rows after it to n rows: one copy
    that casts too (``t`` itself where m = n and the dtype is its own)."""
    dtype = dtype or t.dtype
    if t.shape[0] == n:
        return t.to(dtype)
    out = t.new_empty(n, *t.shape[1:], dtype=dtype)
    out[: t.shape[0]].copy_(t)
    out[t.shape[0] :].zero_()
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = False) -> torch.Tensor:
    """x [N, K] @ weight [M, K]^T + bias [M] -> [N, M] in bf16 (x and the weights cast), then
    SiLU where ``silu``. On CPU the rows are zero-padded to a :func:`bucket` size for the GEMM."""
    n = x.shape[0]
    cpu = x.device.type == "cpu"
    xb = zero_padded(x, bucket(n) if cpu else n, torch.bfloat16)
    xb, wb = xb.contiguous(), weight.to(torch.bfloat16)
    bb = bias.to(torch.bfloat16) if bias is not None else None
    if linear_pointwise is not None and cpu:
        y = linear_pointwise(xb, wb, bb, "none", [], "")
    else:
        y = F.linear(xb, wb, bb)
    y = silu_(y) if silu else y
    return y[:n] if y.shape[0] != n else y
