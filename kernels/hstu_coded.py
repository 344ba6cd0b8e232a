"""HSTU attention, the coded PyTorch backend: what training and serving run wherever the
Triton kernels do not (a compiled tower included).

The mask and both relative biases become one int32 code per (query, key) pair into a flat
table (:func:`bias_table`, :func:`bias_codes`), computed once per batch and shared by the
layers through an :class:`AttentionPlan`; a layer then does one table gather, a fused
``alpha q k^T + bias``, SiLU and the value GEMM. Semantics: ``kernels.hstu_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from genrec.kernels.hstu_reference import (
    attention_mask,
    batch_lengths,
    lookup,
    padded_relative_times,
    query_blocks,
    records_grad,
    time_bucket,
    token_positions,
)
from genrec.kernels.jagged import jagged_index, jagged_to_padded, padded_to_jagged


@dataclass
class CodedBlocks:
    """:func:`hstu_attention_coded`'s per-batch layout: the jagged index and each query
    block's bias codes."""

    key: tuple[int, int, int, bool]  # (max_len, max_seq_len, num_buckets, time bias) it was built for
    index: tuple[torch.Tensor, torch.Tensor]  # (sequence, position) of every jagged row [T]
    blocks: list[tuple[tuple[int, int], torch.Tensor]] = field(default_factory=list)  # ((s, e), codes [B, e-s, e])
    flat: tuple[torch.Tensor, torch.Tensor] | None = None  # end_to_end(), once built

    def end_to_end(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' codes end to end, and per block (s, e, offset into them) [blocks, 3]
        int64: kernels.hstu_train's view of the same codes, built once (the layers share it)."""
        if self.flat is None:
            meta, at = [], 0
            for (s, e), c in self.blocks:
                meta.append((s, e, at))
                at += c.numel()
            self.flat = (torch.cat([c.reshape(-1) for _, c in self.blocks]), torch.tensor(meta, dtype=torch.int64))
        return self.flat


@dataclass
class AttentionPlan:
    """What the layers of one tower call share for one batch, built by the first layer that
    needs it: the jagged pass's bias codes, or the candidates' grouping by user."""

    coded: CodedBlocks | None = None
    groups: GroupLayout | None = None
    blocked: Any = None  # hstu_candidates.CandidateLayout (that module imports this one)


def coded_blocks(offsets: torch.Tensor, rows: int, lengths: torch.Tensor, max_len: int, max_seq_len: int,
                 time_weights: torch.Tensor | None, timestamps: torch.Tensor | None,
                 query_times: torch.Tensor | None, num_targets: torch.Tensor | None,
                 plan: AttentionPlan | None) -> CodedBlocks:
    """The batch's bias codes by query block (:func:`bias_codes`), from ``plan`` when its first
    layer built them already (``rows``: the batch's jagged rows)."""
    use_time = time_weights is not None and timestamps is not None and query_times is not None
    nb = time_weights.numel() if use_time else 1
    key = (max_len, max_seq_len, nb, use_time)
    coded = plan.coded if plan is not None else None
    if coded is None or coded.key != key:
        index = jagged_index(offsets, rows)
        times = padded_relative_times(query_times, timestamps, offsets, max_len, index) if use_time else None
        coded = CodedBlocks(key, index, [(r, bias_codes(lengths, max_len, max_seq_len, nb, times, num_targets, r))
                                         for r in query_blocks(max_len)])
        if plan is not None:
            plan.coded = coded
    return coded


def bias_table(pos_weights: torch.Tensor | None, time_weights: torch.Tensor | None, max_seq_len: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The position and time biases as one flat table, for :func:`bias_codes`:
    ``table[d * nb + b] = pos_weights[d] + time_weights[b]`` (a missing term reads 0) and a
    last slot, for masked pairs, so negative that SiLU of it is exactly 0."""
    pos = pos_weights if pos_weights is not None else torch.zeros(max_seq_len)
    tw = time_weights if time_weights is not None else torch.zeros(1, device=pos.device)
    pos, tw = pos.to(device=tw.device, dtype=dtype), tw.to(dtype)
    masked = torch.full((1,), torch.finfo(dtype).min / 2, dtype=dtype, device=tw.device)
    return torch.cat([(pos[:, None] + tw[None, :]).reshape(-1), masked])


def bias_entries(pos_weights: torch.Tensor | None, time_weights: torch.Tensor | None, code: torch.Tensor,
                 max_seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``bias_table(...)[code]`` without the table: each code's position and time terms read
    from the weights themselves, in the same dtype (the same values, bit for bit). The table
    has ``max_seq_len x num_buckets`` entries (524,288 at 8,192 x 64): where a call reads a few
    hundred of them (serving's candidates over a cached history), building it cost more than
    the call's GEMMs."""
    nb = time_weights.numel() if time_weights is not None else 1
    masked = code >= max_seq_len * nb
    flat = code.reshape(-1).clamp(max=max_seq_len * nb - 1).long()
    out = torch.zeros(flat.shape, dtype=dtype, device=code.device)
    if pos_weights is not None:
        out += pos_weights.to(dtype).index_select(0, torch.div(flat, nb, rounding_mode="floor"))
    if time_weights is not None:
        out += time_weights.to(dtype).index_select(0, flat % nb)
    return out.view(code.shape).masked_fill_(masked, torch.finfo(dtype).min / 2)


def bias_codes(lengths: torch.Tensor, max_len: int, max_seq_len: int, num_buckets: int,
               times: tuple[torch.Tensor, torch.Tensor] | None, num_targets: torch.Tensor | None,
               rows: tuple[int, int]) -> torch.Tensor:
    """[B, e - s, e] int32 index of every (query, key) pair into :func:`bias_table`:
    position distance * num_buckets + time bucket, or the masked slot where the mask
    (:func:`attention_mask`) forbids the pair. Shared by every layer of a tower."""
    s, e = rows
    p = token_positions(max_len, lengths, num_targets).to(torch.int32)
    code = (p[:, s:e, None] - p[:, None, :e]).clamp_(0, max_seq_len - 1).mul_(num_buckets)
    if times is not None:
        tq, tk = times
        code = code + time_bucket(tq[:, s:e, None] - tk[:, None, :e], num_buckets)
    mask = attention_mask(lengths, max_len, num_targets, rows=rows)
    return torch.where(mask, code, max_seq_len * num_buckets)


def silu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, alpha: float) -> torch.Tensor:
    """SiLU(alpha q k^T + bias) v, not yet divided by N, without autograd: q [B, H, r, D],
    k, v [B, H, L, D], bias [B, r or 1, L] (masked pairs at :func:`bias_table`'s masked
    slot) -> [B, H, r, Dv]. One head: a fused ``baddbmm``."""
    return torch.matmul(F.silu(_scores(q, k, bias, alpha), inplace=True), v)


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha q k^T + bias [B, H, r, L] (bias [B, r or 1, L], shared by the heads); one head: a fused ``baddbmm``."""
    if q.shape[1] == 1:
        return torch.baddbmm(bias, q[:, 0], k[:, 0].transpose(-1, -2), alpha=alpha)[:, None]
    return torch.matmul(q, k.transpose(-1, -2)).mul_(alpha).add_(bias[:, None])


class _CodedAttention(torch.autograd.Function):
    """The padded core of :func:`hstu_attention_coded` under autograd, with a hand-written
    backward: SiLU(alpha q k^T + table[code]) v per query block, q, k, v [B, H, L, D]
    padded, ``blocks`` [((s, e), code [B, e - s, e])]. Autograd over the same ops would
    zero a full-size gradient for every block's k / v slice and keep the block outputs'
    concatenation; here each block's gradients go straight into q, k, v's and the
    table's (summed over heads: a pair's bias is shared by the heads). Saves each block's
    pre-activation scores; SiLU is recomputed from them."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,  # noqa: ANN001
                blocks: list, alpha: float) -> torch.Tensor:
        scores, outs = [], []
        for (s, e), code in blocks:
            sc = _scores(q[:, :, s:e], k[:, :, :e], lookup(table, code), alpha)  # [B, H, r, e], kept for backward
            scores.append(sc)
            outs.append(torch.matmul(F.silu(sc), v[:, :, :e]))
        ctx.save_for_backward(q, k, v, *scores)
        ctx.blocks, ctx.alpha, ctx.table_shape, ctx.table_dtype = blocks, alpha, table.shape, table.dtype
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # noqa: ANN205
        q, k, v, *scores = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        need_table = ctx.needs_input_grad[3]
        # the table's gradient sums a value per (query, key) pair: accumulated in fp32 at least (bf16 would drop most
        # of them), in the table's own precision when wider (fp64 tables: fp32 sums read ~2e-7 off)
        acc = torch.promote_types(torch.float32, ctx.table_dtype)
        dtable = torch.zeros(ctx.table_shape, dtype=acc, device=dout.device) if need_table else None
        for ((s, e), code), sc in zip(ctx.blocks, scores):
            do = dout[:, :, s:e]
            dv[:, :, :e] += torch.matmul(F.silu(sc).transpose(-1, -2), do)
            ds = torch.ops.aten.silu_backward(torch.matmul(do, v[:, :, :e].transpose(-1, -2)), sc)  # [B, H, r, e]
            if need_table:  # (one head: its scores' gradient as it is, no pass summing over heads)
                per_pair = ds[:, 0] if ds.shape[1] == 1 else ds.sum(1)
                dtable.index_add_(0, code.reshape(-1), per_pair.reshape(-1).to(acc))
            ds.mul_(ctx.alpha)
            dq[:, :, s:e] = torch.matmul(ds, k[:, :, :e])
            dk[:, :, :e] += torch.matmul(ds.transpose(-1, -2), q[:, :, s:e])
        return dq, dk, dv, None if dtable is None else dtable.to(ctx.table_dtype), None, None


