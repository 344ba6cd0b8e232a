"""HSTU pointwise attention over jagged sequences: the pure-PyTorch reference and its helpers.

HSTU ("Actions Speak Louder than Words", Zhai et al. 2024) replaces softmax attention by

    A[i, j] = SiLU(alpha * <q_i, k_j> + rab_pos(i - j) + rab_time(t_query_i - t_j)) / N

masked to the allowed pairs, then ``out_i = sum_j A[i, j] v_j``. ``N`` is the configured
maximum sequence length (a constant, so a sequence scores the same alone, padded or in any
batch). There is no row normalisation, which is why the op is cheap to fuse: every (i, j)
pair is independent.

Masks: history token i sees history tokens j <= i. When ``num_targets[b] = K``, the last
K tokens of sequence b are *candidates* (HSTU's ranking setting): each sees the whole
history and itself, never another candidate, and no history token sees any candidate. So
a candidate's output does not depend on which other candidates share its sequence.

Shapes: q, k [T, H, Dqk]; v [T, H, Dv]; offsets [B+1]; timestamps, query_times [T];
num_targets [B]. Output [T, H, Dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genrec.kernels.jagged import jagged_index, jagged_to_padded, padded_to_jagged


def time_bucket(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced buckets of a time gap: 0 for dt <= 0, then floor(2 * log2(1 + dt)).

    Half-octave buckets: seconds-scale gaps land in 2..~60, position gaps (the fallback
    when timestamps are missing) in 2..~16. Clamped to ``num_buckets - 1``. int32 indices
    (the [B, L, L] tensors of long sequences are the cost here: no int64 passes over them).
    """
    x = dt.to(torch.float32).clamp_(min=0).add_(1.0).log2_().mul_(2.0).floor_()
    return x.clamp_(max=num_buckets - 1).to(torch.int32)


