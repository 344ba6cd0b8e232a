"""Artifact -> model ready to serve. Serving imports this, never the training code that
writes artifacts (quant/convert.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from genrec.config import from_dict
from genrec.embedding.spec import EmbeddingConfig
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.quant.artifact import ArtifactError, Manifest, check_artifact, load_tensors
from genrec.quant.dense import load_dense
from genrec.quant.embeddings import install, quantized_modules, served_rows


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[GenerativeRecommender, Manifest]:
    """The servable model of an artifact (verified); quantized tables run fbgemm's kernels."""
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
    model = GenerativeRecommender(model_cfg, emb_cfg, dense["corpus_ids"], sparse_device=torch.device("meta"))
    ec, ebc = quantized_modules(emb_cfg, tensors["embeddings.safetensors"], q["embeddings"], q.get("row_alignment", 16))
    emb = tensors["embeddings.safetensors"]
    install(model.sparse, ec, ebc, served_rows(emb_cfg, emb, q["embeddings"]),
            served_rows(emb_cfg, emb, q["embeddings"], pooled=True))
    load_dense(model, dense, q["dense"], device)
    return model.to(device).eval(), manifest
