"""HSTU attention: the public ops, one per shape of call, each with a ``backend`` argument.

=========================  ==========================================  ==========================
op                         what it computes                            backends
=========================  ==========================================  ==========================
:func:`hstu_attention`     every row of a jagged batch (training,      reference, coded, triton,
                           the full pass)                              native
:func:`hstu_last_row_attention`  each sequence's last row only          reference, coded
                           (the last layer when only it is read)
:func:`hstu_cached_attention`    candidates against cached history      reference, coded,
                           keys / values (M-FALCON-style serving)      blocked
=========================  ==========================================  ==========================

``auto`` picks Triton on CUDA where its head-dim constraints hold, the native kernel on CPU
where it builds and takes the shapes (``hstu_train.supported``), else the coded backend;
for the cached op, the blocked GEMMs of ``hstu_candidates`` where no gradient is recorded.
Semantics (the mask, the relative biases, the 1 / N scale) are the reference's
(``kernels.hstu_reference``); every backend is checked against it in
``tests/test_hstu_parity.py``. The whole-tower C++ kernel (``kernels.hstu_native``) sits
behind the tower's methods, not these ops (it fuses the layers' GEMMs too).

Modules: ``hstu_reference`` (pure PyTorch, the ground truth), ``hstu_coded`` (bias codes
shared by the layers through an :class:`AttentionPlan`, a hand-written backward),
``triton_hstu`` (fused Triton kernels), ``hstu_train`` (C++ on CPU, forward and backward),
``hstu_native`` (C++ on CPU, serving),
``hstu_candidates`` (candidates x cached keys as GEMM blocks, fp32 or bf16).
"""

from __future__ import annotations

from typing import Literal

import torch

from genrec.kernels import hstu_train
from genrec.kernels.hstu_candidates import hstu_cached_attention_blocked
from genrec.kernels.hstu_coded import (  # noqa: F401 - the public names of the HSTU kernels
    AttentionPlan,
    bias_codes,
    bias_table,
    hstu_attention_coded,
    hstu_cached_attention_coded,
    hstu_last_row_attention_coded,
    silu_attention,
)
from genrec.kernels.hstu_reference import (  # noqa: F401
    attention_mask,
    batch_lengths,
    hstu_attention_reference,
    hstu_cached_attention_reference,
    hstu_last_row_attention_reference,
    padded_relative_times,
    query_blocks,
    records_grad,
    relative_bias,
    time_bucket,
    token_positions,
)

Backend = Literal["auto", "reference", "coded", "triton", "blocked", "native"]
# every op's backends besides "auto": the parity test runs each against the op's reference
OP_BACKENDS: dict[str, tuple[str, ...]] = {
    "hstu_attention": ("reference", "coded", "triton", "native"),
    "hstu_last_row_attention": ("reference", "coded"),
    "hstu_cached_attention": ("reference", "coded", "blocked"),
}

# a compiled tower calls the coded and native backends eagerly: a graph break per layer
_coded_eager = torch.compiler.disable(hstu_attention_coded)
_native_eager = torch.compiler.disable(hstu_train.hstu_attention_native)


def _check(backend: str, op: str) -> None:
    allowed = ("auto", *OP_BACKENDS[op])
    if backend not in allowed:
        raise ValueError(f"unknown attention backend '{backend}' for {op}; use one of {', '.join(allowed)}")


def _triton_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    return all(d >= 16 and d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1]))


def hstu_attention(
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
    backend: Backend = "auto",
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention: q, k [T, H, Dqk], v [T, H, Dv], offsets [B+1] -> [T, H, Dv].

    Example, B=2 sequences of lengths [3, 0]: offsets = [0, 3, 3], q [3, H, Dqk]; row i of
    sequence 0 sees rows 0..i. ``pos_weights`` [max_seq_len], ``time_weights`` [buckets]:
    the relative biases (with ``timestamps`` / ``query_times`` [T]); ``num_targets`` [B]:
    trailing candidates per sequence. ``max_len``: the longest sequence, when the caller
    knows it without a device sync; ``plan``: shared by the layers of one tower (coded).
    """
    _check(backend, "hstu_attention")
    kw = dict(max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights, time_weights=time_weights,
              timestamps=timestamps, query_times=query_times, num_targets=num_targets, max_len=max_len)
    if backend == "triton" or (backend == "auto" and q.is_cuda and _triton_fits(q, v)):
        from genrec.kernels.triton_hstu import triton_hstu_attention

        return triton_hstu_attention(q, k, v, offsets, **kw)
    if backend == "reference":
        return hstu_attention_reference(q, k, v, offsets, **kw)
    if backend == "native" or (backend == "auto" and not q.is_cuda):
        kw["max_len"] = batch_lengths(offsets, max_len)[1]  # (found once, for either backend)
        if hstu_train.supported(q, k, v, kw["max_len"]):
            return _native_eager(q, k, v, offsets, plan=plan, **kw)
        if backend == "native":
            raise ValueError("attention backend 'native' takes CPU tensors of one dtype (fp32 or bf16), head sizes "
                             f"that are multiples of 16 and sequences up to {hstu_train.MAX_LEN}, where its library "
                             "builds (kernels.hstu_train.supported); use 'auto' to fall back to the coded backend")
    return _coded_eager(q, k, v, offsets, plan=plan, **kw)


def hstu_last_row_attention(
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
    backend: Backend = "auto",
) -> torch.Tensor:
    """The rows of :func:`hstu_attention` (no targets) at each sequence's last token only:
    q, k, v [T, H, D] -> [B, H, Dv] (every sequence needs a token)."""
    _check(backend, "hstu_last_row_attention")
    fn = hstu_last_row_attention_reference if backend == "reference" else hstu_last_row_attention_coded
    return fn(q, k, v, offsets, max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights,
              time_weights=time_weights, timestamps=timestamps, query_times=query_times)


def hstu_cached_attention(
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
    backend: Backend = "auto",
    plan: AttentionPlan | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Candidates against cached histories: what :func:`hstu_attention` gives the
    ``num_targets`` rows, without recomputing the history. q, k, v [C, H, D] for C
    candidates of users ``owner`` [C]; k_hist, v_hist [Th, H, D] of B users
    (``hist_offsets`` [B+1], ``hist_times`` [Th]); ``request_times`` [B]. -> [C, H, Dv].
    ``dtype``: the blocked backend's GEMM precision (None: the inputs'; ``torch.bfloat16``
    where the CPU runs it faster, ``kernels.hstu_candidates``); other backends refuse one."""
    _check(backend, "hstu_cached_attention")
    kw = dict(max_seq_len=max_seq_len, alpha=alpha, pos_weights=pos_weights, time_weights=time_weights,
              hist_times=hist_times, request_times=request_times)
    blocked = backend == "blocked" or (backend == "auto" and not records_grad(q, k, v, k_hist, v_hist))
    if dtype is not None and dtype != q.dtype and not blocked:
        raise ValueError(f"attention backend '{backend}' computes in the inputs' dtype; dtype={dtype} needs 'blocked'")
    if backend == "reference":
        return hstu_cached_attention_reference(q, k, v, k_hist, v_hist, hist_offsets, owner, **kw)
    if blocked:
        return hstu_cached_attention_blocked(q, k, v, k_hist, v_hist, hist_offsets, owner, plan=plan, dtype=dtype, **kw)
    return hstu_cached_attention_coded(q, k, v, k_hist, v_hist, hist_offsets, owner, plan=plan, **kw)