def attention_mask(
    lengths: torch.Tensor, max_len: int, num_targets: torch.Tensor | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """[B, L, L] bool: which key j query i may see (see module docstring). ``rows`` = (s, e):
    only queries s..e-1 against keys 0..e-1 ([B, e - s, e]; no query sees a later key)."""
    s, e = rows if rows is not None else (0, max_len)
    ar = torch.arange(max_len, device=lengths.device)
    i, j = ar[s:e, None], ar[None, :e]
    valid = ar[None, :] < lengths[:, None]  # [B, L]
    pair = valid[:, s:e, None] & valid[:, None, :e]
    if num_targets is None:
        return pair & (j <= i)[None]
    hist = (lengths - num_targets)[:, None, None]  # [B, 1, 1]
    history_query = (i[None] < hist) & (j <= i)[None]
    target_query = (i[None] >= hist) & ((j[None] < hist) | (i == j)[None])
    return pair & (history_query | target_query)


def token_positions(max_len: int, lengths: torch.Tensor, num_targets: torch.Tensor | None) -> torch.Tensor:
    """[1, L] or [B, L] positions for the relative bias: candidates all sit at the first
    position after the history, so a candidate is scored the same alone or among others."""
    ar = torch.arange(max_len, device=lengths.device)
    if num_targets is None:
        return ar[None]
    return torch.minimum(ar[None], (lengths - num_targets)[:, None])


def relative_bias(
    offsets: torch.Tensor,
    max_len: int,
    max_seq_len: int,
    pos_weights: torch.Tensor | None,
    time_weights: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    query_times: torch.Tensor | None,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_targets: torch.Tensor | None = None,
    rows: tuple[int, int] | None = None,
    padded_times: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """[B, L, L] additive bias (or None): position term plus time term.

    ``pos_weights`` [max_seq_len]: bias by distance p(i) - p(j) (clamped; p from
    :func:`token_positions`). ``time_weights`` [num_buckets]: bias by :func:`time_bucket`
    of ``query_times[i] - timestamps[j]``. ``rows`` as in :func:`attention_mask`;
    ``padded_times``: :func:`padded_relative_times` of the batch, when the caller has them.
    """
    s, e = rows if rows is not None else (0, max_len)
    bias = None
    if pos_weights is not None:
        p = token_positions(max_len, offsets[1:] - offsets[:-1], num_targets).to(torch.int32)
        dist = (p[:, s:e, None] - p[:, None, :e]).clamp_(0, max_seq_len - 1)
        bias = lookup(pos_weights, dist)  # [1 or B, e - s, e]
    if time_weights is not None:
        if padded_times is None:
            if timestamps is None or query_times is None:
                raise ValueError("time_weights needs timestamps and query_times")
            padded_times = padded_relative_times(query_times, timestamps, offsets, max_len, index)
        tq, tk = padded_times
        buckets = time_bucket(tq[:, s:e, None] - tk[:, None, :e], time_weights.numel())
        tb = lookup(time_weights, buckets)  # [B, e - s, e]
        bias = tb if bias is None else bias + tb
    return bias


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on these tensors (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def lookup(weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """weights[idx] for a 1-D table: index_select on the flat index (advanced indexing would
    widen int32 indices to int64 first)."""
    return weights.index_select(0, idx.reshape(-1)).view(idx.shape)


def padded_relative_times(query_times: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor,
                          max_len: int, index: tuple[torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(query times, key times) padded to [B, L], as int32 seconds from the batch's earliest
    key time (gaps of up to 68 years; differences are what the bias reads)."""
    base = timestamps.min() if timestamps.numel() else timestamps.new_zeros(())
    rel = lambda t: jagged_to_padded((t - base).clamp_(-(2**31) + 1, 2**31 - 1).to(torch.int32), offsets,  # noqa: E731
                                     max_len, index=index)
    return rel(query_times), rel(timestamps)


# Inference on long sequences goes through the queries in blocks of this many rows, so the
# [B, rows, L] scores, bias and mask stay cache-sized instead of [B, L, L].
QUERY_BLOCK = 256
# ...and serving splits even short ones into blocks of this many query rows: block s..e
# only meets keys 0..e-1, so the causal upper triangle is mostly skipped.
CAUSAL_BLOCK = 64


def query_blocks(max_len: int, block: int | None = None) -> list[tuple[int, int]]:
    """Query row ranges (s, e): ``block`` rows each, or by default blocks of
    :data:`CAUSAL_BLOCK` for sequences up to twice :data:`QUERY_BLOCK` and of it beyond."""
    if block is None:
        block = CAUSAL_BLOCK if max_len <= 2 * QUERY_BLOCK else QUERY_BLOCK
    return [(s, min(s + block, max_len)) for s in range(0, max_len, block)]


def batch_lengths(offsets: torch.Tensor, max_len: int | None) -> tuple[torch.Tensor, int]:
    """Per-sequence lengths and the longest (``max_len`` when the caller knows it)."""
    lengths = offsets[1:] - offsets[:-1]
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    return lengths, max_len


def hstu_attention_reference(
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
    query_block: int | None = None,
) -> torch.Tensor:
    """Pure-PyTorch jagged HSTU attention: pads to the batch's longest sequence, computes
    dense masked attention, returns jagged rows. The ground truth for every fast path.

    ``query_block``: rows of queries per block (default: all at once when training, blocks
    of :data:`QUERY_BLOCK` at inference on sequences longer than twice that)."""
    lengths, max_len = batch_lengths(offsets, max_len)
    if q.shape[0] == 0 or max_len == 0:
        return v.new_zeros(v.shape)
    index = jagged_index(offsets, q.shape[0])
    qp = jagged_to_padded(q, offsets, max_len, index=index).transpose(1, 2)  # [B, H, L, D]
    kp = jagged_to_padded(k, offsets, max_len, index=index).transpose(1, 2)
    vp = jagged_to_padded(v, offsets, max_len, index=index).transpose(1, 2)
    grad = records_grad(q, k, v, pos_weights, time_weights)
    times = None
    if time_weights is not None and timestamps is not None and query_times is not None:
        times = padded_relative_times(query_times, timestamps, offsets, max_len, index)

    def rows(s: int, e: int) -> torch.Tensor:
        # queries s..e-1 never see keys at or after e (causal history, candidates after it)
        scores = torch.matmul(qp[:, :, s:e], kp[:, :, :e].transpose(-1, -2)) * alpha  # [B, H, e - s, e]
        bias = relative_bias(offsets, max_len, max_seq_len, pos_weights, time_weights, timestamps, query_times,
                             index, num_targets, rows=(s, e), padded_times=times)
        if bias is not None:
            scores = scores + bias[:, None].to(scores.dtype)
        mask = attention_mask(lengths, max_len, num_targets, rows=(s, e))[:, None]
        attn = F.silu(scores) * (mask.to(scores.dtype) / max_seq_len)
        return torch.matmul(attn, vp[:, :, :e])  # [B, H, e - s, Dv]

    # one shot when training (and under torch.compile: decided before any test on the
    # dynamic max_len, so no shape guard or recompile) and for short sequences
    if query_block is None and (grad or max_len <= 2 * QUERY_BLOCK):
        out = rows(0, max_len)
    else:
        out = torch.cat([rows(s, e) for s, e in query_blocks(max_len, query_block)], dim=2)
    out = out.transpose(1, 2)  # [B, L, H, Dv]
    return padded_to_jagged(out, offsets, index=index)


def hstu_last_row_attention_reference(
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
    """The full pass (no targets) read at each sequence's last row: [B, H, Dv]."""
    out = hstu_attention_reference(q, k, v, offsets, max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights,
                                   time_weights=time_weights, timestamps=timestamps, query_times=query_times)
    return out[offsets[1:] - 1]


def hstu_cached_attention_reference(
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
) -> torch.Tensor:
    """Candidates against cached histories by definition: each user's candidates appended
    to its history as targets (seen at the request time), the full pass, the candidates'
    rows read back. q, k, v [C, H, D]; k_hist, v_hist [Th, H, D] -> [C, H, Dv]."""
    b = hist_offsets.numel() - 1
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=b)
    use_time = time_weights is not None and hist_times is not None and request_times is not None
    ks, vs, qs, ts, qts, cand_rows = [], [], [], [], [], []
    row, c0 = 0, 0
    for u in range(b):
        s, e, c = int(hist_offsets[u]), int(hist_offsets[u + 1]), int(counts[u])
        mine = order[c0 : c0 + c]
        c0 += c
        ks += [k_hist[s:e], k[mine]]
        vs += [v_hist[s:e], v[mine]]
        qs += [torch.zeros_like(k_hist[s:e, :, : q.shape[-1]]), q[mine]]  # history rows' queries are not read
        if use_time:
            ts += [hist_times[s:e], request_times[u].expand(c)]
            qts += [request_times[u].expand(e - s), request_times[u].expand(c)]
        cand_rows.append(torch.arange(row + e - s, row + e - s + c))
        row += e - s + c
    lengths = (hist_offsets[1:] - hist_offsets[:-1]) + counts
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    out = hstu_attention_reference(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), offsets, max_seq_len=max_seq_len, alpha=alpha,
        pos_weights=pos_weights, time_weights=time_weights if use_time else None,
        timestamps=torch.cat(ts) if use_time else None, query_times=torch.cat(qts) if use_time else None,
        num_targets=counts)
    res = torch.empty_like(v)
    res[order] = out[torch.cat(cand_rows)] if cand_rows else out[:0]
    return res
