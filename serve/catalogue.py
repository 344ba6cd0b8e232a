"""The served catalogue: its item ids and vectors, and the dense top-k over them.

``Catalogue`` holds the artifact's sorted item ids [N] and the model's item vectors [N, D]
(computed once at load). ``top_k`` answers from one of two searches (``RetrievalConfig.search``):

    exact  scores a batch of user vectors against all N items (one GEMM, the vectors laid out
           as its right-hand side), masks each work's excluded items, keeps its ``retrieve_k`` best
    ann    asks the artifact's ANN index (quant/ann.py, built by ``genrec quantize``) for a
           shortlist per user, drops the excluded items, re-scores the rest exactly (their
           vectors computed from the served rows, as exact search computes all of them) and
           keeps the ``retrieve_k`` best: the scores are the exact ones, only which items are
           scored is approximate. No [N, D] fp32 copy is kept (256 bytes an item at D = 64,
           2.56 GB at 10^7: more than the int8 rows and the index together)

``search`` says which one answers (ModelInfo.dense_search, the engine's stage "retrieve_ann"). ``read_served`` reads what a front end needs of an artifact without the
model (configs, catalogue ids, semantic IDs, schema, version): serve.sglang_engine.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from genrec.config import from_dict
from genrec.embedding.spec import EmbeddingConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.sid import SemanticIds
from genrec.quant.ann import AnnIndex, describe, item_vectors, load_index
from genrec.quant.artifact import ArtifactError, Manifest, load_tensors
from genrec.quant.load import artifact_semantic_ids
from genrec.serve.ann import RetrievalConfig
from genrec.serve.layout import served_schema
from genrec.serve.native import ServeKernels
from genrec.serve.requests import ModelSchema

_NONE = np.zeros(0, np.int64)


class Asks(Protocol):
    """What retrieval reads of a work (``Work``; the SGLang model's per-request payload)."""

    @property
    def retrieve_k(self) -> int: ...

    def excluded(self) -> np.ndarray | None: ...


class Catalogue:
    """The catalogue of ``model``: ``ids`` [N] sorted item ids and its item vectors, kept in the
    one layout the search in force reads: for exact search their transpose ``vectors_t`` [D, N]
    for the GEMM (or, with ``kernels``, the native path's, ``vectors_native``: the columns padded
    to a whole 8-float vector); for ANN search ``ann``, the artifact's index (``artifact`` /
    ``manifest``: where it is read from), and no vectors: the shortlist's are computed from the
    model's served rows (:meth:`vectors_at`). ``temperature``: the retrieval head's."""

    def __init__(self, model: GenerativeRecommender, kernels: ServeKernels | None = None,
                 artifact: str | Path | None = None, manifest: Manifest | None = None,
                 cfg: RetrievalConfig | None = None) -> None:
        cfg = cfg or RetrievalConfig()
        self.model = model
        self.ids = model.corpus_ids.cpu().numpy()
        self.temperature = float(model.head.cfg.temperature)
        has_index = manifest is not None and bool(manifest.index)
        _check_search(cfg, has_index, artifact)
        self.ann: AnnIndex | None = None
        if cfg.search != "exact" and has_index and artifact is not None and manifest is not None:
            dim = int(self.vectors_at(np.zeros(1, np.int64)).shape[1])
            self.ann = load_index(artifact, manifest, dim, cfg.nprobe, cfg.shortlist)
        self.search = self.ann.describe if self.ann is not None else "exact"
        self.kernels = kernels if self.ann is None else None
        # one layout of the vectors, the one the search in force reads: at 10^7 items each is
        # another N x D x 4 bytes. ANN keeps none (vectors_at); exact search multiplies by the
        # transpose [D, N] (rows contiguous), or the native kernel reads it padded to 8 columns.
        self.vectors_t: torch.Tensor | None = None
        self.vectors_native: torch.Tensor | None = None
        if self.ann is None:
            vectors = item_vectors(model)  # [N, D]
            vectors_t = vectors.t().contiguous()
            del vectors
            if self.kernels is not None:
                self.vectors_native = torch.nn.functional.pad(vectors_t.float(), (0, -vectors_t.shape[1] % 8)).contiguous()
            else:
                self.vectors_t = vectors_t

    def vectors_at(self, pos: np.ndarray) -> np.ndarray:
        """The item vectors at catalogue positions ``pos`` [...] -> [..., D] float32: the model's
        normalised rows (``item_embeddings``), the same per-row computation that gives exact
        search its [N, D] (quant.ann.item_vectors)."""
        return self.item_vectors(self.ids[pos])

    def item_vectors(self, items: np.ndarray) -> np.ndarray:
        """:meth:`vectors_at` by the items' ids [...] (catalogue items) -> [..., D] float32."""
        with torch.inference_mode():
            ids = torch.from_numpy(items.reshape(-1)).to(self.model.corpus_ids.device)
            return self.model.item_embeddings(ids).float().cpu().numpy().reshape(*items.shape, -1)

    def known(self, items: np.ndarray) -> np.ndarray:
        """[...] bool: which ``items`` are in the catalogue."""
        return _among(items, self.ids)

    def top_k(self, users: torch.Tensor, works: Sequence[tuple[int, Asks]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Exact top-k over the whole catalogue for user vectors ``users`` [B, D] (a work's
        index is its row): {work: (ids, logits)} best first, one matmul for all, each work's
        :meth:`Work.excluded` items masked (fewer than ``retrieve_k`` come back where the mask
        leaves fewer). = ``model.head.scores(users, items)``: the same product and temperature."""
        rows = [i for i, _ in works]
        if rows != list(range(users.shape[0])):
            users = users[torch.tensor(rows, device=users.device)]
        k = max(w.retrieve_k for _, w in works)
        excluded = [w.excluded() for _, w in works]
        if self.ann is not None:
            return self._ann_top_k(users, works, excluded, k)
        if self.kernels is not None and self.vectors_native is not None:  # one native call: GEMM, mask, top-k
            exclude = [_NONE if e is None else e for e in excluded]
            pos, vals = self.kernels.retrieve(users, self.vectors_native, self.ids, self.temperature,
                                              exclude if any(e is not None for e in excluded) else None, k)
            return _top(self.ids[pos], vals, works)
        assert self.vectors_t is not None
        scores = torch.mm(users, self.vectors_t).div_(self.temperature).float()  # [b, N]
        ex = [(j, e) for j, e in enumerate(excluded) if e is not None]
        if ex:  # every work's excluded items at once: (row, catalogue position) pairs -> -inf
            seen = np.concatenate([items for _, items in ex])
            row = np.repeat([j for j, _ in ex], [items.size for _, items in ex])
            idx = np.minimum(np.searchsorted(self.ids, seen), self.ids.size - 1)
            hit = self.ids[idx] == seen
            row_t, idx_t = torch.from_numpy(row[hit]).to(scores.device), torch.from_numpy(idx[hit]).to(scores.device)
            scores[row_t, idx_t] = -math.inf
        top = torch.topk(scores, k, dim=1)
        return _top(self.ids[top.indices.cpu().numpy()], top.values.cpu().numpy(), works)


    def _ann_top_k(self, users: torch.Tensor, works: Sequence[tuple[int, Asks]],
                   excluded: list[np.ndarray | None], k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """:meth:`top_k` from the index: per user the index's shortlist (``ann.shortlist``, widened
        by the user's excluded items so that k remain), excluded items dropped, the rest re-scored
        exactly (the same product and temperature as exact search) and the best k kept."""
        assert self.ann is not None
        q = users.float().cpu().numpy()  # [b, D]
        n_ex = max((e.size for e in excluded if e is not None), default=0)
        s = min(max(self.ann.shortlist, k) + n_ex, self.ids.size)
        pos = self.ann.search(q, s)  # [b, s] catalogue positions, -1 where the index found fewer
        items = self.ids[np.maximum(pos, 0)]  # [b, s]
        scores = np.einsum("bd,bsd->bs", q, self.item_vectors(items)) / self.temperature
        scores[pos < 0] = -np.inf
        for j, e in enumerate(excluded):
            if e is not None and e.size:
                scores[j, _among(items[j], np.unique(e))] = -np.inf
        return _top(*_best(items, scores, k), works)


def _check_search(cfg: RetrievalConfig, has_index: bool, artifact: str | Path | None) -> None:
    """``search = "ann"`` on an artifact without an index: refused, naming the way out."""
    if cfg.search == "ann" and not has_index:
        raise ArtifactError(f"{artifact}: serve.retrieval.search = \"ann\" but the artifact has no index; "
                            "build one with 'genrec quantize' (--index auto) or serve with search = \"exact\"")


def _among(items: np.ndarray, sorted_items: np.ndarray) -> np.ndarray:
    """[...] bool: which of ``items`` are in ``sorted_items`` (sorted, unique): a binary search
    each, not np.isin's sort of both (a shortlist of thousands against a history of hundreds)."""
    if sorted_items.size == 0:
        return np.zeros(items.shape, bool)
    at = np.minimum(np.searchsorted(sorted_items, items), sorted_items.size - 1)
    return sorted_items[at] == items


def _best(items: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best of each row of ``scores`` [b, s] (of ``items`` [b, s]), best
    first: a partition, then a sort of the ``k`` kept only (equal scores in shortlist order)."""
    if scores.shape[1] > k:
        keep = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        keep.sort(axis=1)  # shortlist order, so that the stable sort below breaks ties as before
        order = np.take_along_axis(keep, np.argsort(-np.take_along_axis(scores, keep, 1), axis=1, kind="stable"), 1)
    else:
        order = np.argsort(-scores, axis=1, kind="stable")
    vals = np.take_along_axis(scores, order, 1).astype(np.float32)
    return np.take_along_axis(items, order, 1), vals


def _top(ids: np.ndarray, vals: np.ndarray, works: Sequence[tuple[int, Asks]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{work: (ids, scores)}: row j's first ``retrieve_k`` of ids / vals [b, k] (best first),
    masked ones (-inf: excluded, sorted last) left out."""
    out = {}
    for j, (i, w) in enumerate(works):
        d, v = ids[j, : w.retrieve_k], vals[j, : w.retrieve_k]
        keep = v > -math.inf
        out[i] = (d, v) if keep.all() else (d[keep], v[keep])
    return out


# what makes a model in a manifest: not where it came from (source, report), nor when it was
# written; and its ANN index's entry where it has one (content_hash)
_CONTENT = ("format_version", "model", "embedding", "quantization", "generative", "tensors", "files")


def content_hash(manifest: Manifest) -> str:
    """sha256 (hex) of the manifest's model-defining part: configs, quantization, and every
    tensor's and file's checksum, as canonical JSON. Loading verifies every file and tensor
    against those checksums (``quant.artifact.load_tensors``), so two engines that loaded
    artifacts of one hash hold the same model, and artifacts that differ in a single weight
    differ in hash, whatever their folder and run names."""
    body = {k: getattr(manifest, k) for k in _CONTENT}
    if manifest.index:  # its search settings (nprobe, shortlist) change what retrieval returns
        body["index"] = manifest.index
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def version_of(manifest: Manifest) -> str:
    """An artifact's version as every answer carries it: run / checkpoint / quantization, then
    ``@`` and the first 12 hex digits of its :func:`content_hash` (names alone do not tell two
    exports apart: a re-export of a changed run, or weights swapped under the same folder)."""
    src = manifest.source
    run = Path(src.get("run_dir", "?")).name
    q = manifest.quantization
    return f"{run}/{src.get('checkpoint', '?')}/{q.get('embeddings')}-{q.get('dense')}@{content_hash(manifest)[:12]}"


@dataclass(frozen=True)
class Served:
    """What a front end needs of an artifact, without its model: configs, the catalogue's
    sorted item ids [N], the semantic IDs (None without a decoder), the schema and version."""

    manifest: Manifest
    model: ModelConfig
    embedding: EmbeddingConfig
    ids: np.ndarray
    sid: SemanticIds | None
    schema: ModelSchema
    version: str


def read_served(path: str | Path, retrieval: RetrievalConfig | None = None) -> Served:
    """:class:`Served` of the artifact at ``path``, every file verified against its manifest;
    its schema's ``dense_search`` says what ``retrieval`` ([serve.retrieval]) makes the model
    search with (an artifact without an index and ``search = "ann"``: refused, as the engine does)."""
    retrieval = retrieval or RetrievalConfig()
    manifest, tensors = load_tensors(path)
    try:
        cfg, emb = from_dict(ModelConfig, manifest.model), from_dict(EmbeddingConfig, manifest.embedding)
    except ValueError as e:
        raise ArtifactError(f"{path}/manifest.json: model or embedding config is invalid: {e}") from e
    dense = tensors["dense.safetensors"]
    if "corpus_ids" not in dense:
        raise ArtifactError(f"{path}/dense.safetensors: tensor 'corpus_ids' is missing")
    ids = dense["corpus_ids"].numpy().copy()
    sid = artifact_semantic_ids(dense, path) if cfg.sid.enabled else None
    schema = served_schema(cfg, emb, int(ids.size), tuple(int(s) for s in sid.sizes) if sid is not None else ())
    _check_search(retrieval, bool(manifest.index), path)
    if manifest.index and retrieval.search != "exact":  # (what Catalogue answers with under ``retrieval``)
        schema = replace(schema, dense_search=describe(manifest.index, retrieval.nprobe, retrieval.shortlist))
    return Served(manifest, cfg, emb, ids, sid, schema, version_of(manifest))
