"""A pooled-embedding DLRM-style ranking baseline on the same features as the sequential model.

Per candidate, the features are vectors of one width D: the user's history items pooled
(mean), their actions pooled (mean), the candidate item, and each context feature
(projected to D). DLRM's interaction takes all pairwise dot products, concatenates them
with the candidate vector and feeds a top MLP with one logit per task (Naumov et al. 2019).
No attention, no order: what the sequence model adds over it is what the benchmark shows.

Input: the same ``SequenceBatch`` the generative model ranks (history + candidates).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from genrec.embedding.collection import pooled_table_configs
from genrec.embedding.spec import EmbeddingConfig
from genrec.kernels.jagged import jagged_index
from genrec.models.inputs import SequenceBatch
from genrec.models.ranking import RankingConfig, RankingHead

HIST, HIST_ACTION, CAND = "dlrm_hist_item", "dlrm_hist_action", "dlrm_cand_item"


class PooledDLRM(nn.Module):
    def __init__(self, ranking: RankingConfig, embedding: EmbeddingConfig) -> None:
        super().__init__()
        if not ranking.enabled:
            raise ValueError("the DLRM baseline ranks: configure model.ranking.tasks")
        self.cfg, self.embedding_cfg = ranking, embedding
        self.item_feature = embedding.item_feature
        d = embedding.dim
        item, action = embedding.item_table, embedding.table_of("action")
        tables = [
            EmbeddingBagConfig(name="hist_item", embedding_dim=d, num_embeddings=item.num_embeddings,
                               feature_names=[HIST], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="hist_action", embedding_dim=d, num_embeddings=action.num_embeddings,
                               feature_names=[HIST_ACTION], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="cand_item", embedding_dim=d, num_embeddings=item.num_embeddings,
                               feature_names=[CAND], pooling=PoolingType.SUM),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables)
        for t in tables:
            nn.init.normal_(self.ebc.embedding_bags[t.name].weight, std=0.02)
        use_ctx = bool(embedding.pooled_tables) and ranking.use_context
        self.context = EmbeddingBagCollection(tables=pooled_table_configs(embedding)) if use_ctx else None
        # one projection per pooled feature (a table may pool several features, each its own vector)
        self.ctx_features = [(f, t.dim) for t in embedding.pooled_tables for f in t.features] if use_ctx else []
        self.ctx_proj = nn.ModuleList(nn.Linear(dim, d) for _, dim in self.ctx_features) if use_ctx else None
        n = 3 + len(self.ctx_features)
        pairs = n * (n - 1) // 2
        # the ranking head's MLP takes [h, e, h * e, ctx]; here h = interactions padded to D
        self.inter = nn.Linear(pairs, d)
        self.head = RankingHead(ranking, d, 0)
        self.register_buffer("corpus_ids", torch.zeros(0, dtype=torch.long))

    def _split(self, batch: SequenceBatch) -> tuple[torch.Tensor, ...]:
        jt_item = batch.seq[self.item_feature]
        values, offsets = jt_item.values(), jt_item.offsets()
        actions = batch.seq["action"].values()
        seg, pos = jagged_index(offsets, values.numel())
        lengths = offsets[1:] - offsets[:-1]
        hist_len = lengths - batch.num_targets
        is_hist = pos < hist_len[seg]
        return values, actions, is_hist, hist_len

    def features(self, batch: SequenceBatch) -> torch.Tensor:
        """[C, n, D]: per candidate, the stacked feature vectors."""
        values, actions, is_hist, hist_len = self._split(batch)
        b, c = batch.batch_size, int(batch.num_targets.sum())
        zeros_b, zeros_c = torch.zeros(b, dtype=torch.long), torch.zeros(c, dtype=torch.long)
        user = KeyedJaggedTensor(keys=[HIST, HIST_ACTION, CAND],
                                 values=torch.cat([values[is_hist], actions[is_hist]]),
                                 lengths=torch.cat([hist_len, hist_len, zeros_b]))
        cand = KeyedJaggedTensor(keys=[HIST, HIST_ACTION, CAND], values=values[~is_hist],
                                 lengths=torch.cat([zeros_c, zeros_c, torch.ones(c, dtype=torch.long)]))
        pooled = self.ebc(user)
        per_user = [pooled[HIST], pooled[HIST_ACTION]]
        if self.context is not None:
            ctx = self.context(batch.context)
            per_user += [proj(ctx[f]) for proj, (f, _) in zip(self.ctx_proj, self.ctx_features, strict=True)]
        rep = [torch.repeat_interleave(v, batch.num_targets, dim=0, output_size=c) for v in per_user]
        return torch.stack([self.ebc(cand)[CAND], *rep], dim=1)

    def rank_logits(self, batch: SequenceBatch) -> torch.Tensor:
        f = self.features(batch)  # [C, n, D]
        dots = f @ f.transpose(1, 2)
        iu = torch.triu_indices(f.shape[1], f.shape[1], offset=1)
        inter = self.inter(dots[:, iu[0], iu[1]])
        return self.head(inter, f[:, 0])

    def forward(self, batch: SequenceBatch) -> dict[str, torch.Tensor]:
        if batch.num_targets is None:
            raise ValueError("the DLRM baseline trains on candidates only: set data.ranking.candidate_prob = 1")
        out = self.head.loss(self.rank_logits(batch), batch.labels)
        out["loss"] = out["ranking"]
        return out

    @property
    def ranking(self) -> RankingHead:
        """The ranking head, by the name the generative model gives it (evaluation and
        calibration reach both models' heads, and so their calibrators, through it)."""
        return self.head

    def rank(self, batch: SequenceBatch, calibrated: bool = True) -> torch.Tensor:
        """Task probabilities [C, tasks], calibrated as ``GenerativeRecommender.rank``."""
        return self.head.probabilities(self.rank_logits(batch), calibrated)