def hstu_attention_coded(
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
    """:func:`hstu_attention_reference` in fewer passes (what training and serving run
    wherever the Triton kernels do not, a compiled tower included): the mask and both relative biases become one int32 code per
    (query, key) pair, computed once per batch and shared by every layer through ``plan``
    (an :class:`AttentionPlan` the caller keeps for the batch); a layer then does one table gather, a fused
    ``scores = bias + alpha * q k^T`` (baddbmm), SiLU and the value GEMM, and scales by
    1 / N once on the output, going through the queries in :func:`query_blocks` (block
    s..e meets keys 0..e-1 only, so most of the causal upper triangle is skipped).
    Differentiable (:class:`_CodedAttention`): gradients reach q, k, v and both bias tables."""
    lengths, max_len = batch_lengths(offsets, max_len)
    if q.shape[0] == 0 or max_len == 0:
        return v.new_zeros(v.shape)
    coded = coded_blocks(offsets, q.shape[0], lengths, max_len, max_seq_len, time_weights, timestamps, query_times,
                         num_targets, plan)
    use_time = coded.key[3]
    index, blocks = coded.index, coded.blocks
    table = bias_table(pos_weights, time_weights if use_time else None, max_seq_len, q.dtype)
    qkv = jagged_to_padded(torch.cat([q, k, v], dim=-1), offsets, max_len, index=index)  # [B, L, H, 2Dqk + Dv]
    dqk = q.shape[-1]
    qp, kp, vp = (t.transpose(1, 2) for t in qkv.split([dqk, dqk, v.shape[-1]], dim=-1))  # [B, H, L, D]
    if records_grad(q, k, v, pos_weights, time_weights):
        out = _CodedAttention.apply(qp, kp, vp, table, blocks, alpha).transpose(1, 2)  # [B, L, H, Dv]
        return padded_to_jagged(out, offsets, index=index) / max_seq_len
    outs = [silu_attention(qp[:, :, s:e], kp[:, :, :e], vp[:, :, :e], lookup(table, code), alpha)
            for (s, e), code in blocks]  # [B, H, r, Dv] each
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2)  # [B, L, H, Dv]
    return padded_to_jagged(out, offsets, index=index).div_(max_seq_len)


