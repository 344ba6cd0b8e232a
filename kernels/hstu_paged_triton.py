"""Triton kernel: HSTU attention of new tokens over keys / values read in place from a paged pool.

The semantics of :func:`kernels.hstu_paged.hstu_paged_attention` (masks, relative position and
time biases, SiLU / N), but the keys and values are never gathered into a per-sequence
``[B, L, H, D]`` copy: each program reads them block by block straight from the pool buffers
``[S, H, D]`` through the sequence's row of the slot map (SGLang's ``req_to_token``), and the key
times from the per-slot times ``[S]`` the same way. One program per (query row, head): serving
extends a user's history by a few tokens, so queries per sequence are few and keys many.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests); compiled on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64


@triton.jit
def _paged_fwd(Q, KP, VP, Slots, Seq, Index, Lengths, Hist, SlotTimes, QT, PosW, TimeW, Out,
               stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_sb, stride_ot, stride_oh,
               alpha, inv_n, max_seq_len, num_buckets,
               H: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(Seq + i)
    p = tl.load(Index + i).to(tl.int32)
    n = tl.load(Lengths + b).to(tl.int32)
    hist = tl.load(Hist + b).to(tl.int32)
    offs_dq = tl.arange(0, DQ)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + i * stride_qt + h * stride_qh + offs_dq).to(tl.float32)
    qt = 0
    if HAS_TIME:
        qt = tl.load(QT + i)
    acc = tl.zeros([DV], dtype=tl.float32)
    hi = tl.minimum(p + 1, n)  # no key after the query, none past the sequence
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = offs_n < hi
        slot = tl.load(Slots + b * stride_sb + offs_n, mask=in_seq, other=0).to(tl.int64)
        k = tl.load(KP + slot[:, None] * stride_ks + h * stride_kh + offs_dq[None, :], mask=in_seq[:, None],
                    other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * alpha  # [BLOCK_N]
        ok = in_seq & ((offs_n < hist) | (offs_n == p))
        if HAS_POS:
            dist = tl.minimum(tl.maximum(tl.minimum(p, hist) - tl.minimum(offs_n, hist), 0), max_seq_len - 1)
            s += tl.load(PosW + dist, mask=in_seq, other=0.0).to(tl.float32)
        if HAS_TIME:
            kt = tl.load(SlotTimes + slot, mask=in_seq, other=0)
            dt = tl.maximum(qt - kt, 0).to(tl.float32)
            bucket = tl.minimum(tl.floor(2.0 * tl.log2(1.0 + dt)).to(tl.int32), num_buckets - 1)
            s += tl.load(TimeW + bucket, mask=in_seq, other=0.0).to(tl.float32)
        a = tl.where(ok, s * tl.sigmoid(s) * inv_n, 0.0)
        v = tl.load(VP + slot[:, None] * stride_vs + h * stride_vh + offs_dv[None, :], mask=in_seq[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None] * v, axis=0)
    tl.store(Out + i * stride_ot + h * stride_oh + offs_dv, acc.to(Out.dtype.element_ty))


def triton_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           seq: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor, hist: torch.Tensor, *,
                           max_seq_len: int, alpha: float, pos_weights: torch.Tensor | None,
                           time_weights: torch.Tensor | None, slot_times: torch.Tensor | None,
                           query_times: torch.Tensor | None) -> torch.Tensor:
    """q [Tq, H, Dqk]; k_pool [S, H, Dqk], v_pool [S, H, Dv] (any float dtype; fp32 math);
    slots [B, L] pool slot of each sequence's token; seq, index [Tq]; lengths, hist [B];
    slot_times [S]; query_times [Tq] -> [Tq, H, Dv] in q's dtype. Head dims: powers of two."""
    q = q.contiguous()
    tq, heads, dq = q.shape
    dv = v_pool.shape[2]
    out = torch.empty(tq, heads, dv, dtype=q.dtype, device=q.device)
    if tq == 0:
        return out
    has_time = time_weights is not None
    dummy = q.new_zeros(1)
    zeros = torch.zeros(1, dtype=torch.int64, device=q.device)
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    slots = slots.contiguous()
    _paged_fwd[(tq, heads)](
        q, k_pool, v_pool, slots, seq.contiguous(), index.contiguous(), lengths.contiguous(),
        hist.contiguous(), slot_times.contiguous() if has_time and slot_times is not None else zeros,
        query_times.contiguous() if has_time and query_times is not None else zeros,
        pos_weights.contiguous() if pos_weights is not None else dummy,
        time_weights.contiguous() if has_time else dummy, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        slots.stride(0), out.stride(0), out.stride(1),
        float(alpha), 1.0 / max_seq_len, max_seq_len, time_weights.numel() if has_time else 1,
        H=heads, DQ=dq, DV=dv, BLOCK_N=BLOCK_N, HAS_POS=pos_weights is not None, HAS_TIME=has_time)
    return out
