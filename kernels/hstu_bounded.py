"""HSTU attention with a bounded reach into long histories: a recent window in full, the distant
past as block summaries (issue 44).

A query at position p (a history event at its own position, a candidate at the first position
after the history) attends to

* every key in its window, positions ``start(p) .. p`` (candidates: ``start(p) .. p - 1`` of the
  history and themselves), where ``start(p) = nsum(p) * block`` and
  ``nsum(p) = max(0, (p - window + 1) // block)``: the last ``window`` events and back to a
  block boundary, so the window holds ``window`` to ``window + block - 1`` keys;
* one summary per whole block before it, blocks ``0 .. nsum(p) - 1``: the block's mean key and
  the sum of its values, at the block's last event's position and time (its relative bias).

Window and summaries partition the history, so HSTU's sum over keys becomes a sum over at most
``window + block + L / block`` terms, ``SiLU(q mean(k) + bias) sum(v)`` standing in for a
block's ``sum_j SiLU(q k_j + bias) v_j``. A query's cost is bounded by the window; the
summaries grow with L / block. With ``window`` >= the sequence, it is the full attention
(``kernels.hstu_reference``), which the tests check.

The same function runs training (every row of a jagged batch, autograd through plain PyTorch
ops) and the history's encoding at serving time; :func:`bounded_history` turns cached keys and
values into each user's window rows and block summaries, against which the candidates are
scored by ``kernels.hstu_candidates`` with the summaries' own positions and times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from genrec.kernels.hstu_reference import (
    batch_lengths,
    lookup,
    padded_relative_times,
    records_grad,
    time_bucket,
    token_positions,
)
from genrec.kernels.jagged import jagged_index, jagged_to_padded, padded_to_jagged

ROWS = 256  # query rows per block of the padded pass


@dataclass(frozen=True)
class BlockSums:
    """One sequence's block summaries at one layer: the mean key and the summed value of each
    whole block of its first ``blocks x block`` tokens, kb [blocks, H, Dqk] and vb [blocks, H, Dv].
    Kept with a cached history (serving), so that a call that adds a few tokens recomputes only
    the blocks they touch instead of every block at every layer twice (its own rows' pass, then
    its candidates'). Never written in place: :func:`block_sums` makes new ones."""

    kb: torch.Tensor
    vb: torch.Tensor

    @property
    def blocks(self) -> int:
        return int(self.kb.shape[0])


def block_sums(k: torch.Tensor, v: torch.Tensor, block: int, prev: BlockSums | None = None,
               unchanged: int = 0) -> BlockSums:
    """The summaries of every whole block of one sequence's keys k [n, H, Dqk] and values v
    [n, H, Dv], taking from ``prev`` the blocks that lie within its first ``unchanged`` tokens."""
    nblk = k.shape[0] // block
    keep = min(prev.blocks, unchanged // block, nblk) if prev is not None else 0
    kn = k[keep * block : nblk * block].unflatten(0, (nblk - keep, block)).mean(1)
    vn = v[keep * block : nblk * block].unflatten(0, (nblk - keep, block)).sum(1)
    if prev is None or keep == 0:
        return BlockSums(kn, vn)
    return BlockSums(torch.cat([prev.kb[:keep], kn]), torch.cat([prev.vb[:keep], vn]))


def summaries(p: torch.Tensor, window: int, block: int) -> torch.Tensor:
    """Whole blocks before the window of a query at position ``p`` (any int tensor)."""
    return torch.clamp_min(torch.div(p - window + 1, block, rounding_mode="floor"), 0)


def hstu_bounded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    window: int,
    block: int,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    query_times: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Jagged q, k [T, H, Dqk], v [T, H, Dv], offsets [B+1] -> [T, H, Dv], as
    ``hstu_attention_reference`` but each query reaching its window and the block summaries
    before it (module docstring). ``num_targets`` [B]: trailing candidates per sequence."""
    lengths, max_len = batch_lengths(offsets, max_len)
    if q.shape[0] == 0 or max_len == 0:
        return v.new_zeros(v.shape)
    b = lengths.numel()
    index = jagged_index(offsets, q.shape[0])
    qp, kp, vp = (jagged_to_padded(t, offsets, max_len, index=index).transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    pos = token_positions(max_len, lengths, num_targets).to(torch.int32).expand(b, max_len)  # [B, L]
    hist = lengths - (num_targets if num_targets is not None else 0)
    use_time = time_weights is not None and timestamps is not None and query_times is not None
    tq, tk = padded_relative_times(query_times, timestamps, offsets, max_len, index) if use_time else (None, None)
    rows = _Rows(qp, kp, vp, pos, lengths, hist, tq, tk, window=window, block=block, max_seq_len=max_seq_len,
                 alpha=alpha, pos_weights=pos_weights, time_weights=time_weights if use_time else None)
    # training: each block of rows recomputed in the backward pass (activation checkpointing), so
    # a long sequence keeps one block's scores, bias and masks alive instead of all of them
    grad = records_grad(q, k, v, pos_weights, time_weights)
    outs = [checkpoint(rows, s, min(s + ROWS, max_len), use_reentrant=False) if grad else rows(s, min(s + ROWS, max_len))
            for s in range(0, max_len, ROWS)]
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).transpose(1, 2)  # [B, L, H, Dv]
    return padded_to_jagged(out, offsets, index=index) / max_seq_len


class _Rows:
    """Query rows ``s .. e-1`` of padded sequences against their windows and the block summaries
    before them -> [B, H, e - s, Dv] (not yet divided by max_seq_len). qp, kp, vp [B, H, L, D];
    pos [B, L] each row's position; lengths [B] rows of each sequence, hist [B] its rows before
    the targets; tq, tk [B, L] relative query / key times (None: no time bias). Row i's keys are
    rows j <= i (a target: the history and itself), so qp and tq may hold only the rows from
    ``q0`` on (a cached history's new rows: [B, H, L - q0, D], [B, L - q0])."""

    def __init__(self, qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, pos: torch.Tensor,
                 lengths: torch.Tensor, hist: torch.Tensor, tq: torch.Tensor | None, tk: torch.Tensor | None, *,
                 window: int, block: int, max_seq_len: int, alpha: float, pos_weights: torch.Tensor | None,
                 time_weights: torch.Tensor | None, q0: int = 0, sums: BlockSums | None = None) -> None:
        self.q0 = q0
        self.qp, self.kp, self.vp, self.pos, self.lengths, self.hist, self.tq, self.tk = qp, kp, vp, pos, lengths, hist, tq, tk
        self.window, self.block, self.max_seq_len, self.alpha = window, block, max_seq_len, alpha
        self.pos_weights, self.time_weights = pos_weights, time_weights
        nblk = kp.shape[2] // block
        if sums is not None:  # (one sequence's, computed already: [nblk, H, D] -> [1, H, nblk, D])
            self.kb, self.vb = sums.kb.transpose(0, 1)[None], sums.vb.transpose(0, 1)[None]
        else:
            self.kb = kp[:, :, : nblk * block].unflatten(2, (nblk, block)).mean(3)  # [B, H, nblk, Dqk]
            self.vb = vp[:, :, : nblk * block].unflatten(2, (nblk, block)).sum(3)
        self.ends = torch.arange(nblk, device=kp.device, dtype=torch.int32) * block + block - 1  # blocks' last positions

    def bias(self, pi: torch.Tensor, pj: torch.Tensor, ti: torch.Tensor | None, tj: torch.Tensor | None) -> torch.Tensor:
        dt = self.qp.dtype
        out = torch.zeros(pi.shape[0], pi.shape[1], pj.shape[-1], dtype=dt, device=pi.device)
        if self.pos_weights is not None:
            out = out + lookup(self.pos_weights, (pi[:, :, None] - pj[:, None, :]).clamp_(0, self.max_seq_len - 1)).to(dt)
        if self.time_weights is not None and ti is not None and tj is not None:
            out = out + lookup(self.time_weights, time_bucket(ti[:, :, None] - tj[:, None, :], self.time_weights.numel())).to(dt)
        return out  # [B, r, n]

    def __call__(self, s: int, e: int) -> torch.Tensor:
        qp, kp, vp, pos, lengths, hist, tq, tk = self.qp, self.kp, self.vp, self.pos, self.lengths, self.hist, self.tq, self.tk
        b, dev, block = qp.shape[0], qp.device, self.block
        pi = pos[:, s:e]  # [B, r]
        qs = qp[:, :, s - self.q0 : e - self.q0]
        ts = tq[:, s - self.q0 : e - self.q0] if tq is not None else None
        nsum = summaries(pi, self.window, block)  # [B, r]
        k0 = int(nsum.min()) * block  # the block's widest window starts here
        ns = int(nsum.max())
        ar = torch.arange(e, device=dev)
        i, j = ar[s:e], ar[k0:e]
        target = (i[None, :] >= hist[:, None])  # [B, r]
        see = (j[None, None, :] >= (nsum * block)[:, :, None]) & (j[None, None, :] < lengths[:, None, None])
        see &= torch.where(target[:, :, None], (j[None, None, :] < hist[:, None, None]) | (j == i[:, None])[None],
                           (j <= i[:, None])[None])
        see &= (i[None, :] < lengths[:, None])[:, :, None]
        sc = torch.matmul(qs, kp[:, :, k0:e].transpose(-1, -2)) * self.alpha  # [B, H, r, nw]
        sc = sc + self.bias(pi, pos[:, k0:e], ts, tk[:, k0:e] if tk is not None else None)[:, None]
        out = torch.matmul(F.silu(sc) * see[:, None].to(sc.dtype), vp[:, :, k0:e])
        if ns:
            ssc = torch.matmul(qs, self.kb[:, :, :ns].transpose(-1, -2)) * self.alpha  # [B, H, r, ns]
            pe = self.ends[:ns].expand(b, ns)
            te = tk[:, self.ends[:ns]] if tk is not None else None
            ssc = ssc + self.bias(pi, pe, ts, te)[:, None]
            use = (torch.arange(ns, device=dev)[None, None, :] < nsum[:, :, None])
            use &= (i[None, :] < lengths[:, None])[:, :, None]
            out = out + torch.matmul(F.silu(ssc) * use[:, None].to(ssc.dtype), self.vb[:, :, :ns])
        return out  # [B, H, r, Dv]


def hstu_bounded_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: torch.Tensor,
    index: torch.Tensor,
    lengths: torch.Tensor,
    *,
    window: int,
    block: int,
    max_seq_len: int,
    alpha: float,
    pos_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    key_times: torch.Tensor | None = None,
    query_times: torch.Tensor | None = None,
    sums: list[BlockSums | None] | None = None,
) -> torch.Tensor:
    """New history tokens q [Tq, H, Dqk] (token ``index[i]`` of sequence ``seq[i]``) against their
    sequences' cached and new keys / values k, v [B, L, H, D] (``lengths`` [B] after this call,
    ``key_times`` [B, L], ``query_times`` [Tq]) -> [Tq, H, Dv]: what :func:`hstu_bounded_attention`
    gives these rows over the whole sequences (``kernels.hstu_paged``'s contract, bounded).
    A token's keys all precede it, so the cached tokens' keys and values stay valid as a history
    grows: each new token reads its window and the summaries of the cached blocks before it.
    ``sums`` [B]: each sequence's block summaries before this call (None: none kept), replaced
    in the list by its summaries after it (:func:`block_sums`: only blocks with new tokens are
    computed)."""
    out = v.new_zeros(q.shape[0], v.shape[2], v.shape[3])
    use_time = time_weights is not None and key_times is not None and query_times is not None
    for b in torch.unique(seq).tolist():
        rows = torch.nonzero(seq == b).flatten()
        n, idx = int(lengths[b]), index[rows]
        s, e = int(idx.min()), int(idx.max()) + 1
        kept = None
        if sums is not None:
            kept = sums[b] = block_sums(k[b, :n], v[b, :n], block, sums[b], s)
        qp = q.new_zeros(1, q.shape[1], e - s, q.shape[2])  # only the new rows (q0 = s)
        qp[0, :, idx - s] = q[rows].transpose(0, 1)
        kp, vp = (t[b : b + 1, :n].transpose(1, 2) for t in (k, v))  # [1, H, n, D]
        tq = tk = None
        if use_time:
            base = key_times[b, :n].min()
            tk = (key_times[b : b + 1, :n] - base)
            tq = tk.new_zeros(1, e - s)
            tq[0, idx - s] = query_times[rows] - base
        ln = torch.tensor([n], device=q.device)
        rows_of = _Rows(qp, kp, vp, torch.arange(n, device=q.device, dtype=torch.int32)[None], ln, ln, tq, tk,
                        window=window, block=block, max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights,
                        time_weights=time_weights if use_time else None, q0=s, sums=kept)
        # in blocks of ROWS rows, as the training pass: a block's keys are its rows' windows, not
        # the window of the block's first row through its last (a chunk of thousands of new rows)
        blocks = [rows_of(r, min(r + ROWS, e)) for r in range(s, e, ROWS)]
        part = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)  # [1, H, e - s, Dv]
        out[rows] = part[0].transpose(0, 1)[idx - s]
    return out / max_seq_len


def bounded_history(k_hist: torch.Tensor, v_hist: torch.Tensor, hist_offsets: torch.Tensor,
                    hist_times: torch.Tensor | None, window: int, block: int,
                    sums: list[BlockSums | None] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What candidates at the first position after each history see of it: per user its block
    summaries then its window rows, as a jagged history of "virtual" keys. k_hist, v_hist
    [Th, H, D], hist_offsets [B+1], hist_times [Th] -> (keys [Tv, H, D], values [Tv, H, Dv],
    offsets [B+1], key positions [Tv], key times [Tv] or None). ``sums`` [B]: a user's block
    summaries where known (:class:`BlockSums` of its whole history), else computed here."""
    ks, vs, ps, ts, lens = [], [], [], [], []
    for u in range(hist_offsets.numel() - 1):
        s, e = int(hist_offsets[u]), int(hist_offsets[u + 1])
        n = e - s
        ns = int(summaries(torch.tensor(n), window, block))
        w0 = s + ns * block
        known = sums[u] if sums is not None else None
        if known is not None and known.blocks >= ns:
            ks.append(known.kb[:ns])
            vs.append(known.vb[:ns])
        else:
            ks.append(k_hist[s:w0].unflatten(0, (ns, block)).mean(1))
            vs.append(v_hist[s:w0].unflatten(0, (ns, block)).sum(1))
        ks.append(k_hist[w0:e])
        vs.append(v_hist[w0:e])
        last = torch.arange(ns, device=k_hist.device) * block + block - 1
        ps += [last, torch.arange(ns * block, n, device=k_hist.device)]
        if hist_times is not None:
            ts += [hist_times[s + last], hist_times[w0:e]]
        lens.append(ns + e - w0)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64, device=k_hist.device)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    cat = lambda xs, like: torch.cat(xs) if xs else like[:0]  # noqa: E731
    return (cat(ks, k_hist), cat(vs, v_hist), offsets, cat(ps, hist_offsets),
            cat(ts, hist_times) if hist_times is not None else None)