def hstu_cached_attention_coded(
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
) -> torch.Tensor:
    """Candidates attending to a cached history: what :func:`hstu_attention` computes for
    the ``num_targets`` rows, without recomputing the history (M-FALCON-style serving).

    q, k, v [C, H, D] for C candidates; k_hist, v_hist [Th, H, D] the history keys/values
    of B users (``hist_offsets`` [B+1]); ``owner`` [C] each candidate's user;
    ``request_times`` [B] the time each user's candidates are scored at. A candidate sits
    at position h (its user's history length) and sees history j < h and itself.
    ``plan``: what the layers of one tower share for one set of candidates (the grouping
    by user, the history rows and the bias codes are computed by the first layer).
    """
    lengths = hist_offsets[1:] - hist_offsets[:-1]
    return _grouped_attention(q, k, v, k_hist, v_hist, hist_offsets[:-1], lengths, owner, max_seq_len=max_seq_len,
                              alpha=alpha, pos_weights=pos_weights, time_weights=time_weights, hist_times=hist_times,
                              request_times=request_times, plan=plan)


def hstu_last_row_attention_coded(
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
) -> torch.Tensor:
    """The rows of :func:`hstu_attention_coded` (no targets) at each sequence's last token only:
    [B, H, Dv] from q, k, v [T, H, D]. What the last layer of a tower needs when only the
    final position's output is read (a user vector): one query row per sequence instead of
    the whole causal [L, L] block."""
    lengths = offsets[1:] - offsets[:-1]
    if (lengths < 1).any():
        raise ValueError("hstu_last_row_attention: every sequence needs at least one token")
    last = offsets[1:] - 1
    use_time = time_weights is not None and timestamps is not None and query_times is not None
    return _grouped_attention(
        q[last], k[last], v[last], k, v, offsets[:-1], lengths - 1, torch.arange(lengths.numel(), device=q.device),
        max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights, time_weights=time_weights,
        hist_times=timestamps, request_times=query_times[last] if use_time else None,
        self_times=timestamps[last] if use_time else None)


