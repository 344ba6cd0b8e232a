"""The HSTU tower's C++ backend (``kernels/cpu/hstu_serve.cpp``), for inference on CPU.

A kernel, not a model: the tower (``models.hstu.HSTUTower``) owns its weights and calls
:func:`encode` / :func:`score` with them (laid out once by :class:`NativeTower`) when its
methods are asked for ``backend="native"``. One call runs every layer of the tower for a
whole batch: the packed rows through the GEMMs (no padding), attention over the causal
pairs only in query blocks against a transposed key block, bias codes computed once per
batch and shared by the layers, SiLU fused where the scores are made, no PyTorch operator
between the layers (on a small CPU their dispatch is most of a serving batch).

Semantics: the tower's ``backend="torch"`` path, to float rounding
(``tests/test_hstu_parity.py``). Covers fp32, model and value widths in whole 8-float
vectors, LayerNorms with eps 1e-5 and affine weights, linear layers with biases
(:func:`supports`). The library also carries the serving path's embedding gathers, pooled
context, top-k retrieval and ranking MLP (``serve.native`` drives those); :func:`library`
types every entry point.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from genrec.kernels import native
from genrec.kernels.hstu_reference import time_bucket

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float
_L = ctypes.c_int64


def library() -> ctypes.CDLL | None:
    """The compiled ``hstu_serve`` library with typed entry points, or None (``kernels.native``)."""
    lib = native.library("hstu_serve")
    if lib is not None and not hasattr(lib, "_genrec_typed"):
        common = [_I, _P, _I, _I, _I, _I, _I, _I, _F, _P]
        lib.genrec_hstu_encode.argtypes = [*common, _I, _P, _P, _P, _P, _P, _P, _P]
        lib.genrec_hstu_score.argtypes = [*common, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P]
        lib.genrec_rank_mlp.argtypes = [_I, _I, _P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P]
        lib.genrec_gather_rows.argtypes = [_P, _L, _L, _I, _I, _P, _P, _L, _F, _I, _P, _L]
        table = [_P, _L, _L, _I]
        lib.genrec_tokens.argtypes = [*table, *table, *table, _I, _L, _P, _P, _P, _F, _P, _P]
        lib.genrec_pooled.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I]
        lib.genrec_final_norm.argtypes = [_I, _I, _P, _P, _P, _I]
        lib.genrec_retrieve.argtypes = [_I, _I, _P, _I, _I, _P, _F, _P, _P, _P, _I, _P, _P]
        lib.genrec_hstu_encode.restype = lib.genrec_hstu_score.restype = lib.genrec_rank_mlp.restype = _I
        lib.genrec_gather_rows.restype = lib.genrec_tokens.restype = lib.genrec_pooled.restype = _I
        lib.genrec_final_norm.restype = lib.genrec_retrieve.restype = _I
        lib._genrec_typed = True
    return lib


def ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def time_thresholds(num_buckets: int) -> np.ndarray:
    """[nb] int64: the smallest time gap (>= 0) that :func:`time_bucket` puts in bucket b or
    above (int64 max where none does). A binary search over the function itself, so the
    native code's buckets are PyTorch's exactly (time_bucket is monotone in the gap)."""
    target = torch.arange(num_buckets)
    lo, hi = torch.zeros(num_buckets, dtype=torch.int64), torch.full((num_buckets,), 2**31 - 1, dtype=torch.int64)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        ok = time_bucket(mid, num_buckets) >= target
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid + 1)
    never = time_bucket(hi, num_buckets) < target
    return torch.where(never, torch.iinfo(torch.int64).max, hi).numpy().astype(np.int64)


def supports(dim: int, heads: int, qk_dim: int, v_dim: int, dtype: torch.dtype, eps: list[float],
             has_bias: bool) -> bool:
    """Whether the kernel computes a tower of these shapes: fp32, the GEMMs' column counts
    (D, Dv, the uvqk width) in whole 8-float vectors, LayerNorm eps 1e-5, linear biases."""
    return (dtype == torch.float32 and dim % 8 == 0 and v_dim % 8 == 0 and (2 * heads * (v_dim + qk_dim)) % 8 == 0
            and all(e == 1e-5 for e in eps) and has_bias)


@dataclass(frozen=True)
class LayerWeights:
    """One HSTU layer's weights as the tower holds them (``W`` as nn.Linear: [out, in])."""

    norm_w: torch.Tensor
    norm_b: torch.Tensor
    uvqk_w: torch.Tensor  # [H (2 Dv + 2 Dqk), D]
    uvqk_b: torch.Tensor
    out_norm_w: torch.Tensor
    out_norm_b: torch.Tensor
    out_w: torch.Tensor  # [D, H Dv]
    out_b: torch.Tensor
    table: torch.Tensor  # the flat bias table (kernels.hstu_coded.bias_table), masked slot last


