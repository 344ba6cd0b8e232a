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
        lib.genrec_hstu_score.argtypes = [*common, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P]
        lib.genrec_hstu_extend.argtypes = [*common, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P]
        lib.genrec_rank_mlp.argtypes = [_I, _I, _P, _P, _I, _P, _P, _P, _I, _I, _P, _P, _P]
        lib.genrec_gather_rows.argtypes = [_P, _L, _L, _I, _I, _P, _P, _L, _F, _I, _P, _L]
        table = [_P, _L, _L, _I]
        lib.genrec_tokens.argtypes = [*table, *table, *table, _I, _L, _P, _P, _P, _F, _P, _P]
        lib.genrec_pooled.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I]
        lib.genrec_final_norm.argtypes = [_I, _I, _P, _P, _P, _I]
        lib.genrec_retrieve.argtypes = [_I, _I, _P, _I, _I, _P, _F, _P, _P, _P, _I, _P, _P]
        lib.genrec_hstu_encode.restype = lib.genrec_hstu_score.restype = lib.genrec_rank_mlp.restype = _I
        lib.genrec_hstu_extend.restype = _I
        lib.genrec_gather_rows.restype = lib.genrec_tokens.restype = lib.genrec_pooled.restype = _I
        lib.genrec_final_norm.restype = lib.genrec_retrieve.restype = _I
        lib.genrec_siphash_words.argtypes = [ctypes.c_uint64, ctypes.c_uint64, _I, _P, _L, _I, _P]
        lib.genrec_siphash_words.restype = _I
        lib._genrec_typed = True
    return lib


def ptr(a: np.ndarray | torch.Tensor) -> int:
    """The address of an array's first element (numpy's ``.ctypes`` builds an object per call)."""
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data_ptr()


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
        self._head = (self.num_layers, self.params, *self.dims, self.alpha, ptr(self.thr))

    def head(self) -> tuple:
        """The arguments every tower call starts with: layers, weights, shapes, alpha, time thresholds."""
        return self._head

    def final_norm(self, x: torch.Tensor, l2: bool = False) -> torch.Tensor:
        """The tower's final LayerNorm on x [N, D] in place (then, with ``l2``, each row
        divided by max(its L2 norm, 1e-6), as F.normalize)."""
        self.lib.genrec_final_norm(x.shape[0], x.shape[1], ptr(x), ptr(self.final[0]), ptr(self.final[1]), int(l2))
        return x


def relative_times(times: np.ndarray, base: int) -> np.ndarray:
    """int64 times from ``base``, clipped to the int32 range (as the PyTorch path buckets
    them); numpy, as is all of this backend's per-batch bookkeeping (a fraction of a torch
    operator's dispatch on these small arrays)."""
    out = times - base
    return np.maximum(np.minimum(out, 2**31 - 1, out=out), -(2**31) + 1, out=out)  # (np.clip's wrapper costs more)


