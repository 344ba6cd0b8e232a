"""HSTU attention on CPU in a native kernel, forward and backward: the ``native`` backend of
:func:`kernels.hstu_attention.hstu_attention`, what "auto" runs on CPU where it builds.

The coded PyTorch path (``kernels.hstu_coded``) computes each layer's attention as batched
GEMMs over query blocks padded to the batch's longest sequence, with a pass over memory for
each of its pointwise steps; ``kernels/cpu/hstu_train.cpp`` takes the jagged rows as they lie
(q, k and v may be column slices of one projection: no concatenation, no padding), works on
one user's causal triangle at a time in cache, and keeps the pre-activation scores for its
backward pass. The mask and both relative biases are the coded backend's bias codes (by query
block, built once a batch and shared by the layers through the :class:`AttentionPlan`) into an
fp32 :func:`bias_table`. fp32 inputs: fp32 arithmetic. bf16 inputs (under autocast; the outputs
and gradients come back in bf16): on a CPU with AVX512-BF16 the GEMMs take them as bf16 dot
products with fp32 sums, P and dS rounded to bf16 for the GEMMs that read them (as PyTorch's
bf16 attention rounds them), the pointwise work, the saved scores and the bias table's gradient
in fp32; elsewhere they are widened to fp32. The kernel splits the users between
PyTorch's own OpenMP threads (``kernels.native.EXTRA_FLAGS``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from genrec.kernels import flops, native
from genrec.kernels.hstu_coded import AttentionPlan, bias_table, coded_blocks
from genrec.kernels.hstu_reference import batch_lengths

# the longest sequence the kernel takes (its scratch holds a user's [L, L] scores three times:
# 12 MB a thread at 1,024); past it the coded backend serves
MAX_LEN = 1024
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library("hstu_train")
    if lib is None:
        return None
    head = [ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            _P, _I64, _P, _I64, _P, _I64, _P, _P, ctypes.c_int, _P, ctypes.c_int32, ctypes.c_float, ctypes.c_float]
    lib.genrec_hstu_train_forward.argtypes = [*head, _P, _I64, _P, _P]
    lib.genrec_hstu_train_backward.argtypes = [*head, _P, _I64, _P, _P, _P, _P, _P, _P, ctypes.c_int]
    lib.genrec_hstu_train_forward.restype = lib.genrec_hstu_train_backward.restype = ctypes.c_int
    lib.genrec_hstu_train_bf16_gemms.restype = ctypes.c_int
    return lib


def bf16_gemms() -> bool:
    """Whether bf16 inputs run the kernel's bf16 GEMMs here (built with AVX512-BF16)."""
    lib = _library()
    return bool(lib is not None and lib.genrec_hstu_train_bf16_gemms())


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_len: int) -> bool:
    """Whether :func:`hstu_attention_native` computes these inputs here: CPU tensors of one
    dtype (fp32 or bf16), head sizes multiples of 16, sequences up to :data:`MAX_LEN`, and the
    library built."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0 and max_len <= MAX_LEN and _library() is not None)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [T, H, D] with heads and features contiguous (a column slice of a wider row is fine),
    and its row stride."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.shape[0] > 1 and t.stride(0) < t.shape[1] * t.shape[2]:
        t = t.contiguous()
    return t, t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.shape[2]


def _check(rc: int) -> None:
    if rc:
        raise RuntimeError(f"kernels/cpu/hstu_train.cpp refused the call (code {rc}: 1 head sizes, "
                           "2 a sequence past L, 3 the code blocks)")


def _head(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor,
          codes: torch.Tensor, blocks: torch.Tensor, scalars: tuple) -> tuple:
    """The arguments both kernel entry points start with. Built from the tensors at hand in
    each pass: under activation checkpointing the tensors backward unpacks are recomputed ones,
    at other addresses than the forward's."""
    max_len, masked, alpha, inv_n = scalars
    return (offsets.numel() - 1, offsets.data_ptr(), qr.shape[1], qr.shape[2], vr.shape[2], max_len,
            _DTYPES[qr.dtype], qr.data_ptr(), _rows(qr)[1], kr.data_ptr(), _rows(kr)[1], vr.data_ptr(), _rows(vr)[1],
            codes.data_ptr(), blocks.data_ptr(), blocks.shape[0], table.data_ptr(), masked, alpha, inv_n)


class _NativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,  # noqa: ANN001
                offsets: torch.Tensor, codes: torch.Tensor, blocks: torch.Tensor, max_len: int, masked: int,
                alpha: float, inv_n: float) -> torch.Tensor:
        (qr, _), (kr, _), (vr, _) = _rows(q), _rows(k), _rows(v)
        t, h, dv = q.shape[0], q.shape[1], v.shape[2]
        out = torch.empty(t, h, dv, dtype=q.dtype)
        save_off = torch.cat([offsets.new_zeros(1), offsets.diff().square_().mul_(h).cumsum_(0)])
        save = torch.empty(int(save_off[-1]), dtype=torch.float32)  # each user's scores before SiLU
        ctx.scalars = (max_len, masked, alpha, inv_n)
        head = _head(qr, kr, vr, table, offsets, codes, blocks, ctx.scalars)
        _check(_library().genrec_hstu_train_forward(*head, out.data_ptr(), h * dv, save.data_ptr(),
                                                    save_off.data_ptr()))
        if flops.counting():
            flops.add(flops.causal_attention_flops(offsets, h, q.shape[2], dv))
        ctx.save_for_backward(qr, kr, vr, table, offsets, codes, blocks, save, save_off)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # noqa: ANN001, ANN205
        qr, kr, vr, table, offsets, codes, blocks, save, save_off = ctx.saved_tensors
        dout = dout.to(qr.dtype).contiguous()
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype) for x in (qr, kr, vr))  # contiguous [T, H, D]
        dtable = torch.zeros(table.numel(), dtype=torch.float32)
        head = _head(qr, kr, vr, table, offsets, codes, blocks, ctx.scalars)
        _check(_library().genrec_hstu_train_backward(
            *head, dout.data_ptr(), dout.shape[1] * dout.shape[2], save.data_ptr(), save_off.data_ptr(),
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dtable.data_ptr(), table.numel()))
        if flops.counting():
            flops.add(flops.causal_attention_flops(offsets, qr.shape[1], qr.shape[2], vr.shape[2], backward=True))
        return dq, dk, dv, dtable if ctx.needs_input_grad[3] else None, None, None, None, None, None, None, None


def hstu_attention_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    query_times: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    max_len: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """:func:`kernels.hstu_reference.hstu_attention_reference` in the native kernel (see the
    module docstring; :func:`supported` says where): q, k [T, H, Dqk], v [T, H, Dv] ->
    [T, H, Dv], differentiable in q, k, v and both bias weights."""
    lengths, max_len = batch_lengths(offsets, max_len)
    if q.shape[0] == 0 or max_len == 0:
        return v.new_zeros(v.shape)
    coded = coded_blocks(offsets, q.shape[0], lengths, max_len, max_seq_len, time_weights, timestamps, query_times,
                         num_targets, plan)
    _, _, nb, use_time = coded.key
    table = bias_table(pos_weights, time_weights if use_time else None, max_seq_len, torch.float32)
    offs = offsets.to(torch.int64).contiguous()
    return _NativeAttention.apply(q, k, v, table, offs, *coded.end_to_end(), max_len, max_seq_len * nb, alpha,
                                  1.0 / max_seq_len)
