"""The generative recommender: sparse arch -> input preprocessing -> tower -> heads.

Data flow for one batch (see ``models.inputs.SequenceBatch``)::

    seq KJT --SparseArch--> item rows [T, D] (+ other sequence features, summed)
        --* sqrt(D) + position embedding, dropout--> x [T, D]
        --HSTU / transformer tower--> h [T, D]
        --retrieval head--> loss (training) | user vectors [B, D] at each last position

The same module is used by training, evaluation, quantization and serving; nothing here
knows about distribution (TorchRec DMP wraps ``self.sparse`` from outside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from embedding.collection import SparseArch
from embedding.spec import EmbeddingConfig
from kernels.jagged import jagged_index
from models.hstu import HSTUConfig, HSTUTower, JaggedMeta
from models.inputs import SequenceBatch
from models.retrieval import RetrievalConfig, RetrievalHead
from models.transformer import TransformerConfig, TransformerTower


@dataclass(frozen=True)
class ModelConfig:
    tower: Literal["hstu", "transformer"] = "hstu"
    max_seq_len: int = 200
    input_dropout: float = 0.2
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError("model.max_seq_len must be at least 2")


def build_tower(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.tower == "hstu":
        return HSTUTower(cfg.hstu, dim, cfg.max_seq_len)
    return TransformerTower(cfg.transformer, dim, cfg.max_seq_len)


class GenerativeRecommender(nn.Module):
    """Example: ``model(batch)`` -> scalar loss; ``model.user_embeddings(batch)`` -> [B, D];
    ``model.item_embeddings(ids)`` -> [N, D]; ``model.corpus_ids`` -> [N] sorted catalogue."""

    def __init__(self, cfg: ModelConfig, embedding: EmbeddingConfig, corpus_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg, self.embedding_cfg = cfg, embedding
        dim = embedding.dim
        self.item_feature = embedding.item_feature
        self.sparse = SparseArch(embedding)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, dim)
        nn.init.normal_(self.pos_emb.weight, std=dim**-0.5)
        self.input_dropout = nn.Dropout(cfg.input_dropout)
        self.scale = math.sqrt(dim)
        self.tower = build_tower(cfg, dim)
        self.head = RetrievalHead(cfg.retrieval)
        self.register_buffer("corpus_ids", torch.sort(corpus_ids.long()).values)

    def _meta_and_input(self, batch: SequenceBatch) -> tuple[torch.Tensor, JaggedMeta]:
        jts = self.sparse(batch.seq)
        item = jts[self.item_feature]
        offsets = item.offsets()
        x = item.values()
        for name, jt in jts.items():
            if name != self.item_feature:
                x = x + jt.values()
        seg, pos = jagged_index(offsets, x.shape[0])
        if batch.max_len > self.cfg.max_seq_len:
            raise ValueError(
                f"a sequence of {batch.max_len} events exceeds model.max_seq_len "
                f"{self.cfg.max_seq_len}; truncate it before the model"
            )
        x = x * self.scale + self.pos_emb(pos)
        ts = qt = None
        if batch.has_time is not None and batch.timestamps is not None:
            # Users without timestamps fall back to positions: event j at time j, queried
            # at j + 1, so the time bias still sees a recency signal.
            real = batch.has_time[seg]
            ts = torch.where(real, batch.timestamps, pos)
            qt = torch.where(real, batch.query_times, pos + 1)
        else:
            ts, qt = pos, pos + 1
        meta = JaggedMeta(offsets, batch.max_len, ts, qt, batch.num_targets)
        return self.input_dropout(x), meta

    def encode(self, batch: SequenceBatch) -> tuple[torch.Tensor, JaggedMeta]:
        """Tower outputs for every event: [T, D] (and the batch's jagged structure)."""
        x, meta = self._meta_and_input(batch)
        return self.tower(x, meta), meta

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        """Training loss: every position predicts the next item (``batch.targets`` [T])."""
        h, _ = self.encode(batch)
        return self.head.loss(h, batch.targets, self.corpus_ids, self.sparse.lookup)

    def user_embeddings(self, batch: SequenceBatch) -> torch.Tensor:
        """Normalised user vector after each sequence's last event: [B, D]."""
        h, meta = self.encode(batch)
        return self.head.normalize(h[meta.offsets[1:] - 1])

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Normalised item vectors: ids [N] -> [N, D]."""
        return self.head.normalize(self.sparse.lookup(ids))
