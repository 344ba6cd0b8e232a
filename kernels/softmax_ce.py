"""Full-softmax cross-entropy over a catalogue without materialising the [T, N] logits.

The next-item loss over a whole catalogue is ``cross_entropy(scale * users @ items.T, index)``
for T query tokens and N items. Written that way autograd keeps the T x N logits, their
softmax and its gradient: on ML-1M (T ~ 14k tokens a batch, N = 3.7k) that is ~200 MB per
tensor and several full passes over memory, and it was ~85% of an HSTU training step on CPU
(benchmarks/RESULTS.md, training throughput).

Here the tokens are processed in chunks sized to stay in cache. Forward keeps only the
per-token log-sum-exp; backward recomputes each chunk's logits (one extra GEMM) and turns
them into the gradient in place:

    p = exp(logits - lse);  p[t, index_t] -= 1
    d_users[chunk] = (g / T) * scale * p @ items;  d_items += (g / T) * p.T @ (scale * users[chunk])

Exact (same math as the unfused loss, fp32 accumulation); works on any device.
"""

from __future__ import annotations

import torch

# elements of one chunk's [rows, N] logits (fp32): 512k = 2 MB, inside a core's L2 + L3 slice
# (measured on a 2-core EPYC: 128-row chunks run the GEMMs ~1.4x faster than 1024-row ones)
_CHUNK_ELEMS = 1 << 19


def _rows_per_chunk(n_items: int, chunk_rows: int | None) -> int:
    if chunk_rows:
        return chunk_rows
    return min(1024, max(16, _CHUNK_ELEMS // max(n_items, 1)))


def _lse_(logits: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp, overwriting ``logits`` with exp(logits - rowmax) (one pass fewer
    than torch.logsumexp, whose result is the same)."""
    m = logits.amax(dim=1, keepdim=True)
    return logits.sub_(m).exp_().sum(dim=1).log_().add_(m.squeeze(1))


class _ChunkedSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float,
                chunk_rows: int | None) -> torch.Tensor:
        u, it = users.float() * scale, items.float()  # the scale folded into the queries: no pass over logits
        t = u.shape[0]
        rows = _rows_per_chunk(it.shape[0], chunk_rows)
        lse = torch.empty(t, dtype=torch.float32, device=u.device)
        total = torch.zeros((), dtype=torch.float32, device=u.device)
        for s in range(0, t, rows):
            e = min(s + rows, t)
            logits = torch.mm(u[s:e], it.t())
            tgt = logits.gather(1, index[s:e, None]).squeeze(1)
            lse[s:e] = _lse_(logits)
            total += (lse[s:e] - tgt).sum()
        ctx.save_for_backward(u, it, index, lse)
        ctx.scale, ctx.rows, ctx.dtypes = scale, rows, (users.dtype, items.dtype)
        return total / max(t, 1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        u, it, index, lse = ctx.saved_tensors
        t, scale, rows = u.shape[0], ctx.scale, ctx.rows
        need_u, need_it = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gu = torch.empty_like(u) if need_u else None
        git = torch.zeros_like(it) if need_it else None
        coef = grad_out.float() / max(t, 1)
        for s in range(0, t, rows):
            e = min(s + rows, t)
            p = torch.mm(u[s:e], it.t()).sub_(lse[s:e, None]).exp_()
            p[torch.arange(e - s, device=p.device), index[s:e]] -= 1.0
            if need_u:
                torch.mm(p, it, out=gu[s:e])
            if need_it:
                git.addmm_(p.t(), u[s:e])  # u is already scaled
        if need_u:
            gu.mul_(coef * scale)
        if need_it:
            git.mul_(coef)
        return (gu.to(ctx.dtypes[0]) if need_u else None, git.to(ctx.dtypes[1]) if need_it else None,
                None, None, None)


def softmax_cross_entropy(users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float = 1.0,
                          chunk_rows: int | None = None) -> torch.Tensor:
    """Mean over tokens of ``-log softmax(scale * users @ items.T)[t, index[t]]``.

    users [T, D], items [N, D], index [T] (rows of ``items``). Autocast is left off inside:
    the logits and their normaliser are fp32 whatever the surrounding precision."""
    if users.dim() != 2 or items.dim() != 2 or users.shape[1] != items.shape[1]:
        raise ValueError(f"users {tuple(users.shape)} and items {tuple(items.shape)} must be [T, D] and [N, D]")
    if index.shape != users.shape[:1]:
        raise ValueError(f"index {tuple(index.shape)} must be [T] = [{users.shape[0]}]")
    with torch.autocast(device_type=users.device.type, enabled=False):
        return _ChunkedSoftmaxCE.apply(users, items, index.long(), float(scale), chunk_rows)
