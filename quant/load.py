"""Artifact -> model ready to serve. Serving imports this, never the training code that
writes artifacts (quant/convert.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from genrec.config import from_dict
from genrec.embedding.spec import EmbeddingConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.models.sid import KEYS as SID_KEYS
from genrec.models.sid import SemanticIdError, SemanticIds
from genrec.quant.artifact import ArtifactError, Manifest, check_artifact, load_tensors
from genrec.quant.dense import load_dense
from genrec.quant.embeddings import install, quantized_modules, served_rows
from genrec.quant.pages import on_huge_pages

SID_PREFIX = "sid_head.book_"  # the decoder's codebook in dense.safetensors: book_item_ids, book_codes, book_sizes


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[GenerativeRecommender, Manifest]:
    """The servable model of an artifact (verified); quantized tables run fbgemm's kernels.
    A model with a semantic-ID decoder (``model.sid.enabled``) gets its codebook from the
    artifact's ``sid_head.book_*`` tensors."""
    device = torch.device(device)
    manifest, tensors = load_tensors(path, check_artifact(path))
    try:
        model_cfg = from_dict(ModelConfig, manifest.model)
        emb_cfg = from_dict(EmbeddingConfig, manifest.embedding)
    except ValueError as e:
        raise ArtifactError(f"{path}/manifest.json: model or embedding config is invalid: {e}") from e
    dense = tensors["dense.safetensors"]
    if "corpus_ids" not in dense:
        raise ArtifactError(f"{path}/dense.safetensors: tensor 'corpus_ids' is missing")
    q = manifest.quantization
    sid = artifact_semantic_ids(dense, path) if model_cfg.sid.enabled else None
    model = GenerativeRecommender(model_cfg, emb_cfg, dense["corpus_ids"], sparse_device=torch.device("meta"), sid=sid)
    emb = tensors["embeddings.safetensors"]
    # every sequence lookup of inference reads the served rows (SparseArch's direct path): a
    # quantized EmbeddingCollection beside them would hold a second, padded copy of every row
    # that serving never reads (80 bytes an int8 row at D = 64: 0.8 GB at 10^7 items)
    _, ebc = quantized_modules(emb_cfg, emb, q["embeddings"], q.get("row_alignment", 16), sequence=False)
    install(model.sparse, None, ebc, served_rows(emb_cfg, emb, q["embeddings"]),
            served_rows(emb_cfg, emb, q["embeddings"], pooled=True))
    del emb, tensors  # (the served rows are packed copies: the file's tensors go now, not at return)
    load_dense(model, dense, q["dense"], device)
    model.corpus_ids = on_huge_pages(model.corpus_ids)  # the catalogue's ids, read at random by retrieval
    if model.ranking is not None:
        try:
            model.ranking.calibrator.validate()
        except ValueError as e:
            raise ArtifactError(f"{path}/dense.safetensors: the ranking calibrator is invalid: {e}") from e
    model = model.to(device).eval()
    if model.sid_head is not None:  # the trie is no module state: .to() leaves it where it was built
        model.sid_head.sid = model.sid_head.sid.to(device)
    return model, manifest


def artifact_semantic_ids(dense: dict[str, torch.Tensor], path: str | Path) -> SemanticIds:
    """The codebook stored with the decoder (``sid_head.book_*``, int64), validated."""
    missing = [SID_PREFIX + k for k in SID_KEYS if SID_PREFIX + k not in dense]
    if missing:
        raise ArtifactError(f"{path}/dense.safetensors: the model has a semantic-ID decoder (model.sid.enabled) "
                            f"but tensor '{missing[0]}' is missing; re-export it with 'genrec quantize'")
    book = {k: dense[SID_PREFIX + k] for k in SID_KEYS}
    for k, t in book.items():
        if t.dtype != torch.int64:
            raise ArtifactError(f"{path}/dense.safetensors: tensor '{SID_PREFIX}{k}' is {t.dtype}; a codebook is int64")
    try:
        return SemanticIds.from_state_dict(book)
    except SemanticIdError as e:
        raise ArtifactError(f"{path}/dense.safetensors: the semantic-ID codebook is invalid: {e}") from e
