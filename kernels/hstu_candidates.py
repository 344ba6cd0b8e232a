"""HSTU candidates against cached histories as GEMM blocks (serving: many candidates, long histories).

What :func:`hstu_cached_attention` computes (the reference: ``hstu_cached_attention_reference``),
laid out for the ranking call of an ads pipeline, a few users with thousands of candidates
each over thousands of cached events. Every candidate of a user sits at the same position (the
first after the history) and is seen at the same request time, so its relative bias against
history event j does not depend on the candidate: one bias row [L] per user, shared by all of
its candidates and by the heads. A user's candidates then meet its history in two GEMMs per
block of candidates::

    S  = alpha Q_blk K^T + bias[None, :]     [cb, L]    (addmm: the bias row is its beta term)
    O += SiLU(S) V                           [cb, Dv]   (in place, no mask: no padding)

with the block ``cb`` sized so that S (``block_elems`` entries) stays in the core's L2 cache
instead of going to memory between the three passes. The history rows are read in place (a
user's rows are contiguous in the jagged cache: no gather, no padding to the batch's longest
history), and each candidate's own key (the pair (c, c)) is added in one pointwise pass.

``dtype``: what the two GEMMs and SiLU run in. ``None`` keeps the inputs' dtype (fp32: the
reference to float rounding); ``torch.bfloat16`` casts Q, K, V and the bias row once per call
and accumulates in fp32 inside the GEMM (oneDNN): on a CPU with AVX512-BF16 (AMD Zen 4, Intel
Cooper Lake and later) or AMX, bf16 GEMMs run about twice the fp32 rate. There the first GEMM
is oneDNN's linear with the bias (``torch.ops.mkldnn._linear_pointwise``, what torch.compile's
CPU backend emits; addmm where a build lacks it), and SiLU runs over its bf16 scores, still
in the core's L2, in our own pass (``kernels.bf16_ops``: good to bf16's rounding, at about
half the cost of oneDNN's SiLU epilogue, which is exact to float and the fallback where the
pass is not vectorised for the CPU). The candidates' own term and the 1 / N scale stay in the
inputs' dtype. oneDNN builds a kernel per GEMM shape, so the bf16 GEMMs see shapes rounded up to a few sizes (:func:`bucket`, zero
padding), not each call's own history length and candidate count.

Where the CPU has AVX512-BF16 and the heads' dims suit it (``bf16_ops.fused_candidates``: an
even key dim, a value dim of 16 to 128), bf16 runs none of the above: one native pass per user
and head (``bf16_ops.candidate_attention``, ``kernels/cpu/bf16_ops.cpp``) computes a block of
candidates' scores in registers, SiLU on their fp32 sums, the value GEMM from a small bf16
buffer in L1, the candidates' own term and the scale, so no score block goes to memory and no
Python runs per block (measured against the two GEMMs and the pass:
``benchmarks/notes/2026-12-06-fused-candidates.md``).

Inference only: under autograd the op falls back to the coded backend (its backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from genrec.kernels import bf16_ops
from genrec.kernels.bf16_ops import bucket
from genrec.kernels.bf16_ops import zero_padded as _zero_padded
from genrec.kernels.hstu_coded import AttentionPlan, bias_entries, hstu_cached_attention_coded
from genrec.kernels.hstu_reference import records_grad, time_bucket

_linear_pointwise = bf16_ops.linear_pointwise  # oneDNN's linear + pointwise op; None where absent

# entries of one candidates x keys score block: 2 MiB in bf16, the size of a Zen 4 core's L2 (measured:
# blocks of 128-512 candidates over 4,096 keys beat one [C, L] block by ~10%, fp32 and bf16)
BLOCK_ELEMS = 1 << 20
MIN_BLOCK = 16  # fewer candidates per GEMM than this and the call overhead dominates


@dataclass
class CandidateLayout:
    """What the layers of one call share (built by the first, kept in ``AttentionPlan.blocked``)."""

    key: tuple[int, int]  # (max_seq_len, num_buckets)
    order: torch.Tensor | None  # [C] candidates sorted by user (stable); None: sorted already
    users: list[tuple[int, int, int, int]]  # per user with candidates: (first cand, end cand, hist start, hist len)
    code: torch.Tensor  # [Th] bias code of every history row against its user's candidates


def candidate_layout(owner: torch.Tensor, hist_offsets: torch.Tensor, max_seq_len: int, nb: int,
                     hist_times: torch.Tensor | None, request_times: torch.Tensor | None,
                     key_positions: torch.Tensor | None = None,
                     query_positions: torch.Tensor | None = None) -> CandidateLayout:
    """Candidates grouped by user (``owner`` [C]) and the code (position distance * nb + time
    bucket, :func:`bias_table`'s index) of every history row of ``hist_offsets`` [B+1]. Row j of
    a history sits at position j and its candidates at its length, unless ``key_positions`` [Th]
    and ``query_positions`` [B] say otherwise (``kernels.hstu_bounded``'s block summaries)."""
    b = hist_offsets.numel() - 1
    lengths = hist_offsets[1:] - hist_offsets[:-1]
    sorted_ = bool((owner[1:] >= owner[:-1]).all()) if owner.numel() > 1 else True
    order = None if sorted_ else torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=b)
    ends = torch.cumsum(counts, 0)
    users = [(int(e - c), int(e), int(s), int(n))
             for c, e, s, n in zip(counts.tolist(), ends.tolist(), hist_offsets[:-1].tolist(), lengths.tolist()) if c]
    th = int(hist_offsets[-1])
    row_user = torch.repeat_interleave(torch.arange(b, device=owner.device), lengths, output_size=th)
    j = torch.arange(th, device=owner.device) - hist_offsets[:-1][row_user]  # index within its history
    if key_positions is not None and query_positions is not None:
        j, lengths = key_positions[:th], query_positions
    code = (lengths[row_user] - j).clamp_(0, max_seq_len - 1).mul_(nb)
    if hist_times is not None and request_times is not None:
        code = code + time_bucket(request_times[row_user] - hist_times[:th], nb)
    return CandidateLayout((max_seq_len, nb), order, users, code)


def _fused_silu(gemm: torch.dtype, q: torch.Tensor) -> bool:
    """Whether the bf16 scores go through oneDNN's linear with a SiLU epilogue (CPU builds with
    oneDNN): the bias broadcast, the scores' write and SiLU's pass over them in one op, ~15%
    of a bf16 block measured; fp32 keeps addmm (MKL, the reference to float rounding)."""
    return gemm == torch.bfloat16 and q.device.type == "cpu" and _linear_pointwise is not None


def _padded(gemm: torch.dtype, q: torch.Tensor) -> bool:
    """Whether the GEMMs' shapes are rounded up to :func:`bucket` sizes: bf16 / fp16 GEMMs on
    CPU are oneDNN's, which builds a kernel for every new shape (about 1 ms each, measured: a
    call's first layer paid 1.5 ms more than its second when candidates and history lengths
    changed from call to call, as they do in serving); fp32 GEMMs (MKL) have no such cost."""
    return gemm != torch.float32 and q.device.type == "cpu"


def block_rows(hist_len: int, block_elems: int = BLOCK_ELEMS) -> int:
    """Candidates per GEMM block over a history of ``hist_len`` keys (a multiple of 16)."""
    return max(MIN_BLOCK, (block_elems // max(hist_len, 1)) // MIN_BLOCK * MIN_BLOCK)


def hstu_cached_attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hist: torch.Tensor,
    v_hist: torch.Tensor,
    hist_offsets: torch.Tensor,
    owner: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    hist_times: torch.Tensor | None = None,
    request_times: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    dtype: torch.dtype | None = None,
    block_elems: int = BLOCK_ELEMS,
    key_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Candidates q, k, v [C, H, D] of users ``owner`` [C] against the users' cached keys and
    values k_hist, v_hist [Th, H, D] (``hist_offsets`` [B+1], ``hist_times`` [Th],
    ``request_times`` [B]) -> [C, H, Dv], as ``hstu_cached_attention_reference``. ``dtype``:
    the GEMMs' precision (module docstring); ``plan``: shared by the layers of one call;
    ``key_positions`` [Th], ``query_positions`` [B]: as in :func:`candidate_layout`.

    Example: one user, 2,000 candidates, 4,096 cached events, H 1, D 64: per layer 8 blocks of
    128 candidates, each two GEMMs [128, 64] x [64, 4096] and [128, 4096] x [4096, 64]."""
    kw = dict(max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights, time_weights=time_weights,
              hist_times=hist_times, request_times=request_times)
    if records_grad(q, k, v, k_hist, v_hist, pos_weights, time_weights):
        if key_positions is not None:
            raise ValueError("candidates against explicit key positions: inference only (no gradient)")
        return hstu_cached_attention_coded(q, k, v, k_hist, v_hist, hist_offsets, owner, plan=plan, **kw)
    c, h = q.shape[0], q.shape[1]
    if c == 0:
        return v.new_zeros(v.shape)
    use_time = time_weights is not None and hist_times is not None and request_times is not None
    nb = time_weights.numel() if use_time else 1
    layout = plan.blocked if plan is not None else None
    if layout is None or layout.key != (max_seq_len, nb):
        layout = candidate_layout(owner, hist_offsets, max_seq_len, nb, hist_times if use_time else None,
                                  request_times if use_time else None, key_positions, query_positions)
        if plan is not None:
            plan.blocked = layout
    tw = time_weights if use_time else None
    gemm = dtype or q.dtype
    fused = _fused_silu(gemm, q)
    if fused and all(t.dtype == torch.float32 for t in (q, k, v, k_hist, v_hist)) and bf16_ops.fused_candidates(
            q.shape[-1], v.shape[-1]):
        return _native(q, k, v, k_hist, v_hist, layout, alpha, pos_weights, tw, max_seq_len)
    fast = fused and bf16_ops.fast_silu()  # (our SiLU pass after the GEMM, else oneDNN's epilogue)
    qs = q if layout.order is None else q[layout.order]
    qg = (qs * alpha).to(gemm) if fused else qs.to(gemm)  # (no copy where the dtype is already)
    kg, vg = k_hist.to(gemm), v_hist.to(gemm)
    bias = bias_entries(pos_weights, tw, layout.code, max_seq_len, q.dtype).to(gemm)  # [Th]
    out = v.new_zeros(c, h, v.shape[-1])
    pad = _padded(gemm, q)
    for c0, c1, s, n in layout.users:
        if n == 0:  # an empty history: the candidate sees itself only
            continue
        rows = block_rows(n, block_elems)
        for hd in range(h):
            kh, vh, bh = kg[s : s + n, hd], vg[s : s + n, hd], bias[s : s + n]  # [n, D], [n, Dv], [n]: views
            if pad:  # keys to a bucket's length: zero keys, values and bias, so SiLU(0) * 0 adds nothing
                kh, vh, bh = (_zero_padded(t, bucket(n)) for t in (kh, vh, bh))
            if fused:
                kh = kh.contiguous()
            for b0 in range(c0, c1, rows):
                b1 = min(b0 + rows, c1)
                qb = _zero_padded(qg[b0:b1, hd], bucket(b1 - b0)) if pad else qg[b0:b1, hd]
                if fused and fast:  # q k^T + bias, then SiLU over the bf16 block
                    attn = bf16_ops.silu_(_linear_pointwise(qb.contiguous(), kh, bh, "none", [], ""))
                elif fused:  # SiLU(q k^T + bias) in the GEMM's epilogue, on its fp32 accumulators
                    attn = _linear_pointwise(qb.contiguous(), kh, bh, "swish", [], "")
                else:
                    attn = F.silu(torch.addmm(bh[None], qb, kh.T, alpha=alpha), inplace=True)
                out[b0:b1, hd] = torch.mm(attn, vh)[: b1 - b0]  # [cb, Dv]
    if layout.order is not None:
        out = torch.empty_like(out).index_copy_(0, layout.order, out)
    zero = bias_entries(pos_weights, tw, layout.code.new_zeros(1), max_seq_len, q.dtype)  # distance 0, time gap 0
    self_score = (q * k).sum(-1).mul_(alpha).add_(zero)  # [C, H]
    return out.add_(F.silu(self_score)[..., None] * v).div_(max_seq_len)


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor,
            layout: CandidateLayout, alpha: float, pos_weights: torch.Tensor | None, tw: torch.Tensor | None,
            max_seq_len: int) -> torch.Tensor:
    """:func:`hstu_cached_attention_blocked` in bf16 as one native pass per user and head
    (``bf16_ops.candidate_attention``): the scores, SiLU, the value GEMM, the candidates' own
    term and the 1 / N scale, no score block in memory and no Python per block."""
    c, h = q.shape[0], q.shape[1]
    qs, ks, vs = (t if layout.order is None else t[layout.order] for t in (q, k, v))
    k_hist, v_hist = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_hist, v_hist))
    bias = bias_entries(pos_weights, tw, layout.code, max_seq_len, torch.float32).contiguous()  # [Th]
    own = float(bias_entries(pos_weights, tw, layout.code.new_zeros(1), max_seq_len, torch.float32))  # distance 0
    out = torch.empty(c, h, v.shape[-1])
    for c0, c1, s, n in layout.users:
        for hd in range(h):
            bf16_ops.candidate_attention(qs[c0:c1, hd], k_hist[s : s + n, hd], v_hist[s : s + n, hd], bias[s : s + n],
                                         ks[c0:c1, hd], vs[c0:c1, hd], alpha, own, 1.0 / max_seq_len, out[c0:c1, hd])
    return out if layout.order is None else torch.empty_like(out).index_copy_(0, layout.order, out)
