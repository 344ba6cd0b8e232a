"""The HSTU serving path in native code: the tower's layers for a whole batch in one call.

:class:`serve.padded.PaddedHSTU` cut the jagged bookkeeping, but each layer is still a dozen
PyTorch operators and every batch a thousand of them; on a 2-core CPU their dispatch and the
passes over [B, L, L] score tensors are most of the time (one ML-1M request: 44.8 MFLOP,
~0.8 ms at the matmul peak, ~6-7 ms through the padded path). Here the token inputs and
pooled context of an artifact's quantized tables (row gathers, dequantized in the same pass;
one call per batch for the tokens and one for the context, from the histories packed without
padding), everything between the token inputs and the tower's output, the final norm, the
exact top-k retrieval over the catalogue (:meth:`NativeHSTU.retrieve`, one GEMM for the batch)
and the ranking MLP run in ``kernels/cpu/hstu_serve.cpp``, so no PyTorch operator runs between
a batch's steps (a cold process pays ~20-30 us for each one it dispatches): packed rows
through the GEMMs (no padding at all), attention over the causal pairs only, in query blocks
of 64 against a transposed key block, bias codes computed once per batch and shared by the
layers, SiLU fused where the scores are made.

Same numbers as the model, to float rounding (``tests/test_native_serving.py`` checks user
vectors and candidate probabilities against ``encode_history`` / ``score_candidates``).
Covers what :func:`supports` says: the padded path's models, with fp32 dense weights and
model and value widths that are multiples of 8. The engine takes it by default where the
library builds (``kernels.native``); ``GENREC_NATIVE=0`` keeps the padded path.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np
import torch

from genrec.kernels import native
from genrec.kernels.hstu_attention import time_bucket
from genrec.models.recommender import GenerativeRecommender
from genrec.quant.embeddings import ServedRows
from genrec.serve.padded import PaddedHSTU, relative
from genrec.serve.padded import supports as padded_supports
from genrec.serve.requests import UserInput

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float
_L = ctypes.c_int64


def supports(model: GenerativeRecommender) -> bool:
    """Whether :class:`NativeHSTU` computes this model."""
    if not padded_supports(model) or model.dense_dtype != torch.float32:
        return False
    c, dim = model.cfg.hstu, model.pos_emb.weight.shape[1]
    layers = list(model.tower.layers)
    # the GEMMs' column counts (D, Dv, the uvqk width) in whole 8-float vectors
    fn = model.tower.final_norm
    return (dim % 8 == 0 and c.v_dim % 8 == 0 and (2 * c.num_heads * (c.v_dim + c.qk_dim)) % 8 == 0
            and all(la.norm.eps == 1e-5 and la.out_norm.eps == 1e-5 and la.uvqk.bias is not None
                    and la.out.bias is not None for la in layers)
            and isinstance(fn, torch.nn.LayerNorm) and fn.eps == 1e-5 and fn.weight is not None and fn.bias is not None)


def library() -> ctypes.CDLL | None:
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


_NONE = np.zeros(0, np.int64)


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


class NativeRows:
    """One served table (:class:`quant.embeddings.ServedRows`) for ``genrec_gather_rows``:
    rows gathered, dequantized and summed into a float buffer in one call, where the
    PyTorch path makes an index_select, a dequantize, a multiply and an add per table."""

    def __init__(self, lib: ctypes.CDLL, served: ServedRows) -> None:
        packed = served.packed
        self.lib, self.served, self.packed, self.dim = lib, served, packed, served.dim
        self.bits = served.bits or {torch.float32: 32, torch.float16: 16}[packed.dtype]
        self.nrows, self.row_bytes = packed.shape[0], packed.stride(0) * packed.element_size()
        # (rows, nrows, row_bytes, bits) for the batched calls, which take table rows directly:
        # only where ids are rows (a managed-collision table maps them first, in Python)
        self.table = None if served.remap else (packed.data_ptr(), self.nrows, self.row_bytes, self.bits)

    def gather(self, ids: np.ndarray, out: torch.Tensor, mul: float = 1.0, accumulate: bool = False,
               dst: np.ndarray | None = None, column: int = 0) -> None:
        """out[dst[i], column:column + dim] (+)= mul * row(ids[i]) (dst None: row i); ``ids`` are
        the feature's ids (a managed-collision table maps them to rows first)."""
        rows = np.ascontiguousarray(self.served.row_ids(torch.from_numpy(ids)).numpy() if self.served.remap else ids,
                                    dtype=np.int64)
        dst = None if dst is None else np.ascontiguousarray(dst, dtype=np.int64)
        need = rows.size if dst is None else (int(dst.max()) + 1 if dst.size else 0)  # rows of out written
        if (out.dtype != torch.float32 or out.dim() != 2 or not out.is_contiguous() or column + self.dim > out.shape[1]
                or need > out.shape[0] or (dst is not None and (dst.size != rows.size or (dst.size and dst.min() < 0)))):
            raise ValueError("gather writes into a contiguous [rows, width] float32 buffer that holds every row")
        rc = self.lib.genrec_gather_rows(self.packed.data_ptr(), self.nrows, self.row_bytes, self.bits, self.dim,
                                         _ptr(rows), None if dst is None else _ptr(dst), rows.size, mul,
                                         int(accumulate), out.data_ptr() + 4 * column, out.shape[-1])
        if rc:
            raise ValueError(f"an id outside the table's {self.nrows} rows")


