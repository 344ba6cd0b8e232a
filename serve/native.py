"""Serving kernels around the tower: the embedding gathers, pooled context, top-k retrieval
and ranking MLP of ``kernels/cpu/hstu_serve.cpp``, on a served artifact's tables.

The tower itself is the model's (``HSTUTower.encode_history`` / ``extend`` with
``backend="native"``, a kernel of ``kernels.hstu_native``); what is here does the same
work as the model's embedding lookups (:meth:`GenerativeRecommender.summed_tokens`, the
pooled tables), the retrieval product and top-k, and the ranking head's MLP, on the
quantized rows of an artifact without a PyTorch operator per table (row gathers dequantized
in the same pass; the ranking MLP applies each user's context once, not per candidate).
``tests/test_native_serving.py`` checks each against the PyTorch op it replaces.
"""

from __future__ import annotations

import ctypes
from typing import TypeVar

import numpy as np
import torch

from genrec.kernels.hstu_native import library, ptr, time_thresholds  # noqa: F401 - re-exported
from genrec.models.recommender import GenerativeRecommender
from genrec.quant.embeddings import ServedRows
from genrec.serve.requests import UserInput

_P = ctypes.c_void_p
_ptr = ptr
_NONE = np.zeros(0, np.int64)
T = TypeVar("T")


def _needed(value: T | None, what: str) -> T:
    """``value``, which a caller may only ask for where the artifact allows it natively."""
    if value is None:
        raise ValueError(f"ServeKernels.{what}: not served natively for this artifact; run the model's op")
    return value


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


class ServeKernels:
    """The native lookups and heads for one model (see the module docstring): ``tokens``,
    ``context``, ``retrieve``, ``rank``. A piece the artifact does not allow (float tables in
    PyTorch, an MLP of other layers) is None and the engine runs the model's op instead."""

    def __init__(self, model: GenerativeRecommender) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the native kernels did not build (kernels.native)")
        self.lib, self.model = lib, model
        self.dim = model.pos_emb.weight.shape[1]
        self.has_action = "action" in model.sparse.sequence_features
        self.mlp = self._mlp_params() if model.ranking is not None else None
        sp = model.sparse
        self.rows = ({f: NativeRows(lib, sp.rows[f]) for f in sp.sequence_features}
                     if all(f in sp.rows for f in sp.sequence_features) else None)
        pooled = list(model.embedding_cfg.pooled_features)
        self.pooled = ({f: NativeRows(lib, sp.pooled_rows[f]) for f in pooled}
                       if pooled and all(f in sp.pooled_rows for f in pooled) else None)
        self.pos = NativeRows(lib, ServedRows({"weight": model.pos_emb.weight.detach().float()}, "fp32", self.dim))
        # token inputs in one native call per batch (genrec_tokens) where every table takes rows
        self.fused_tokens = self.rows is not None and all(r.table is not None for r in self.rows.values())
        self._pooled_args = self._pooled_plan()

    def _mlp_params(self) -> tuple | None:
        """The ranking MLP for the native call: (widths [nl + 1] int32, pointers, tensors kept
        alive), the last layer padded to 8 zero columns; None where it is not Linear / SiLU
        (/ Dropout) layers with hidden widths in whole 8-float vectors (PyTorch runs it then)."""
        ranking = self.model.ranking
        if ranking is None:
            return None
        mods = list(ranking.mlp)
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
        tables = [t for r in rows if (t := r.table) is not None]
        if len(tables) < len(rows):
            return None
        arrays = (np.array([t[0] for t in tables], np.uint64), np.array([r.nrows for r in rows], np.int64),
                  np.array([r.row_bytes for r in rows], np.int64), np.array([r.bits for r in rows], np.int32),
                  np.array([d for _, _, d, _ in feats], np.int32), np.array([mn for *_, mn in feats], np.int32),
                  np.array([c for _, c, _, _ in feats], np.int32))
        return [f for f, *_ in feats], width, arrays

    def tokens(self, items: np.ndarray, actions: np.ndarray | None, positions: np.ndarray,
                item_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, D] (item row (+ action row)) * scale + position row, as
        :meth:`GenerativeRecommender.summed_tokens` makes them (needs ``self.rows``);
        ``item_rows`` [N, D] (when given) also gets the raw item rows."""
        x = torch.empty(items.size, self.dim)
        scale = float(self.model.scale)
        rows = _needed(self.rows, "rows")
        if self.fused_tokens:  # one call: the same three passes as below
            items = np.ascontiguousarray(items, dtype=np.int64)
            acts = None if actions is None else np.ascontiguousarray(actions, dtype=np.int64)
            pos = np.ascontiguousarray(positions, dtype=np.int64)
            act_table = _needed(rows["action"].table, "rows") if acts is not None else (None, 0, 0, 0)
            rc = self.lib.genrec_tokens(*_needed(rows[self.model.item_feature].table, "rows"), *act_table,
                                        *_needed(self.pos.table, "pos"),
                                        self.dim, items.size, _ptr(items), None if acts is None else _ptr(acts),
                                        _ptr(pos), scale, _ptr(x), None if item_rows is None else _ptr(item_rows))
            if rc:
                raise ValueError("an id outside its table's rows")
            return x
        rows[self.model.item_feature].gather(items, x, scale)
        if actions is not None:
            rows["action"].gather(actions, x, scale, accumulate=True)
        self.pos.gather(positions, x, accumulate=True)
        if item_rows is not None:
            rows[self.model.item_feature].gather(items, item_rows)
        return x

    def context(self, users: list[UserInput]) -> torch.Tensor:
        """[B, E] the users' pooled context (needs ``self.pooled``)."""
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
        pooled = _needed(self.pooled, "pooled")
        for f, column, dim, mean in feats:
            ids = [u.context.get(f, _NONE) for u in users]
            counts = np.array([a.size for a in ids], np.int64)
            if counts.sum():
                pooled[f].gather(np.concatenate(ids), out, accumulate=True,
                                      dst=np.repeat(np.arange(len(users)), counts), column=column)
                if mean:
                    out[:, column : column + dim] /= torch.from_numpy(np.maximum(counts, 1)).float()[:, None]
        return out

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

    def rank(self, h: torch.Tensor, item_rows: torch.Tensor, context: torch.Tensor | None, cand_offsets: np.ndarray,
             users: np.ndarray) -> torch.Tensor:
        """The ranking head's logits [N, tasks] (needs ``self.mlp``) for candidates grouped by
        user (``cand_offsets`` [U+1], ``users`` [U] rows of ``context`` [B, E]): h, item_rows [N, D]."""
        widths, ptrs, _ = _needed(self.mlp, "mlp")
        ctx = context.float().contiguous() if context is not None else None
        e = ctx.shape[1] if ctx is not None else 0
        if widths[0] != 3 * self.dim + e:
            raise ValueError(f"the ranking head takes {widths[0]} inputs, the candidates give {3 * self.dim + e}")
        n = h.shape[0]
        logits = torch.empty(n, int(widths[-1]))
        h, rows = h.float().contiguous(), item_rows.float().contiguous()  # bound: the call reads them
        cand_offsets, users = np.ascontiguousarray(cand_offsets, np.int64), np.ascontiguousarray(users, np.int64)
        self.lib.genrec_rank_mlp(n, self.dim, _ptr(h), _ptr(rows), users.size, _ptr(cand_offsets), _ptr(users),
                                 _ptr(ctx) if e else None, e, len(widths) - 1, _ptr(widths), ptrs, _ptr(logits))
        return logits[:, : len(self.model.cfg.ranking.tasks)]
