"""The served catalogue: its item ids and vectors, and the exact dense top-k over them.

``Catalogue`` holds the artifact's sorted item ids [N] and the model's item vectors [N, D]
(computed once at load, then laid out as the right-hand side of one GEMM); ``top_k`` scores a
batch of user vectors against all of them, masks each work's excluded items and keeps its
``retrieve_k`` best. ``read_served`` reads what a front end needs of an artifact without the
model (configs, catalogue ids, semantic IDs, schema, version): serve.sglang_engine.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from genrec.config import from_dict
from genrec.embedding.spec import EmbeddingConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.sid import SemanticIds
from genrec.quant.artifact import ArtifactError, Manifest, load_tensors
from genrec.quant.load import artifact_semantic_ids
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
    """The catalogue of ``model``: ``ids`` [N] sorted item ids, ``vectors`` [N, D] and their
    transpose [D, N] for the GEMM; ``kernels`` (the native path's): its top-k reads the columns
    padded to a whole 8-float vector. ``temperature``: the retrieval head's."""

    def __init__(self, model: GenerativeRecommender, kernels: ServeKernels | None = None) -> None:
        with torch.inference_mode():
            corpus = model.corpus_ids
            self.vectors = torch.cat([model.item_embeddings(corpus[i : i + 65536])
                                      for i in range(0, corpus.numel(), 65536)])  # [N, D]
        self.ids = corpus.cpu().numpy()
        self.vectors_t = self.vectors.t().contiguous()  # [D, N] (rows contiguous)
        self.temperature = float(model.head.cfg.temperature)
        self.kernels = kernels
        self.vectors_native = (torch.nn.functional.pad(self.vectors_t.float(), (0, -self.vectors_t.shape[1] % 8))
                               .contiguous() if kernels is not None else None)

    def known(self, items: np.ndarray) -> np.ndarray:
        """[...] bool: which ``items`` are in the catalogue."""
        pos = np.minimum(np.searchsorted(self.ids, items), self.ids.size - 1)
        return self.ids[pos] == items

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
        if self.kernels is not None and self.vectors_native is not None:  # one native call: GEMM, mask, top-k
            exclude = [_NONE if e is None else e for e in excluded]
            pos, vals = self.kernels.retrieve(users, self.vectors_native, self.ids, self.temperature,
                                              exclude if any(e is not None for e in excluded) else None, k)
            return _top(self.ids[pos], vals, works)
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


def _top(ids: np.ndarray, vals: np.ndarray, works: Sequence[tuple[int, Asks]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{work: (ids, scores)}: row j's first ``retrieve_k`` of ids / vals [b, k] (best first),
    masked ones (-inf: excluded, sorted last) left out."""
    out = {}
    for j, (i, w) in enumerate(works):
        d, v = ids[j, : w.retrieve_k], vals[j, : w.retrieve_k]
        keep = v > -math.inf
        out[i] = (d, v) if keep.all() else (d[keep], v[keep])
    return out


# what makes a model in a manifest: not where it came from (source, report), nor when it was written
_CONTENT = ("format_version", "model", "embedding", "quantization", "generative", "tensors", "files")


def content_hash(manifest: Manifest) -> str:
    """sha256 (hex) of the manifest's model-defining part: configs, quantization, and every
    tensor's and file's checksum, as canonical JSON. Loading verifies every file and tensor
    against those checksums (``quant.artifact.load_tensors``), so two engines that loaded
    artifacts of one hash hold the same model, and artifacts that differ in a single weight
    differ in hash, whatever their folder and run names."""
    body = {k: getattr(manifest, k) for k in _CONTENT}
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


def read_served(path: str | Path) -> Served:
    """:class:`Served` of the artifact at ``path``, every file verified against its manifest."""
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
    return Served(manifest, cfg, emb, ids, sid, schema, version_of(manifest))
