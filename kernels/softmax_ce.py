"""Full-softmax cross-entropy over a catalogue without materialising the [T, N] logits.

The next-item loss over a whole catalogue is ``cross_entropy(scale * users @ items.T, index)``
for T query tokens and N items. Written that way autograd keeps the T x N logits, their
softmax and its gradient: on ML-1M (T ~ 14k tokens a batch, N = 3.7k) that is ~200 MB per
tensor and several full passes over memory, and it was ~85% of an HSTU training step on CPU
(benchmarks/RESULTS.md, training throughput).

Here the tokens are processed in chunks sized to stay in cache, and the gradients are
formed in the same pass as the loss (the loss is a scalar, so backward only scales them):
per chunk one GEMM for the logits, one exp pass, and two GEMMs for the gradients,

    e = exp(logits - rowmax);  z = e.sum(1)
    d_users[chunk] = scale / T * (e @ items / z - items[index])
    d_items += 1 / T * (e.T @ (scale * users[chunk] / z) - onehot(index).T @ (scale * users[chunk]))

with no pass over the [rows, N] chunk beyond the exp (the 1/z lands on the thin side).
The gradients are only formed when an input requires one.

Exact (same math as the unfused loss, fp32 accumulation); works on any device.

``exclude`` leaves given (token, item) pairs out of a token's softmax: their logits are set
to -inf in the chunk right after its GEMM (one scattered write per pair, in cache), so the
exp, the normaliser and both gradients skip them with no further pass. A retrieval model
evaluated and served with the user's history removed from the ranking need not spend its
capacity pushing those items down at every position (``models.retrieval``).
"""

from __future__ import annotations

import torch

# elements of one chunk's [rows, N] logits (fp32): 512k = 2 MB, inside a core's L2 + L3 slice
# (a chunk that stays in cache keeps the GEMMs fed; much larger ones stream from memory)
_CHUNK_ELEMS = 1 << 19


def _rows_per_chunk(n_items: int, chunk_rows: int | None) -> int:
    if chunk_rows:
        return chunk_rows
    return min(1024, max(16, _CHUNK_ELEMS // max(n_items, 1)))


class _ChunkedSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float,
                chunk_rows: int | None, exclude: torch.Tensor | None) -> torch.Tensor:
        need_u, need_it = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        u, it = users.float() * scale, items.float()  # the scale folded into the queries: no pass over logits
        t = u.shape[0]
        rows = _rows_per_chunk(it.shape[0], chunk_rows)
        total = torch.zeros((), dtype=torch.float32, device=u.device)
        gu = torch.empty_like(u) if need_u else None
        git = torch.zeros_like(it) if need_it else None
        n = it.shape[0]
        if exclude is not None:  # where each chunk's pairs begin in the sorted flat list
            starts = torch.arange(0, t + rows, rows, device=u.device) * n
            bounds = torch.searchsorted(exclude, starts).tolist()
        for c, s in enumerate(range(0, t, rows)):
            e = min(s + rows, t)
            logits = torch.mm(u[s:e], it.t())
            tgt = logits.gather(1, index[s:e, None]).squeeze(1)
            if exclude is not None and bounds[c + 1] > bounds[c]:
                logits.view(-1).index_fill_(0, exclude[bounds[c]:bounds[c + 1]] - s * n, float("-inf"))
                logits.scatter_(1, index[s:e, None], tgt[:, None])  # a token's own target stays in
            m = logits.amax(dim=1, keepdim=True)
            z = logits.sub_(m).exp_().sum(dim=1)  # logits now holds exp(logits - rowmax)
            total += (z.log() + m.squeeze(1) - tgt).sum()
            if need_u or need_it:
                # softmax = exp / z: the 1/z goes onto the thin [rows, D] side, never over the chunk
                inv = z.reciprocal_()[:, None]
                if need_u:
                    torch.mm(logits, it, out=gu[s:e]).mul_(inv)
                if need_it:
                    git.addmm_(logits.t(), u[s:e] * inv)
        # minus the one-hot of the targets
        if need_u:
            gu.sub_(it[index]).mul_(scale / max(t, 1))
        if need_it:
            git.index_add_(0, index, u, alpha=-1.0).div_(max(t, 1))
        ctx.save_for_backward(gu if need_u else None, git if need_it else None)
        ctx.dtypes = (users.dtype, items.dtype)
        return total / max(t, 1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gu, git = ctx.saved_tensors
        g = grad_out.float()
        return (None if gu is None else (gu * g).to(ctx.dtypes[0]),
                None if git is None else (git * g).to(ctx.dtypes[1]), None, None, None, None)


def softmax_cross_entropy(users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float = 1.0,
                          chunk_rows: int | None = None, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of ``-log softmax(scale * users @ items.T)[t, index[t]]``.

    users [T, D], items [N, D], index [T] (rows of ``items``). ``exclude``: int64 flat
    indices ``token * N + item`` (ascending; repeats allowed) of pairs left out of that
    token's softmax; a pair naming the token's own target is ignored. Autocast is left off
    inside: the logits and their normaliser are fp32 whatever the surrounding precision."""
    if users.dim() != 2 or items.dim() != 2 or users.shape[1] != items.shape[1]:
        raise ValueError(f"users {tuple(users.shape)} and items {tuple(items.shape)} must be [T, D] and [N, D]")
    if index.shape != users.shape[:1]:
        raise ValueError(f"index {tuple(index.shape)} must be [T] = [{users.shape[0]}]")
    if exclude is not None:
        if exclude.dim() != 1 or exclude.dtype != torch.int64:
            raise ValueError("exclude must be a 1-d int64 tensor of flat indices token * N + item")
        if exclude.numel() and not 0 <= int(exclude[0]) <= int(exclude[-1]) < users.shape[0] * items.shape[0]:
            raise ValueError(f"exclude's indices must lie in [0, T * N = {users.shape[0] * items.shape[0]})")
        exclude = exclude if exclude.numel() else None
    with torch.autocast(device_type=users.device.type, enabled=False):
        return _ChunkedSoftmaxCE.apply(users, items, index.long(), float(scale), chunk_rows, exclude)
