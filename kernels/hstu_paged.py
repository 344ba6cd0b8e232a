"""HSTU attention for new tokens over keys and values that already sit in a cache.

The op behind incremental encoding (a user's history grows by a few events; a serving
engine keeps the earlier events' keys and values): queries are only the *new* tokens, keys
and values are each sequence's whole cache (the earlier tokens and the new ones, written
there before the call), laid out per sequence ``[B, L, H, D]``; or, with
:func:`hstu_paged_attention_pool`, read in place from a paged pool ``[S, H, D]`` through a slot
map (SGLang's KV pool and its request-to-token map: Triton on CUDA, key blocks on CPU).

Query ``i`` is token ``index[i]`` of sequence ``seq[i]``. It sees key ``j`` of its sequence
when ``j <= index[i]`` and, where the sequence has candidates after its first
``hist_lengths[b]`` tokens, ``j < hist_lengths[b]`` or ``j == index[i]``: the masks, the
relative position bias (positions ``min(j, hist_lengths[b])``: candidates share the first
position after the history) and the time bias (``query_times[i] - key_times[b, j]``) of the
jagged op (``kernels.hstu_reference``), so appending tokens here gives what one full pass
over the whole sequence gives them. ``tests/test_hstu_paged.py`` checks that.

Shapes: q [Tq, H, Dqk]; k [B, L, H, Dqk]; v [B, L, H, Dv]; seq, index [Tq] int64;
lengths [B] (valid keys per sequence, at least ``index + 1`` of each of its queries);
key_times [B, L]; query_times [Tq]. Output [Tq, H, Dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genrec.kernels.hstu_reference import QUERY_BLOCK, lookup, time_bucket

KEY_BLOCK = 2048  # "blocked": pool slots read per step (bounds the [B', n, H, D] block in memory)


def hstu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: torch.Tensor,
    index: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    key_times: torch.Tensor | None = None,
    query_times: torch.Tensor | None = None,
    hist_lengths: torch.Tensor | None = None,
    query_block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """New tokens' attention over their sequences' cached keys and values (module docstring).

    Example: B=2 users, one with 5 cached tokens and 1 new, one with 3 cached and 2 new:
    ``k`` is [2, 6, H, D] (the second sequence's 6th slot unused, ``lengths`` = [6, 5]),
    ``seq`` = [0, 1, 1], ``index`` = [5, 3, 4].
    """
    tq, b = q.shape[0], k.shape[0]
    out = v.new_zeros(tq, v.shape[2], v.shape[3])
    if tq == 0:
        return out
    if time_weights is not None and (key_times is None or query_times is None):
        raise ValueError("time_weights needs key_times and query_times")
    # the queries laid out per sequence: [B, Qmax] slots, rank r of each query in its sequence
    order = torch.argsort(seq, stable=True)
    counts = torch.bincount(seq, minlength=b)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(seq)
    rank[order] = torch.arange(tq, device=seq.device) - starts[seq[order]]
    qmax = int(counts.max())
    qidx = torch.full((b, qmax), -1, dtype=torch.int64, device=q.device)  # each slot's query row, -1: none
    qidx[seq, rank] = torch.arange(tq, device=q.device)
    hist = hist_lengths if hist_lengths is not None else lengths
    for s in range(0, qmax, query_block):
        e = min(s + query_block, qmax)
        act = torch.nonzero(counts > s).flatten()  # sequences with queries in this block
        rows = qidx[act, s:e]  # [b', e - s]
        real = rows >= 0
        r = rows.clamp(min=0)
        pos_q = torch.where(real, index[r], -1)  # [b', e - s] token index of each query (-1: none)
        keys = int(pos_q.max()) + 1  # no query of the block sees a later key
        every = act.numel() == b  # (then views, not copies, of the keys and values)
        kk = (k[:, :keys] if every else k[act, :keys]).transpose(1, 2)  # [b', H, L', D]
        vv = (v[:, :keys] if every else v[act, :keys]).transpose(1, 2)
        qq = q[r].transpose(1, 2)  # [b', H, e - s, D]
        scores = torch.matmul(qq, kk.transpose(-1, -2)) * alpha  # [b', H, e - s, L']
        j = torch.arange(keys, device=q.device)
        h = hist[act][:, None, None]
        qi = pos_q[:, :, None]
        mask = (j[None, None] <= qi) & ((j[None, None] < h) | (j[None, None] == qi))
        mask &= j[None, None] < lengths[act][:, None, None]
        bias = None
        if pos_weights is not None:
            dist = (torch.minimum(qi, h) - torch.minimum(j[None, None], h)).clamp_(0, max_seq_len - 1)
            bias = lookup(pos_weights, dist.to(torch.int32))
        if time_weights is not None:
            dt = query_times[r][:, :, None] - key_times[act, None, :keys]
            tb = lookup(time_weights, time_bucket(dt, time_weights.numel()))
            bias = tb if bias is None else bias + tb
        if bias is not None:
            scores = scores + bias[:, None].to(scores.dtype)
        attn = F.silu(scores) * (mask[:, None].to(scores.dtype) / max_seq_len)
        res = torch.matmul(attn, vv).transpose(1, 2)  # [b', e - s, H, Dv]
        out[rows[real]] = res[real]
    return out


def hstu_paged_attention_pool(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    seq: torch.Tensor,
    index: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    slot_times: torch.Tensor | None = None,
    query_times: torch.Tensor | None = None,
    hist_lengths: torch.Tensor | None = None,
    backend: str = "auto",
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """:func:`hstu_paged_attention` with the keys and values read in place from a paged pool.

    k_pool [S, H, Dqk], v_pool [S, H, Dv]: every slot's keys / values (SGLang's per-layer pool
    buffers); slots [B, L] int: the pool slot of each sequence's token j (SGLang's
    ``req_to_token`` rows); slot_times [S]: each slot's event time (the time bias's key times).
    Other arguments and the output [Tq, H, Dv] as :func:`hstu_paged_attention`.

    ``backend``: "triton" reads the pool through ``slots`` block by block (no per-sequence copy;
    ``kernels.hstu_paged_triton``); "blocked" (PyTorch) reads it through ``slots`` one key block
    of ``key_block`` slots at a time (at most [B', key_block, H, D] of it in memory, never a
    per-sequence copy of the whole history); "torch" gathers ``[B, L, H, D]`` copies and runs
    the reference; "auto": Triton on CUDA, "blocked" elsewhere.
    """
    if time_weights is not None and (slot_times is None or query_times is None):
        raise ValueError("time_weights needs slot_times and query_times")
    if backend not in ("auto", "torch", "blocked", "triton"):
        raise ValueError(f"backend {backend!r}: choose auto, torch, blocked or triton")
    hist = hist_lengths if hist_lengths is not None else lengths
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from genrec.kernels.hstu_paged_triton import triton_paged_attention

        return triton_paged_attention(q, k_pool, v_pool, slots, seq, index, lengths, hist, max_seq_len=max_seq_len,
                                      alpha=alpha, pos_weights=pos_weights, time_weights=time_weights,
                                      slot_times=slot_times, query_times=query_times)
    if backend in ("auto", "blocked"):
        return _blocked(q, k_pool, v_pool, slots, seq, index, lengths, hist, max_seq_len=max_seq_len, alpha=alpha,
                        pos_weights=pos_weights, time_weights=time_weights, slot_times=slot_times,
                        query_times=query_times, key_block=key_block)
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = slots[:, :longest].to(torch.int64)
    key_times = slot_times[rows] if time_weights is not None and slot_times is not None else None
    return hstu_paged_attention(q, k_pool[rows].to(q.dtype), v_pool[rows].to(q.dtype), seq, index, lengths,
                                max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights,
                                time_weights=time_weights, key_times=key_times, query_times=query_times,
                                hist_lengths=hist_lengths)


def _blocked(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor,
             index: torch.Tensor, lengths: torch.Tensor, hist: torch.Tensor, *, max_seq_len: int, alpha: float,
             pos_weights: torch.Tensor | None, time_weights: torch.Tensor | None, slot_times: torch.Tensor | None,
             query_times: torch.Tensor | None, key_block: int) -> torch.Tensor:
    """The pool read in place, key block by key block (``hstu_paged_attention_pool``, "blocked").

    HSTU's attention is pointwise (SiLU, no softmax), so each key block's contribution is summed
    into the output independently. Per block only the slots it reads are gathered
    (``index_select`` of ``[B', key_block]`` slots), so the memory read per layer is the keys the
    queries see once, without a whole-history copy. Queries are laid out per sequence [B, Qmax]
    (serving appends a few tokens, or scores some candidates, per sequence)."""
    tq, b = q.shape[0], slots.shape[0]
    heads, dv = v_pool.shape[1], v_pool.shape[2]
    out = torch.zeros(tq, heads, dv, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
    if tq == 0:
        return out.to(q.dtype)
    order = torch.argsort(seq, stable=True)
    counts = torch.bincount(seq, minlength=b)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(seq)
    rank[order] = torch.arange(tq, device=seq.device) - starts[seq[order]]
    qmax = int(counts.max())
    qidx = torch.full((b, qmax), -1, dtype=torch.int64, device=q.device)
    qidx[seq, rank] = torch.arange(tq, device=q.device)
    real = qidx >= 0
    r = qidx.clamp(min=0)
    pos_q = torch.where(real, index[r], -1)  # [B, Qmax]
    ends = torch.minimum(pos_q.max(1).values + 1, lengths)  # [B] keys each sequence's queries see
    qq = q[r].transpose(1, 2).to(out.dtype)  # [B, H, Qmax, D]
    qi, h = pos_q[:, :, None], hist[:, None, None]
    qt = query_times[r][:, :, None] if time_weights is not None and query_times is not None else None
    acc = out.new_zeros(b, heads, qmax, dv)
    scale = 1.0 / max_seq_len
    for j0 in range(0, int(ends.max()), key_block):
        act = torch.nonzero(ends > j0).flatten()  # sequences with keys in this block
        every = act.numel() == b
        j1 = min(j0 + key_block, int(ends[act].max()))
        rows = slots[act, j0:j1].to(torch.int64)  # [b', n] the block's pool slots
        flat = rows.reshape(-1)
        n = j1 - j0
        kk = k_pool.index_select(0, flat).view(act.numel(), n, heads, -1).to(out.dtype).transpose(1, 2)
        vv = v_pool.index_select(0, flat).view(act.numel(), n, heads, dv).to(out.dtype).transpose(1, 2)
        qa = qq if every else qq[act]
        scores = torch.matmul(qa, kk.transpose(-1, -2)) * alpha  # [b', H, Qmax, n]
        j = torch.arange(j0, j1, device=q.device)[None, None]
        qa_i, ha = (qi, h) if every else (qi[act], h[act])
        mask = (j <= qa_i) & ((j < ha) | (j == qa_i)) & (j < lengths[act][:, None, None])
        bias = None
        if pos_weights is not None:
            dist = (torch.minimum(qa_i, ha) - torch.minimum(j, ha)).clamp_(0, max_seq_len - 1)
            bias = lookup(pos_weights, dist.to(torch.int32))
        if time_weights is not None and qt is not None and slot_times is not None:
            kt = slot_times.index_select(0, flat).view(act.numel(), 1, n)
            tb = lookup(time_weights, time_bucket((qt if every else qt[act]) - kt, time_weights.numel()))
            bias = tb if bias is None else bias + tb
        if bias is not None:
            scores = scores + bias[:, None].to(scores.dtype)
        attn = F.silu(scores) * (mask[:, None].to(scores.dtype) * scale)
        if every:
            acc += torch.matmul(attn, vv)
        else:
            acc[act] += torch.matmul(attn, vv)
    res = acc.transpose(1, 2)  # [B, Qmax, H, Dv]
    out[qidx[real]] = res[real]
    return out.to(q.dtype)
