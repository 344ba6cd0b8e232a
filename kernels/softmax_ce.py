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

The row maximum is only subtracted where it is needed: when every logit is bounded by
``scale * max |user| * max |item| <= SHIFT_FREE_BOUND`` (Cauchy-Schwarz; L2-normalised rows
at a temperature of 0.07 give 14.3), ``exp`` cannot overflow and the normaliser is formed
without the max and subtract passes over the chunk (two of its four elementwise passes).

``gemm_dtype=torch.bfloat16``: the three GEMMs take bf16 inputs (oneDNN's bf16 GEMM, fp32
accumulation, ~2x the fp32 rate on CPUs with AVX512-BF16 or AMX); the chunk of logits, its
exp and each row's normaliser are bf16 roundings of fp32 computations (relative error ~2^-9
each: exp runs in fp32 registers, the normaliser accumulates in fp32), the loss and the
gradients' sums over chunks fp32. What a
``train.precision = "bf16"`` step runs (``models.retrieval``).

``exclude`` leaves given (token, item) pairs out of a token's softmax: their logits are set
to -inf in the chunk right after its GEMM (one scattered write per pair, in cache), so the
exp, the normaliser and both gradients skip them with no further pass. A retrieval model
evaluated and served with the user's history removed from the ranking need not spend its
capacity pushing those items down at every position (``models.retrieval``).
"""

from __future__ import annotations

import torch

# elements of one chunk's [rows, N] fp32 logits (twice as many bf16 ones): 512k = 2 MB, inside a core's L2 + L3 slice
# (a chunk that stays in cache keeps the GEMMs fed; much larger ones stream from memory)
_CHUNK_ELEMS = 1 << 19
# the largest logit bound for which the chunk skips the row max: exp(40) * N stays far below
# fp32's range for any N below 10^20, and exp(-40) far above its smallest normal
SHIFT_FREE_BOUND = 40.0


def _rows_per_chunk(n_items: int, chunk_rows: int | None, elem_bytes: int = 4) -> int:
    """Rows of a chunk: ``chunk_rows``, or as many as fit the chunk's bytes (2 MB)."""
    if chunk_rows:
        return chunk_rows
    return min(1024, max(16, _CHUNK_ELEMS * 4 // elem_bytes // max(n_items, 1)))


class _ChunkedSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float,
                chunk_rows: int | None, exclude: torch.Tensor | None, gemm_dtype: torch.dtype | None) -> torch.Tensor:
        need_u, need_it = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        u, it = users.float() * scale, items.float()  # the scale folded into the queries: no pass over logits
        low = gemm_dtype is not None and gemm_dtype != torch.float32
        ug, itg = (u.to(gemm_dtype), it.to(gemm_dtype)) if low else (u, it)  # the GEMMs' inputs, cast once
        t = u.shape[0]
        rows = _rows_per_chunk(it.shape[0], chunk_rows, itg.element_size())
        total = torch.zeros((), dtype=torch.float32, device=u.device)
        gu = torch.empty_like(u) if need_u else None
        git = torch.zeros_like(it) if need_it else None
        n = it.shape[0]
        # |logit| <= max |u_t| * max |item_j|: below the bound, exp needs no shift (one sync a call)
        bound = float(torch.linalg.vector_norm(u, dim=1).amax() * torch.linalg.vector_norm(it, dim=1).amax()) \
            if t and n else 0.0
        shift = bound > SHIFT_FREE_BOUND
        if exclude is not None:  # where each chunk's pairs begin in the sorted flat list
            starts = torch.arange(0, t + rows, rows, device=u.device) * n
            bounds = torch.searchsorted(exclude, starts).tolist()
        for c, s in enumerate(range(0, t, rows)):
            e = min(s + rows, t)
            logits = torch.mm(ug[s:e], itg.t())  # [rows, N], in the GEMM's dtype
            # the targets through the flat view (gather / scatter copy a bf16 chunk whole)
            at = torch.arange(e - s, device=u.device).mul_(n).add_(index[s:e])
            flat = logits.view(-1)
            tgt = flat.index_select(0, at)
            if exclude is not None and bounds[c + 1] > bounds[c]:
                flat.index_fill_(0, exclude[bounds[c]:bounds[c + 1]] - s * n, float("-inf"))
                flat.index_put_((at,), tgt)  # a token's own target stays in
            tgt = tgt.float()
            # logits now hold exp(logits [- rowmax]); bf16 ones are exp'd in place (in fp32 registers) and
            # summed with fp32 accumulation into a bf16 sum (asking sum for fp32 copies the chunk first)
            if shift:
                m = logits.amax(dim=1, keepdim=True)
                z = logits.sub_(m).exp_().sum(dim=1).float()
                total += (z.log() + m.squeeze(1).float() - tgt).sum()
            else:
                z = logits.exp_().sum(dim=1).float()  # bounded: no shift needed
                total += (z.log() - tgt).sum()
            if need_u or need_it:
                # softmax = exp / z: the 1/z goes onto the thin [rows, D] side, never over the chunk
                inv = z.reciprocal_()[:, None]
                ex = logits
                if need_u:
                    if low:
                        gu[s:e] = torch.mm(ex, itg)
                        gu[s:e].mul_(inv)
                    else:
                        torch.mm(ex, it, out=gu[s:e]).mul_(inv)
                if need_it:
                    if low:
                        git += torch.mm(ex.t(), (u[s:e] * inv).to(gemm_dtype))
                    else:
                        git.addmm_(ex.t(), u[s:e] * inv)
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
                None if git is None else (git * g).to(ctx.dtypes[1]), None, None, None, None, None)


def softmax_cross_entropy(users: torch.Tensor, items: torch.Tensor, index: torch.Tensor, scale: float = 1.0,
                          chunk_rows: int | None = None, exclude: torch.Tensor | None = None,
                          gemm_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean over tokens of ``-log softmax(scale * users @ items.T)[t, index[t]]``.

    users [T, D], items [N, D], index [T] (rows of ``items``). ``exclude``: int64 flat
    indices ``token * N + item`` (ascending; repeats allowed) of pairs left out of that
    token's softmax; a pair naming the token's own target is ignored. Autocast is left off
    inside: the logits' exp, their normaliser and the loss are fp32 whatever the surrounding
    precision; ``gemm_dtype`` (None: fp32) is the precision of the three GEMMs' inputs."""
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
        return _ChunkedSoftmaxCE.apply(users, items, index.long(), float(scale), chunk_rows, exclude, gemm_dtype)
