"""Triton kernels for jagged HSTU attention: forward, and backward as two kernels.

Same semantics as :func:`kernels.hstu_reference.hstu_attention_reference` (see its module
docstring), computed block by block without materialising the [B, H, L, L] scores:

* forward: one program per (query block, sequence x head); it walks the key blocks the
  mask can reach, adds the relative bias read from the position / time weight tables,
  applies SiLU / N and accumulates ``A @ V`` in fp32;
* backward dK/dV: one program per (key block, sequence x head) walking the query blocks
  that can see it; the bias tables' gradients are accumulated with atomic adds;
* backward dQ: one program per query block, walking its keys again (no atomics on dQ).

Inputs may be fp32, bf16 or fp16; products accumulate in fp32. Runs on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check it); compiled on CUDA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from genrec.kernels import flops


@triton.jit
def _bias_and_mask(s, offs_m, offs_n, n, hist, qt, TS, PosW, TimeW, seq_start, max_seq_len, num_buckets,
                   HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """Adds the relative bias to scores ``s`` [M, N]; returns (scores, allowed mask, dist, bucket)."""
    pi = tl.minimum(offs_m, hist)
    pj = tl.minimum(offs_n, hist)
    dist = tl.minimum(tl.maximum(pi[:, None] - pj[None, :], 0), max_seq_len - 1)
    valid = (offs_m[:, None] < n) & (offs_n[None, :] < n)
    if HAS_POS:
        s += tl.load(PosW + dist, mask=valid, other=0.0)
    bucket = dist  # placeholder when there is no time bias
    if HAS_TIME:
        ts = tl.load(TS + seq_start + offs_n, mask=offs_n < n, other=0)
        dt = tl.maximum(qt[:, None] - ts[None, :], 0).to(tl.float32)
        bucket = tl.minimum(tl.floor(2.0 * tl.log2(1.0 + dt)).to(tl.int32), num_buckets - 1)
        s += tl.load(TimeW + bucket, mask=valid, other=0.0)
    if HAS_TARGETS:
        is_hist = offs_m[:, None] < hist
        allowed = tl.where(is_hist, offs_n[None, :] <= offs_m[:, None],
                           (offs_n[None, :] < hist) | (offs_n[None, :] == offs_m[:, None]))
    else:
        allowed = offs_n[None, :] <= offs_m[:, None]
    return s, valid & allowed, dist, bucket


@triton.jit
def _hstu_fwd(Q, K, V, Out, Offsets, NumTargets, TS, QT, PosW, TimeW,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
              alpha, inv_n, max_seq_len, num_buckets,
              H: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
              UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start = tl.load(Offsets + b)
    n = (tl.load(Offsets + b + 1) - start).to(tl.int32)
    m0 = pid_m * BLOCK_M
    if m0 < n:
        hist = n
        if HAS_TARGETS:
            hist = n - tl.load(NumTargets + b).to(tl.int32)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_dq = tl.arange(0, DQ)
        offs_dv = tl.arange(0, DV)
        row_ok = offs_m < n
        q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_dq[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qt = offs_m.to(tl.int64)
        if HAS_TIME:
            qt = tl.load(QT + start + offs_m, mask=row_ok, other=0)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        hi = tl.minimum(n, m0 + BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            col_ok = offs_n < n
            k = tl.load(K + (start + offs_n)[:, None] * stride_kt + h * stride_kh + offs_dq[None, :],
                        mask=col_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            v = tl.load(V + (start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                        mask=col_ok[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * alpha
            s, ok, _, _ = _bias_and_mask(s, offs_m, offs_n, n, hist, qt, TS, PosW, TimeW, start, max_seq_len,
                                         num_buckets, HAS_POS, HAS_TIME, HAS_TARGETS)
            a = tl.where(ok, s * tl.sigmoid(s) * inv_n, 0.0)
            acc += tl.dot(a.to(v.dtype), v).to(tl.float32)
        tl.store(Out + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                 acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _hstu_bwd_dkdv(Q, K, V, DO, DK, DV_, Offsets, NumTargets, TS, QT, PosW, TimeW, DPosW, DTimeW,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   alpha, inv_n, max_seq_len, num_buckets,
                   H: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
              UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start = tl.load(Offsets + b)
    n = (tl.load(Offsets + b + 1) - start).to(tl.int32)
    n0 = pid_n * BLOCK_N
    if n0 < n:
        hist = n
        if HAS_TARGETS:
            hist = n - tl.load(NumTargets + b).to(tl.int32)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_dq = tl.arange(0, DQ)
        offs_dv = tl.arange(0, DV)
        col_ok = offs_n < n
        k = tl.load(K + (start + offs_n)[:, None] * stride_kt + h * stride_kh + offs_dq[None, :],
                    mask=col_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        v = tl.load(V + (start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                    mask=col_ok[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, DQ], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, DV], dtype=tl.float32)
        # every query that can see a key of this block has index >= n0
        m_start = (n0 // BLOCK_M) * BLOCK_M
        for m0 in range(m_start, n, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < n
            q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_dq[None, :],
                        mask=row_ok[:, None], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            dout = tl.load(DO + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                         mask=row_ok[:, None], other=0.0)
            if UPCAST:
                dout = dout.to(tl.float32)
            qt = offs_m.to(tl.int64)
            if HAS_TIME:
                qt = tl.load(QT + start + offs_m, mask=row_ok, other=0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * alpha
            s, ok, dist, bucket = _bias_and_mask(s, offs_m, offs_n, n, hist, qt, TS, PosW, TimeW, start,
                                                 max_seq_len, num_buckets, HAS_POS, HAS_TIME, HAS_TARGETS)
            sig = tl.sigmoid(s)
            a = tl.where(ok, s * sig * inv_n, 0.0)
            dv += tl.dot(tl.trans(a.to(dout.dtype)), dout).to(tl.float32)
            da = tl.dot(dout, tl.trans(v)).to(tl.float32)
            ds = tl.where(ok, da * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32) * alpha
            if HAS_POS:
                tl.atomic_add(DPosW + dist, ds, mask=ok)
            if HAS_TIME:
                tl.atomic_add(DTimeW + bucket, ds, mask=ok)
        tl.store(DK + (start + offs_n)[:, None] * stride_kt + h * stride_kh + offs_dq[None, :],
                 dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV_ + (start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                 dv.to(DV_.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _hstu_bwd_dq(Q, K, V, DO, DQ_, Offsets, NumTargets, TS, QT, PosW, TimeW,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 alpha, inv_n, max_seq_len, num_buckets,
                 H: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
              UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    start = tl.load(Offsets + b)
    n = (tl.load(Offsets + b + 1) - start).to(tl.int32)
    m0 = pid_m * BLOCK_M
    if m0 < n:
        hist = n
        if HAS_TARGETS:
            hist = n - tl.load(NumTargets + b).to(tl.int32)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_dq = tl.arange(0, DQ)
        offs_dv = tl.arange(0, DV)
        row_ok = offs_m < n
        q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_dq[None, :],
                    mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        dout = tl.load(DO + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                     mask=row_ok[:, None], other=0.0)
        if UPCAST:
            dout = dout.to(tl.float32)
        qt = offs_m.to(tl.int64)
        if HAS_TIME:
            qt = tl.load(QT + start + offs_m, mask=row_ok, other=0)
        dq = tl.zeros([BLOCK_M, DQ], dtype=tl.float32)
        hi = tl.minimum(n, m0 + BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            col_ok = offs_n < n
            k = tl.load(K + (start + offs_n)[:, None] * stride_kt + h * stride_kh + offs_dq[None, :],
                        mask=col_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            v = tl.load(V + (start + offs_n)[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
                        mask=col_ok[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * alpha
            s, ok, _, _ = _bias_and_mask(s, offs_m, offs_n, n, hist, qt, TS, PosW, TimeW, start, max_seq_len,
                                         num_buckets, HAS_POS, HAS_TIME, HAS_TARGETS)
            sig = tl.sigmoid(s)
            da = tl.dot(dout, tl.trans(v)).to(tl.float32)
            ds = tl.where(ok, da * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
            dq += tl.dot(ds.to(k.dtype), k).to(tl.float32) * alpha
        tl.store(DQ_ + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_dq[None, :],
                 dq.to(DQ_.dtype.element_ty), mask=row_ok[:, None])


def _blocks(d: int) -> tuple[int, int]:
    return (16, 16) if d > 64 else (32, 32)


class HSTUAttentionFunction(torch.autograd.Function):
    """Autograd wrapper; see :func:`triton_hstu_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, max_seq_len, alpha, pos_w, time_w, ts, qt, num_targets, max_len):  # noqa: ANN001, ANN205
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        t, h, dq_dim = q.shape
        dv_dim = v.shape[2]
        out = torch.empty_like(v)
        dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
        dummy_i = torch.zeros(1, dtype=torch.int64, device=q.device)
        args = (offsets, num_targets if num_targets is not None else dummy_i,
                ts if ts is not None else dummy_i, qt if qt is not None else dummy_i,
                pos_w if pos_w is not None else dummy, time_w if time_w is not None else dummy)
        # The Triton interpreter (CPU) computes bf16 dots wrongly; there tiles are upcast
        # to fp32 before tl.dot. Compiled kernels multiply in the input dtype.
        upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        flags = dict(HAS_TARGETS=num_targets is not None, HAS_POS=pos_w is not None, HAS_TIME=time_w is not None,
                     UPCAST=upcast)
        bm, bn = _blocks(max(dq_dim, dv_dim))
        b = offsets.numel() - 1
        nb = time_w.numel() if time_w is not None else 1
        grid = (triton.cdiv(max(max_len, 1), bm), b * h)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   out.stride(0), out.stride(1))
        if t and b:
            _hstu_fwd[grid](q, k, v, out, *args, *strides, alpha, 1.0 / max_seq_len, max_seq_len, nb,
                            H=h, DQ=dq_dim, DV=dv_dim, BLOCK_M=bm, BLOCK_N=bn, **flags)
        else:
            out.zero_()
        if flops.counting():
            flops.add(flops.causal_attention_flops(offsets, h, dq_dim, dv_dim))
        ctx.save_for_backward(q, k, v, offsets, *args[1:])
        ctx.cfg = (alpha, max_seq_len, max_len, nb, bm, bn, flags, strides)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, offsets, num_targets, ts, qt, pos_w, time_w = ctx.saved_tensors
        alpha, max_seq_len, max_len, nb, bm, bn, flags, strides = ctx.cfg
        dout = dout.contiguous()
        t, h, dq_dim = q.shape
        dv_dim = v.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dpos = torch.zeros_like(pos_w, dtype=torch.float32)
        dtime = torch.zeros_like(time_w, dtype=torch.float32)
        b = offsets.numel() - 1
        common = (offsets, num_targets, ts, qt, pos_w, time_w)
        consts = dict(H=h, DQ=dq_dim, DV=dv_dim, BLOCK_M=bm, BLOCK_N=bn, **flags)
        if t and b:
            grid = (triton.cdiv(max(max_len, 1), bn), b * h)
            _hstu_bwd_dkdv[grid](q, k, v, dout, dk, dv, *common, dpos, dtime, *strides, alpha, 1.0 / max_seq_len,
                                 max_seq_len, nb, **consts)
            grid = (triton.cdiv(max(max_len, 1), bm), b * h)
            _hstu_bwd_dq[grid](q, k, v, dout, dq, *common, *strides, alpha, 1.0 / max_seq_len, max_seq_len, nb,
                               **consts)
        if flops.counting():
            flops.add(flops.causal_attention_flops(offsets, h, dq_dim, dv_dim, backward=True))
        return (dq, dk, dv, None, None, None,
                dpos.to(pos_w.dtype) if flags["HAS_POS"] else None,
                dtime.to(time_w.dtype) if flags["HAS_TIME"] else None,
                None, None, None, None)


def triton_hstu_attention(
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
) -> torch.Tensor:
    """Jagged HSTU attention in Triton: q, k [T, H, Dqk], v [T, H, Dv] -> [T, H, Dv].

    Head dims must be powers of two >= 16 (``tl.dot`` tiles)."""
    for name, d in (("qk", q.shape[-1]), ("v", v.shape[-1])):
        if d < 16 or d & (d - 1):
            raise ValueError(f"triton HSTU attention needs a power-of-two {name} head dim >= 16, got {d}")
    if time_weights is not None and (timestamps is None or query_times is None):
        raise ValueError("time_weights needs timestamps and query_times")
    if max_len is None:
        max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return HSTUAttentionFunction.apply(
        q, k, v, offsets.contiguous(), max_seq_len, alpha, pos_weights, time_weights,
        timestamps.contiguous() if timestamps is not None else None,
        query_times.contiguous() if query_times is not None else None,
        num_targets.contiguous() if num_targets is not None else None, max_len)