def _grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hist: torch.Tensor,
    v_hist: torch.Tensor,
    hist_starts: torch.Tensor,
    hist_lengths: torch.Tensor,
    owner: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None,
    time_weights: torch.Tensor | None,
    hist_times: torch.Tensor | None,
    request_times: torch.Tensor | None,
    self_times: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Query rows q [C, H, D] of users ``owner`` [C], each at position ``hist_lengths[user]``
    and time ``request_times[user]``, against that user's history rows
    ``hist_starts[user] + 0 .. hist_lengths[user] - 1`` of k_hist / v_hist, and themselves
    (k, v [C, H, D]; time gap to itself ``request_time - self_times`` when given, else 0).
    ``plan``: as in :func:`hstu_cached_attention_coded`."""
    c, h = q.shape[0], q.shape[1]
    if c == 0:
        return v.new_zeros(v.shape)
    use_time = time_weights is not None and hist_times is not None and request_times is not None
    nb = time_weights.numel() if use_time else 1
    layout = plan.groups if plan is not None else None
    if layout is None or layout.key != (max_seq_len, nb):
        layout = _group_layout(owner, hist_starts, hist_lengths, k_hist.shape[0], max_seq_len, nb,
                               hist_times if use_time else None, request_times if use_time else None, self_times)
        if plan is not None:
            plan.groups = layout
    b, n, cmax = layout.code.shape[0], layout.code.shape[1], layout.cmax
    if layout.slot is None:  # grouped already
        qp = q.view(b, cmax, *q.shape[1:])
    else:
        qp = q.new_zeros(b, cmax, *q.shape[1:])
        qp[layout.owner, layout.slot] = q
    # history keys/values per user slot [B, L, H, D] (an empty history: zeros)
    kp, vp = (t[layout.rows] if layout.rows is not None else t.new_zeros(b, n, *t.shape[1:]) for t in (k_hist, v_hist))
    table = bias_table(pos_weights, time_weights if use_time else None, max_seq_len, q.dtype)
    bias = lookup(table, layout.code)  # [B, L]: every candidate of a user has the same position and time
    inplace = not torch.is_grad_enabled()
    if h == 1:
        scores = torch.baddbmm(bias[:, None, :], qp[:, :, 0], kp[:, :, 0].transpose(1, 2), alpha=alpha)
        out = torch.bmm(F.silu(scores, inplace=inplace), vp[:, :, 0])[:, :, None]  # [B, Cmax, 1, Dv]
    else:
        scores = torch.einsum("bchd,blhd->bhcl", qp, kp) * alpha + bias[:, None, None, :]  # [B, H, Cmax, L]
        out = torch.einsum("bhcl,blhd->bchd", F.silu(scores, inplace=inplace), vp)
    out = out.reshape(c, h, -1) if layout.slot is None else out[layout.owner, layout.slot]  # [C, H, Dv]
    self_score = (q * k).sum(-1) * alpha  # [C, H]; distance to itself 0
    # a candidate is seen at the request time (time gap 0, table slot 0) unless self_times say otherwise
    self_score = self_score + (table[0] if layout.self_code is None else lookup(table, layout.self_code)[:, None])
    return (out + F.silu(self_score)[..., None] * v) / max_seq_len


@dataclass
class GroupLayout:
    """What :func:`_grouped_attention` needs that does not depend on the layer."""

    key: tuple[int, int]  # (max_seq_len, num_buckets) it was built for
    owner: torch.Tensor  # [C] each candidate's user slot 0..B-1
    slot: torch.Tensor | None  # [C] its column in the [B, Cmax] grid; None: already grouped (a view)
    cmax: int  # most candidates of one user
    rows: torch.Tensor | None  # [B, L] history row of each user slot; None: no history rows at all
    code: torch.Tensor  # [B, L] bias code per (user, history slot), masked slots folded in
    self_code: torch.Tensor | None  # [C] each candidate's code against itself (with self_times)


def _group_layout(owner: torch.Tensor, hist_starts: torch.Tensor, hist_lengths: torch.Tensor, hist_rows: int,
                  max_seq_len: int, nb: int, hist_times: torch.Tensor | None, request_times: torch.Tensor | None,
                  self_times: torch.Tensor | None) -> GroupLayout:
    """Candidates grouped by user into [B, Cmax] slots, each user's history rows [B, L],
    and the bias code per (user, history slot) with the mask folded in as
    :func:`bias_table`'s masked slot (and each candidate's code against itself, when
    ``self_times`` are given)."""
    # only the users that own candidates here (a micro-batch may span a few of the batch's users)
    users, owner = torch.unique(owner, return_inverse=True)
    lengths = hist_lengths[users]
    b, c = users.numel(), owner.numel()
    n = max(int(lengths.max()), 1)
    j = torch.arange(n, device=owner.device)
    valid = j[None, :] < lengths[:, None]  # [B, L]
    rows = torch.where(valid, hist_starts[users][:, None] + j[None, :], 0) if hist_rows else None
    # Each user's candidates meet that user's keys and values in one GEMM (no per-candidate
    # copy of the history). Requests send them grouped already (same count per user, in
    # user order): then the [B, Cmax] view needs no scatter.
    counts = torch.bincount(owner, minlength=b)
    cmax = int(counts.max())
    slot = None
    if not (cmax * b == c and bool((owner[1:] >= owner[:-1]).all())):
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(owner, stable=True)
        slot = torch.empty_like(owner)
        slot[order] = torch.arange(c, device=owner.device) - starts[owner[order]]
    code = (lengths[:, None] - j[None, :]).clamp_(0, max_seq_len - 1).mul_(nb)
    self_code = None
    if hist_times is not None and request_times is not None:
        ht = hist_times[rows] if rows is not None else hist_times.new_zeros(b, n)
        code = code + time_bucket(request_times[users][:, None] - ht, nb)
        if self_times is not None:
            self_code = time_bucket(request_times[users][owner] - self_times, nb)
    return GroupLayout((max_seq_len, nb), owner, slot, cmax, rows, torch.where(valid, code, max_seq_len * nb), self_code)