class NativeTower:
    """A tower's weights laid out for the kernel (fp32, W^T contiguous) and its shapes;
    built by the tower from its own parameters, kept while they do not change."""

    def __init__(self, layers: list[LayerWeights], final_w: torch.Tensor, final_b: torch.Tensor, heads: int,
                 qk_dim: int, v_dim: int, max_seq_len: int, num_buckets: int, alpha: float) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the native kernels did not build (kernels.native); use backend='torch'")
        self.lib = lib
        with torch.no_grad():
            keep = []
            for w in layers:
                keep += [t.detach().float().contiguous() for t in (
                    w.norm_w, w.norm_b, w.uvqk_w.t(), w.uvqk_b, w.out_norm_w, w.out_norm_b, w.out_w.t(), w.out_b,
                    w.table)]
            self.final = (final_w.detach().float().contiguous(), final_b.detach().float().contiguous())
        self._keep = keep  # the pointers below point into these
        self.params = (_P * len(keep))(*[t.data_ptr() for t in keep])
        self.num_layers = len(layers)
        self.dims = (final_w.shape[0], heads, qk_dim, v_dim, max_seq_len, num_buckets)
        self.alpha = float(alpha)
        self.thr = time_thresholds(num_buckets)

    def head(self) -> tuple:
        return (self.num_layers, self.params, *self.dims, self.alpha, ptr(self.thr))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The tower's final LayerNorm on x [N, D] in place."""
        self.lib.genrec_final_norm(x.shape[0], x.shape[1], ptr(x), ptr(self.final[0]), ptr(self.final[1]), 0)
        return x


def relative_times(times: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """int64 times from ``base``, clipped to the int32 range (as the PyTorch path buckets them)."""
    return (times - base).clamp_(-(2**31) + 1, 2**31 - 1).contiguous()


def encode(tower: NativeTower, x: torch.Tensor, offsets: torch.Tensor, query_times: torch.Tensor | None,
           timestamps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Histories through the tower: x [T, D] token inputs, offsets [B+1] (every history has a
    token), times [T] (None: no time bias) -> (each history's last row after the tower and its
    final norm [B, D], keys [layers, T, H Dqk], values [layers, T, H Dv])."""
    x = x.float().contiguous().clone()  # overwritten by the call
    offsets = offsets.contiguous()
    t, b = x.shape[0], offsets.numel() - 1
    d, h, dqk, dv = tower.dims[:4]
    if timestamps is None or query_times is None:
        tq = tk = torch.zeros(t, dtype=torch.int64)
    else:
        base = timestamps.min()
        tq, tk = relative_times(query_times, base), relative_times(timestamps, base)
    kc, vc, out = torch.empty(tower.num_layers, t, h * dqk), torch.empty(tower.num_layers, t, h * dv), torch.empty(b, d)
    tower.lib.genrec_hstu_encode(*tower.head(), b, ptr(offsets), ptr(tq), ptr(tk), ptr(x), ptr(kc), ptr(vc), ptr(out))
    return tower.final_norm(out), kc, vc


def score(tower: NativeTower, x: torch.Tensor, hist_offsets: torch.Tensor, hist_times: torch.Tensor | None,
          request_times: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Candidates through the tower against encoded histories: x [C, D] candidate inputs of
    users ``owner`` [C] (runs of one user are scored together), k / v [layers, Th, H D] from
    :func:`encode`, ``hist_times`` [Th] and ``request_times`` [B] (None: no time bias)
    -> [C, D] after the final norm."""
    x = x.float().contiguous().clone()  # overwritten by the call
    users, counts = torch.unique_consecutive(owner, return_counts=True)
    cand_offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=cand_offsets[1:])
    users, hist_offsets = users.to(torch.int64).contiguous(), hist_offsets.contiguous()
    th = k.shape[1]
    tq = torch.zeros(th, dtype=torch.int64)
    if hist_times is None or request_times is None:
        tk = tq
    else:  # the kernel reads a user's request time as its history's last query time
        base = hist_times.min()
        tk = relative_times(hist_times, base)
        tq[hist_offsets[1:] - 1] = relative_times(request_times, base)
    tower.lib.genrec_hstu_score(*tower.head(), ptr(hist_offsets), ptr(tq), ptr(tk), ptr(k), ptr(v), th, users.numel(),
                                ptr(cand_offsets), ptr(users), ptr(x))
    return tower.final_norm(x)