@dataclass
class NativeHistory:
    """Encoded histories of a batch: what candidates are scored against."""

    k: torch.Tensor  # [layers, T, H * Dqk] every history row's keys, packed
    v: torch.Tensor  # [layers, T, H * Dv]
    offsets: np.ndarray  # [B + 1] int64: user b's rows are offsets[b]..offsets[b + 1] - 1
    tq: np.ndarray  # [T] int64 query times (a history's last: the request time)
    tk: np.ndarray  # [T] int64 event times
    context: torch.Tensor | None  # [B, E] pooled context, when the ranking head reads it

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class NativeHSTU(PaddedHSTU):
    """``encode(users)`` -> (user vectors [B, D], :class:`NativeHistory`);
    ``score(history, users, candidates)`` -> task probabilities, as :class:`PaddedHSTU`."""

    def __init__(self, model: GenerativeRecommender, stages: dict[str, float] | None = None) -> None:
        if not supports(model):
            raise ValueError("NativeHSTU needs what PaddedHSTU needs, fp32 dense weights and widths that are multiples of 8")
        lib = library()
        if lib is None:
            raise RuntimeError("the native kernels did not build (kernels.native); use PaddedHSTU")
        super().__init__(model)
        self.lib = lib
        c = model.cfg.hstu
        self.dims = (model.pos_emb.weight.shape[1], c.num_heads, c.qk_dim, c.v_dim, self.n, self.nb)
        self.alpha = float(self.layers[0].alpha)
        with torch.no_grad():
            keep = []  # per layer: LN w, b, uvqk W^T, b, out LN w, b, out W^T, b, bias table
            for layer, table in zip(self.layers, self.tables):
                keep += [t.detach().float().contiguous() for t in (
                    layer.norm.weight, layer.norm.bias, layer.uvqk.weight.t(), layer.uvqk.bias,
                    layer.out_norm.weight, layer.out_norm.bias, layer.out.weight.t(), layer.out.bias, table)]
        fn = model.tower.final_norm
        self.final = (fn.weight.detach().float().contiguous(), fn.bias.detach().float().contiguous())
        self.l2 = int(bool(model.head.cfg.l2_norm))  # the retrieval head normalizes user vectors
        self._keep = keep  # the pointers below point into these
        self.params = (_P * len(keep))(*[t.data_ptr() for t in keep])
        self.thr = time_thresholds(self.nb)
        self.mlp = self._mlp_params() if model.ranking is not None else None
        # a served artifact's tables (quantized rows): token inputs and context gathered natively
        sp = model.sparse
        self.rows = ({f: NativeRows(lib, sp.rows[f]) for f in sp.sequence_features}
                     if all(f in sp.rows for f in sp.sequence_features) else None)
        pooled = list(model.embedding_cfg.pooled_features)
        self.pooled = ({f: NativeRows(lib, sp.pooled_rows[f]) for f in pooled}
                       if pooled and all(f in sp.pooled_rows for f in pooled) else None)
        self.pos = NativeRows(lib, ServedRows({"weight": model.pos_emb.weight.detach().float()}, "fp32",
                                              model.pos_emb.weight.shape[1]))
        # token inputs in one native call per batch (genrec_tokens) where every table takes rows
        self.fused_tokens = self.rows is not None and all(r.table is not None for r in self.rows.values())
        self._pooled_args = self._pooled_plan()
        # seconds per stage, summed over calls (the engine passes its own profile's dict):
        # embedding lookups, the native tower, the ranking MLP
        self.stages = stages if stages is not None else {}

    def _mark(self, stage: str, t0: float) -> float:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - t0
        return now

    def _mlp_params(self) -> tuple | None:
        """The ranking MLP for the native call: (widths [nl + 1] int32, pointers, tensors kept
        alive), the last layer padded to 8 zero columns; None where it is not Linear / SiLU
        (/ Dropout) layers with hidden widths in whole 8-float vectors (PyTorch runs it then)."""
        mods = list(self.model.ranking.mlp)
        linears = [mod for mod in mods if isinstance(mod, torch.nn.Linear)]
        if not all(isinstance(mod, torch.nn.Linear | torch.nn.SiLU | torch.nn.Dropout) for mod in mods) or not linears:
            return None
        if any(la.out_features % 8 for la in linears[:-1]) or any(la.bias is None for la in linears):
            return None
        keep = []
        with torch.no_grad():
            for i, la in enumerate(linears):
                wt, b = la.weight.detach().float().t(), la.bias.detach().float()
                if i == len(linears) - 1:  # pad the output columns to a whole vector
                    pad = -wt.shape[1] % 8
                    wt, b = torch.nn.functional.pad(wt, (0, pad)), torch.nn.functional.pad(b, (0, pad))
                keep += [wt.contiguous(), b.contiguous()]
        widths = np.array([linears[0].in_features] + [t.shape[0] for t in keep[1::2]], np.int32)
        return widths, (_P * len(keep))(*[t.data_ptr() for t in keep]), keep

    def _pooled_columns(self) -> tuple[list[tuple[str, int, int, bool]], int]:
        """([(feature, first column, width, mean pooling)], the context's width) in the
        EmbeddingBagCollection's output order: tables, then their features."""
        feats, column = [], 0
        for t in self.model.embedding_cfg.pooled_tables:
            for f in t.features:
                feats.append((f, column, t.dim, t.pooling == "mean"))
                column += t.dim
        return feats, column

    def _pooled_plan(self) -> tuple | None:
        """The pooled features' tables for one genrec_pooled call per batch: (features, the
        context's width, the call's per-feature arrays); None where the model reads no context
        or a table maps its ids first."""
        m = self.model
        if m.ranking is None or not m.ranking_context or self.pooled is None:
            return None
        feats, width = self._pooled_columns()
        rows = [self.pooled[f] for f, *_ in feats]
        if any(r.table is None for r in rows):
            return None
        arrays = (np.array([r.table[0] for r in rows], np.uint64), np.array([r.nrows for r in rows], np.int64),
                  np.array([r.row_bytes for r in rows], np.int64), np.array([r.bits for r in rows], np.int32),
                  np.array([d for _, _, d, _ in feats], np.int32), np.array([mn for *_, mn in feats], np.int32),
                  np.array([c for _, c, _, _ in feats], np.int32))
        return [f for f, *_ in feats], width, arrays

    # ---- token inputs and context, natively where the tables are a served artifact's ----------
    def _tokens(self, items: np.ndarray, actions: np.ndarray | None, positions: np.ndarray,
                item_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, D] (item row (+ action row)) * scale + position row, as the model makes them;
        ``item_rows`` [N, D] (when given) also gets the raw item rows."""
        x = torch.empty(items.size, self.dims[0])
        scale = float(self.model.scale)
        if self.fused_tokens:  # one call: the same three passes as below
            items = np.ascontiguousarray(items, dtype=np.int64)
            acts = None if actions is None else np.ascontiguousarray(actions, dtype=np.int64)
            pos = np.ascontiguousarray(positions, dtype=np.int64)
            act_table = self.rows["action"].table if acts is not None else (None, 0, 0, 0)
            rc = self.lib.genrec_tokens(*self.rows[self.model.item_feature].table, *act_table, *self.pos.table,
                                        self.dims[0], items.size, _ptr(items), None if acts is None else _ptr(acts),
                                        _ptr(pos), scale, _ptr(x), None if item_rows is None else _ptr(item_rows))
            if rc:
                raise ValueError("an id outside its table's rows")
            return x
        self.rows[self.model.item_feature].gather(items, x, scale)
        if actions is not None:
            self.rows["action"].gather(actions, x, scale, accumulate=True)
        self.pos.gather(positions, x, accumulate=True)
        if item_rows is not None:
            self.rows[self.model.item_feature].gather(items, item_rows)
        return x

    def _candidate_tokens(self, cands: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rows is None:
            return super()._candidate_tokens(cands, positions)
        ids = cands.numpy()
        item_rows = torch.empty(ids.size, self.dims[0])
        x = self._tokens(ids, np.zeros_like(ids) if self.has_action else None, positions.numpy(), item_rows)
        return item_rows, x

    def _context(self, users: list[UserInput]) -> torch.Tensor | None:
        m = self.model
        if m.ranking is None or not m.ranking_context:
            return None
        if self.pooled is None:
            return super()._context(users)
        if self._pooled_args is not None:  # one native call for every feature and user
            feats, width, (tabs, nrows, row_bytes, bits, dims, mean, cols) = self._pooled_args
            ids = [u.context.get(f, _NONE) for f in feats for u in users]
            offsets = np.zeros(len(ids) + 1, np.int64)
            np.cumsum([a.size for a in ids], out=offsets[1:])
            flat = np.ascontiguousarray(np.concatenate(ids), dtype=np.int64)
            out = torch.zeros(len(users), width)
            rc = self.lib.genrec_pooled(len(users), len(feats), _ptr(tabs), _ptr(nrows), _ptr(row_bytes), _ptr(bits),
                                        _ptr(dims), _ptr(mean), _ptr(cols), _ptr(flat), _ptr(offsets), _ptr(out), width)
            if rc:
                raise ValueError(f"context feature {feats[-1 - rc]}: an id outside its table's {nrows[-1 - rc]} rows")
            return out
        feats, width = self._pooled_columns()
        out = torch.zeros(len(users), width)
        for f, column, dim, mean in feats:
            ids = [u.context.get(f, _NONE) for u in users]
            counts = np.array([a.size for a in ids], np.int64)
            if counts.sum():
                self.pooled[f].gather(np.concatenate(ids), out, accumulate=True,
                                      dst=np.repeat(np.arange(len(users)), counts), column=column)
                if mean:
                    out[:, column : column + dim] /= torch.from_numpy(np.maximum(counts, 1)).float()[:, None]
        return out

    def _head(self) -> tuple:
        return (len(self.layers), self.params, *self.dims, self.alpha, _ptr(self.thr))

    @torch.inference_mode()
    def encode(self, users: list[UserInput]) -> tuple[torch.Tensor, NativeHistory]:
        t0 = time.perf_counter()
        items, actions, tk, tq, positions, lens = self._packed(users)
        base = tk.min()  # the padded path's relative times, so both bucket the same gaps
        tk, tq = relative(tk, base).astype(np.int64), relative(tq, base).astype(np.int64)
        b = lens.size
        x = (self._history_tokens(items, actions, positions) if self.rows is None
             else self._tokens(items, actions if self.has_action else None, positions))
        x = x.contiguous()  # [T, D], overwritten by the call
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        t = x.shape[0]
        layers, d, h, dqk, dv = len(self.layers), *self.dims[:4]
        kc, vc, out = torch.empty(layers, t, h * dqk), torch.empty(layers, t, h * dv), torch.empty(b, d)
        ctx = self._context(users)
        t0 = self._mark("history_lookup", t0)
        self.lib.genrec_hstu_encode(*self._head(), b, _ptr(offsets), _ptr(tq), _ptr(tk), _ptr(x), _ptr(kc), _ptr(vc),
                                    _ptr(out))
        self._final_norm(out, self.l2)  # = m.head.normalize(m.tower.final_norm(out))
        self._mark("history_tower", t0)
        return out, NativeHistory(kc, vc, offsets, tq, tk, ctx)

    def _final_norm(self, x: torch.Tensor, l2: int = 0) -> None:
        """The tower's final LayerNorm on x [N, D] in place (then, with ``l2``, F.normalize)."""
        w, b = self.final
        self.lib.genrec_final_norm(x.shape[0], x.shape[1], _ptr(x), _ptr(w), _ptr(b), l2)

    def retrieve(self, users: torch.Tensor, items_t: torch.Tensor, corpus: np.ndarray, temperature: float,
                 exclude: list[np.ndarray] | None, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top ``k`` over the catalogue for user vectors [B, D]: ``items_t`` [D, Np] its
        vectors as columns (Np: the catalogue's N rounded up to 8), ``corpus`` [N] its sorted
        ids, ``exclude`` (per user: ids that score -inf, or None). -> (catalogue positions,
        scores) [B, k], best first; the same product and order as ``torch.mm(users,
        items.t()) / temperature`` then ``topk`` (to float rounding; equal scores: the lower
        position first)."""
        b, n = users.shape[0], corpus.size
        users = users.float().contiguous()
        pos, val = np.empty((b, k), np.int64), np.empty((b, k), np.float32)
        if exclude is None:
            offsets = ids = None
        else:
            offsets = np.zeros(b + 1, np.int64)
            np.cumsum([e.size for e in exclude], out=offsets[1:])
            ids = np.ascontiguousarray(np.concatenate(exclude), dtype=np.int64)
        corpus = np.ascontiguousarray(corpus, dtype=np.int64)
        rc = self.lib.genrec_retrieve(b, users.shape[1], _ptr(users), n, items_t.shape[1], _ptr(items_t), temperature,
                                      _ptr(corpus), None if offsets is None else _ptr(offsets),
                                      None if ids is None else _ptr(ids), k, _ptr(pos), _ptr(val))
        if rc:
            raise ValueError(f"retrieve: k={k} outside 0..{n}, or the catalogue's columns are not padded to 8")
        return pos, val

    @torch.inference_mode()
    def score(self, hist: NativeHistory, users: list[int], candidates: list[np.ndarray]) -> list[np.ndarray]:
        """Task probabilities [c, tasks] of each ``candidates[i]`` (table rows) for batch user ``users[i]``."""
        m = self.model
        if m.ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        t0 = time.perf_counter()
        counts = np.array([c.size for c in candidates], np.int64)
        if counts.sum() == 0:
            return [np.zeros((0, len(m.cfg.ranking.tasks)), np.float32) for _ in candidates]
        owner = np.repeat(np.asarray(users, np.int64), counts)  # each candidate's batch user
        cands = torch.from_numpy(np.concatenate(candidates).astype(np.int64))
        item_rows, x = self._candidate_tokens(cands, torch.from_numpy(hist.lengths[owner]))  # [N, D]
        x = x.contiguous()  # overwritten by the call
        cand_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        user = np.asarray(users, np.int64)
        t0 = self._mark("candidate_lookup", t0)
        self.lib.genrec_hstu_score(*self._head(), _ptr(hist.offsets), _ptr(hist.tq), _ptr(hist.tk), _ptr(hist.k),
                                   _ptr(hist.v), hist.k.shape[1], len(users), _ptr(cand_offsets), _ptr(user), _ptr(x))
        self._final_norm(x)
        h = x
        t0 = self._mark("candidate_tower", t0)
        tasks = len(m.cfg.ranking.tasks)
        if self.mlp is not None:  # native: the context's share of the first layer once per user
            widths, ptrs, _ = self.mlp
            ctx = hist.context.float().contiguous() if hist.context is not None else None
            e = ctx.shape[1] if ctx is not None else 0
            if widths[0] != 3 * self.dims[0] + e:
                raise ValueError(f"the ranking head takes {widths[0]} inputs, the candidates give {3 * self.dims[0] + e}")
            logits = torch.empty(len(owner), int(widths[-1]))
            h, rows = h.contiguous(), item_rows.float().contiguous()  # bound: the call reads them
            self.lib.genrec_rank_mlp(len(owner), self.dims[0], _ptr(h), _ptr(rows), len(users), _ptr(cand_offsets),
                                     _ptr(user), _ptr(ctx) if e else None, e, len(widths) - 1, _ptr(widths), ptrs,
                                     _ptr(logits))
            logits = logits[:, :tasks]
        else:
            ctx = hist.context[torch.from_numpy(owner)] if hist.context is not None else None
            logits = m.ranking(h, item_rows, ctx)
        probs = torch.sigmoid(logits.float()).numpy()
        self._mark("ranking_head", t0)
        return np.split(probs, cand_offsets[1:-1])