@dataclass
class NativeHistory:
    """Encoded histories as the kernel reads them: what :func:`score` takes.

    ``k`` / ``v``: per layer, rows of H * Dqk / H * Dv floats (a [layers, Th, width] tensor, or
    a list of per-layer [rows, width] buffers); packed history row r (``offsets``' numbering)
    is row ``rows[r]`` of them, or row r where ``rows`` is None. Read where they lie: an entry
    grown in place (its layers ``capacity`` rows apart), an SGLang pool through its slot map."""

    k: torch.Tensor | list[torch.Tensor]
    v: torch.Tensor | list[torch.Tensor]
    offsets: np.ndarray  # [B + 1] int64
    tq: np.ndarray  # [Th] int64 query times from a base (a history's last: its request time)
    tk: np.ndarray  # [Th] int64 event times from the same base
    tower: NativeTower | None = None  # the weights that encoded it (candidates are scored with them)
    rows: np.ndarray | None = None  # [Th] int64 row of each packed history row in k / v; None: the same

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys [Th, H Dqk] and values [Th, H Dv] in packed order (gathered where
        ``rows`` places them: a copy; else views)."""
        k, v = self.k[i], self.v[i]
        if self.rows is None:
            t = int(self.offsets[-1])
            return k[:t], v[:t]
        r = torch.from_numpy(self.rows)
        return k.index_select(0, r), v.index_select(0, r)


def history(k: torch.Tensor | list[torch.Tensor], v: torch.Tensor | list[torch.Tensor], offsets: torch.Tensor,
            times: torch.Tensor | None, request_times: torch.Tensor | None,
            rows: np.ndarray | None = None) -> NativeHistory:
    """A :class:`NativeHistory` of keys / values that the PyTorch layers encoded: [layers, Th,
    H D] (``rows`` None), or per-layer row buffers with ``rows`` [Th] placing each packed row
    (an SGLang pool and its slot map); ``times`` [Th], ``request_times`` [B] (None: no time
    bias). Kept as they are (views; fp32 for the kernel): :func:`score` reads them in place."""
    offsets = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    th = int(offsets[-1])
    tq = np.zeros(th, np.int64)
    tk = tq
    if times is not None and request_times is not None:
        base = int(times.numpy().min()) if th else 0
        tk = relative_times(times.numpy(), base)
        tq[offsets[1:] - 1] = relative_times(request_times.numpy(), base)
    ks = k.float() if isinstance(k, torch.Tensor) else [t.float() for t in k]
    vs = v.float() if isinstance(v, torch.Tensor) else [t.float() for t in v]
    return NativeHistory(ks, vs, offsets, tq, tk, rows=None if rows is None else np.ascontiguousarray(rows, np.int64))


def _check_rows(rows: np.ndarray, buffers: list[torch.Tensor]) -> None:
    """Refuses row indices outside any buffer (the kernels read and write them unchecked)."""
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= min(b.shape[0] for b in buffers)):
        raise ValueError(f"row indices {int(rows.min())}..{int(rows.max())} outside the buffers' "
                         f"{min(b.shape[0] for b in buffers)} rows")


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """t [rows, width] with rows ``width`` floats apart, as the kernel reads a layer (a copy
    only where t is laid out otherwise)."""
    return t if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1] else t.contiguous()


def extend(tower: NativeTower, x: torch.Tensor, k: torch.Tensor | list[torch.Tensor],
           v: torch.Tensor | list[torch.Tensor], prefix: np.ndarray, lengths: np.ndarray,
           key_times: np.ndarray | None, query_times: np.ndarray | None,
           slots: np.ndarray | None = None) -> torch.Tensor:
    """W cached histories grown by their new rows: x [Tn, D] the new rows' token inputs, packed
    by history in order; history w has ``prefix[w]`` cached rows of ``lengths[w]`` (at least
    one new). Its keys / values: ``k`` [layers, W, cap, H Dqk], ``v`` [layers, W, cap, H Dv]
    (an engine cache's storage, row t of history w at [:, w, t]); or, with ``slots`` [W, L]
    (an SGLang pool's slot map), per-layer lists of pool rows ``k[l]`` [S, H Dqk], ``v[l]``
    [S, H Dv], row t of history w at row ``slots[w, t]``, read in place. Rows 0..prefix-1 are
    read, the new rows' written. fp32, contiguous. ``key_times`` [W, cap or L] every row's event
    time, ``query_times`` [Tn] the new rows' (None: no time bias) -> each history's last row
    after the tower and its final norm [W, D], as :func:`encode` gives for the whole history."""
    x = _scratch(x)
    prefix = np.ascontiguousarray(prefix, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if slots is None:
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == v.dim() == 4):
            raise ValueError("extend: without slots, k / v are storage tensors [layers, W, cap, width]")
        ks, vs, ld = [k[i] for i in range(k.shape[0])], [v[i] for i in range(v.shape[0])], k.shape[2]
    else:
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        ks, vs, ld = list(k), list(v), slots.shape[1]
        _check_rows(np.concatenate([slots[i, :n] for i, n in enumerate(lengths)]), ks + vs)
    w = lengths.size
    qoff = np.zeros(w + 1, np.int64)
    np.cumsum(lengths - prefix, out=qoff[1:])
    if key_times is None or query_times is None:
        tk, tq = np.zeros((w, ld), np.int64), np.zeros(x.shape[0], np.int64)
    else:
        base = min(int(key_times[i, : lengths[i]].min()) for i in range(w))
        tk = relative_times(np.ascontiguousarray(key_times, dtype=np.int64), base)
        tq = relative_times(np.array(query_times, dtype=np.int64), base)
    if not (all(t.is_contiguous() and t.dtype == torch.float32 for t in ks + vs) and len(ks) == len(vs)
            == tower.num_layers and tk.shape == (w, ld) and tq.size == x.shape[0]):
        raise ValueError("extend: fp32 contiguous keys / values for every layer, key_times [W, cap or L]")
    kp, vp = (_P * len(ks))(*[t.data_ptr() for t in ks]), (_P * len(vs))(*[t.data_ptr() for t in vs])
    out = torch.empty(w, tower.dims[0])
    rc = tower.lib.genrec_hstu_extend(*tower.head(), w, ptr(prefix), ptr(lengths), ptr(qoff), ptr(tq), ptr(tk), ld,
                                      ptr(slots) if slots is not None else None, ptr(x), kp, vp, ptr(out))
    if rc != 0:
        raise ValueError("extend: every history needs a new row, and at most cap rows")
    return tower.final_norm(out)


def _scratch(x: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 copy of x for the kernel to overwrite (made in numpy: cheaper than a
    torch clone's dispatch on a serving batch's few rows)."""
    x = x.detach() if x.requires_grad else x
    return torch.from_numpy(np.array(x.float().numpy(), dtype=np.float32, order="C", copy=True))


def encode(tower: NativeTower, x: torch.Tensor, offsets: torch.Tensor, query_times: torch.Tensor | None,
           timestamps: torch.Tensor | None, l2: bool = False) -> tuple[torch.Tensor, NativeHistory, torch.Tensor | None]:
    """Histories through the tower: x [T, D] token inputs, offsets [B+1] (every history has a
    token), times [T] (None: no time bias) -> (each history's last row after the tower and its
    final norm [B, D], the keys / values every layer made of every row, each history's last
    query time [B] or None). ``l2``: the rows also L2-normalized (:meth:`NativeTower.final_norm`)."""
    x = _scratch(x)
    offsets = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    t, b = x.shape[0], offsets.size - 1
    d, h, dqk, dv = tower.dims[:4]
    request = None
    if timestamps is None or query_times is None:
        tq = tk = np.zeros(t, np.int64)
    else:
        q = query_times.numpy()
        request = torch.from_numpy(q[offsets[1:] - 1])
        base = int(timestamps.numpy().min()) if t else 0
        tq, tk = relative_times(q, base), relative_times(timestamps.numpy(), base)
    kc, vc, out = torch.empty(tower.num_layers, t, h * dqk), torch.empty(tower.num_layers, t, h * dv), torch.empty(b, d)
    tower.lib.genrec_hstu_encode(*tower.head(), b, ptr(offsets), ptr(tq), ptr(tk), ptr(x), ptr(kc), ptr(vc), ptr(out))
    return tower.final_norm(out, l2), NativeHistory(kc, vc, offsets, tq, tk, tower), request


def score(tower: NativeTower, x: torch.Tensor, hist: NativeHistory, owner: torch.Tensor) -> torch.Tensor:
    """Candidates through the tower against encoded histories: x [C, D] candidate inputs of
    users ``owner`` [C] (runs of one user are scored together) -> [C, D] after the final norm."""
    x = _scratch(x)
    layers = tower.num_layers
    ks = [_rows_of(hist.k[i]) for i in range(layers)]
    vs = [_rows_of(hist.v[i]) for i in range(layers)]
    th = int(hist.offsets[-1])
    last = np.array([th - 1] if th else [], np.int64)  # (packed rows 0..th-1: the last must exist)
    _check_rows(hist.rows if hist.rows is not None else last, ks + vs)
    kl, vl = (_P * layers)(*[t.data_ptr() for t in ks]), (_P * layers)(*[t.data_ptr() for t in vs])
    own = owner.numpy()
    cand_offsets = np.zeros(0, np.int64)
    if own.size:  # runs of one user's candidates: [0, run starts..., C]
        change = np.flatnonzero(own[1:] != own[:-1]) + 1
        cand_offsets = np.empty(change.size + 2, np.int64)
        cand_offsets[0], cand_offsets[1:-1], cand_offsets[-1] = 0, change, own.size
    users = np.ascontiguousarray(own[cand_offsets[:-1]], dtype=np.int64)
    rows = ptr(hist.rows) if hist.rows is not None else None
    tower.lib.genrec_hstu_score(*tower.head(), ptr(hist.offsets), ptr(hist.tq), ptr(hist.tk), kl, vl, rows,
                                users.size, ptr(cand_offsets), ptr(users), ptr(x))
    return tower.final_norm(x)
