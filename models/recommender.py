"""The generative recommender: sparse arch -> input preprocessing -> tower -> heads.

Data flow for one batch (see ``models.inputs.SequenceBatch``)::

    seq KJT --SparseArch--> item (+ action, ...) rows --models.tokens--> tokens [M, D]
        --* sqrt(D) + position embedding, dropout--> x [M, D]
        --HSTU / transformer tower--> h [M, D]
        --retrieval head (history rows)--> next-item loss | user vectors [B, D]
        --ranking head (candidate rows, + pooled context)--> task logits [C, tasks]
        --sigmoid, calibrator (RankingHead.probabilities)--> task probabilities [C, tasks]

The same module is used by training, evaluation, quantization and serving; nothing here
knows about distribution (TorchRec DMP wraps ``self.sparse`` from outside).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from genrec.embedding.collection import SparseArch
from genrec.embedding.spec import EmbeddingConfig
from genrec.kernels.jagged import jagged_index
from genrec.models.dropout import Dropout
from genrec.models.hstu import CachedHistory, HSTUConfig, HSTUTower, JaggedMeta, TowerBackend
from genrec.models.inputs import SequenceBatch
from genrec.models.ranking import RankingConfig, RankingHead
from genrec.models.retrieval import RetrievalConfig, RetrievalHead
from genrec.models.sid import SemanticIds
from genrec.models.sid_decoder import SIDConfig, SIDDecoder
from genrec.models.tokens import Tokens, layout
from genrec.models.transformer import TransformerConfig, TransformerTower


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["generative", "dlrm"] = "generative"  # dlrm: the pooled ranking baseline
    tower: Literal["hstu", "transformer"] = "hstu"
    max_seq_len: int = 200
    input_dropout: float = 0.2
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    sid: SIDConfig = field(default_factory=SIDConfig)  # the generative (semantic-ID) retrieval head

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError("model.max_seq_len must be at least 2")


@dataclass
class HistoryState:
    """Encoded histories of a batch of users, reusable for any number of candidates."""

    history: CachedHistory
    lengths: torch.Tensor  # [B] history tokens per user (the candidates' position)
    context: torch.Tensor | None  # [B, E] pooled context, when the ranking head uses it


def build_tower(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.tower == "hstu":
        return HSTUTower(cfg.hstu, dim, cfg.max_seq_len)
    return TransformerTower(cfg.transformer, dim, cfg.max_seq_len)


class GenerativeRecommender(nn.Module):
    """Example: ``model(batch)["loss"]`` -> scalar; ``model.user_embeddings(batch)`` -> [B, D];
    ``model.item_embeddings(ids)`` -> [N, D]; ``model.rank(batch)`` -> [C, tasks];
    ``model.corpus_ids`` -> [N] sorted catalogue."""

    def __init__(self, cfg: ModelConfig, embedding: EmbeddingConfig, corpus_ids: torch.Tensor,
                 sparse_device: torch.device | None = None, sid: SemanticIds | None = None) -> None:
        """``sparse_device="meta"`` skips allocating the float tables (for a server that
        installs quantized ones, or a sharder that places them). ``sid``: the catalogue's
        semantic IDs, required with ``cfg.sid.enabled`` (a checkpoint's state then replaces
        them with the ones it was trained with)."""
        super().__init__()
        self.cfg, self.embedding_cfg = cfg, embedding
        dim = embedding.dim
        self.item_feature = embedding.item_feature
        self.sparse = SparseArch(embedding, device=sparse_device)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, dim)
        nn.init.normal_(self.pos_emb.weight, std=dim**-0.5)
        self.input_dropout = Dropout(cfg.input_dropout)
        self.scale = math.sqrt(dim)
        self.tower = build_tower(cfg, dim)
        self.head = RetrievalHead(cfg.retrieval)
        self.register_buffer("corpus_ids", torch.sort(corpus_ids.long()).values)
        self.interleaved = cfg.ranking.encoding == "interleaved"
        self.ranking: RankingHead | None = None
        self.ranking_context = False
        if cfg.ranking.enabled:
            # the EmbeddingBagCollection pools each feature on its own: a table's dim per feature it reads
            ctx_dim = sum(t.dim * len(t.features) for t in embedding.pooled_tables) if cfg.ranking.use_context else 0
            self.ranking_context = ctx_dim > 0
            self.ranking = RankingHead(cfg.ranking, dim, ctx_dim)
        self.sid_head: SIDDecoder | None = None
        if cfg.sid.enabled:
            if sid is None:
                raise ValueError("model.sid.enabled needs the catalogue's semantic IDs (model.sid.codebook)")
            self.sid_head = SIDDecoder(cfg.sid, dim, sid)

    def _tokens(self, batch: SequenceBatch) -> tuple[torch.Tensor, Tokens]:
        tok = layout(self.sparse(batch.seq), batch, self.item_feature, self.interleaved)
        # candidates share one position, so only the history is bounded by max_seq_len
        longest = tok.max_len if tok.num_targets is None else int(tok.positions.max()) + 1
        if longest > self.cfg.max_seq_len:
            raise ValueError(
                f"a history of {longest} tokens exceeds model.max_seq_len "
                f"{self.cfg.max_seq_len}; truncate it before the model"
            )
        x = (tok.x * self.scale).to(self.dense_dtype) + self.pos_emb(tok.positions)
        return self.input_dropout(x), tok

    @property
    def dense_dtype(self) -> torch.dtype:
        """What the tower and heads compute in (fp32, or bf16 for a low-precision serving
        artifact); embedding rows arrive in fp32 and are cast once at the tower's input."""
        return self.pos_emb.weight.dtype

    def encode(self, batch: SequenceBatch) -> tuple[torch.Tensor, Tokens]:
        """Tower outputs for every token: [M, D] (and the batch's token layout)."""
        x, tok = self._tokens(batch)
        meta = JaggedMeta(tok.offsets, tok.max_len, tok.timestamps, tok.query_times, tok.num_targets)
        return self.tower(x, meta), tok

    def _context(self, batch: SequenceBatch, tok: Tokens) -> torch.Tensor | None:
        if self.ranking is None or not self.ranking_context:
            return None
        if batch.context is None:
            raise ValueError("this model ranks with context features; the batch has none (data.context_features)")
        ctx = self.sparse.pooled(batch.context).values()  # [B, E]
        return torch.repeat_interleave(ctx, tok.num_targets, dim=0, output_size=tok.candidate_rows.numel())

    def _is_history(self, batch: SequenceBatch) -> torch.Tensor:
        """[events] whether each event of the item feature is history (not a trailing candidate)."""
        item = batch.seq[self.item_feature]
        seg, pos = jagged_index(item.offsets(), item.values().numel())
        return pos < (item.lengths() - batch.num_targets)[seg]

    def rank_logits(self, h: torch.Tensor, tok: Tokens, batch: SequenceBatch) -> torch.Tensor:
        """Task logits of the candidates: [C, tasks]."""
        items = batch.seq[self.item_feature].values()
        rows = self.sparse.lookup(items[~self._is_history(batch)])
        return self.ranking(h[tok.candidate_rows], rows, self._context(batch, tok))

    def forward(self, batch: SequenceBatch) -> dict[str, torch.Tensor]:
        """Training losses: ``loss`` (the weighted total), ``retrieval`` and, with ranking,
        ``ranking`` and one per task. Every history position predicts the next item
        (``batch.targets``); candidates (``num_targets``) predict their labels."""
        h, tok = self.encode(batch)
        out: dict[str, torch.Tensor] = {}
        history = None
        if self.cfg.retrieval.exclude_history:  # the history's item ids and lengths, candidates left out
            item = batch.seq[self.item_feature]
            if batch.num_targets is None:
                history = (item.values(), item.lengths())
            else:
                history = (item.values()[self._is_history(batch)], item.lengths() - batch.num_targets)
        ret = self.head.loss(h[tok.retrieval_rows], batch.targets, self.corpus_ids, self.sparse.lookup, history)
        out["retrieval"] = ret
        total = ret
        if self.ranking is not None and batch.num_targets is not None and tok.candidate_rows.numel():
            out.update(self.ranking.loss(self.rank_logits(h, tok, batch), batch.labels))
            total = self.cfg.ranking.retrieval_weight * ret + out["ranking"]
        if self.sid_head is not None:
            out["sid"] = self.sid_head.loss(h[tok.retrieval_rows], batch.targets)
            total = total + self.cfg.sid.weight * out["sid"]
        out["loss"] = total
        return out

    def user_states(self, batch: SequenceBatch) -> torch.Tensor:
        """The tower's output after each history's last event: [B, D] (what the retrieval
        head normalises into the user vector and the semantic-ID decoder is prompted with)."""
        h, tok = self.encode(batch)
        return h[tok.last_rows]

    def user_embeddings(self, batch: SequenceBatch) -> torch.Tensor:
        """Normalised user vector after each history's last event: [B, D]."""
        return self.head.normalize(self.user_states(batch).float())

    def generate(self, batch: SequenceBatch, beam: int | None = None, exclude_history: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generative retrieval: the ``beam`` (default ``model.sid.beam_width``) items the
        semantic-ID decoder finds most probable after each history, best first: item ids
        [B, K] (-1: no more codes) and log-probabilities [B, K]; with ``exclude_history``
        the items of the batch's ``seen_ids`` are left out."""
        if self.sid_head is None:
            raise ValueError("this model has no semantic-ID decoder (model.sid)")
        seen = (batch.seen_ids, batch.seen_lengths) if exclude_history and batch.seen_ids is not None else None
        return self.sid_head.beam_search(self.user_states(batch), beam or self.cfg.sid.beam_width, seen)

    def rank(self, batch: SequenceBatch, calibrated: bool = True) -> torch.Tensor:
        """Task probabilities of each candidate (the trailing ``num_targets`` events): [C, tasks]
        (``calibrated=False``: the sigmoid alone, what the calibrator is fitted on)."""
        if self.ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        h, tok = self.encode(batch)
        return self.ranking.probabilities(self.rank_logits(h, tok, batch), calibrated)

    def encode_history(self, batch: SequenceBatch, backend: TowerBackend = "torch") -> tuple[torch.Tensor, HistoryState]:
        """Encodes histories once (``batch`` without candidates): the normalised user vectors
        [B, D] for retrieval, and the per-layer keys/values candidates are later scored
        against (:meth:`score_candidates`), so the history is never encoded twice."""
        x, tok = self._tokens(batch)
        meta = JaggedMeta(tok.offsets, tok.max_len, tok.timestamps, tok.query_times, tok.num_targets)
        ctx = None
        if self.ranking is not None and self.ranking_context:
            if batch.context is None:
                raise ValueError("this model ranks with context features; the batch has none")
            ctx = self.sparse.pooled(batch.context).values()
        return self.encode_history_tokens(x, meta, ctx, backend)

    def encode_history_tokens(self, x: torch.Tensor, meta: JaggedMeta, context: torch.Tensor | None = None,
                              backend: TowerBackend = "torch") -> tuple[torch.Tensor, HistoryState]:
        """:meth:`encode_history` from the token inputs x [T, D] (:meth:`summed_tokens`, or a
        serving kernel's gather of the same rows) of histories ``meta`` (no targets), with the
        users' pooled ``context`` [B, E] when the ranking head reads it. ``backend``: how the
        tower runs (``HSTUTower.encode_history``)."""
        fused = backend == "native" and self.head.cfg.l2_norm  # the head's normalization in the kernel's pass
        h, hist = self.tower.encode_history(x, meta, backend, l2=fused)  # [B, D]: each history's last row
        users = h.float() if fused else self.head.normalize(h.float())
        return users, HistoryState(hist, torch.diff(meta.offsets), context)

    def summed_tokens(self, items: torch.Tensor, actions: torch.Tensor | None,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token inputs of the summed encoding: (item rows, (item row + action row) * sqrt(D)
        + position row), both [N, D], for item ids, action ids (None: no action table) and
        positions [N]; what ``models.tokens`` makes of a batch, without the jagged layout."""
        rows = self.sparse.lookup(items)
        x = rows if actions is None else rows + self.sparse.lookup(actions, "action")
        return rows, (x * self.scale).to(self.dense_dtype) + self.pos_emb(positions)

    def extend(self, state: HistoryState, x: torch.Tensor, owner: torch.Tensor,
               backend: TowerBackend = "torch") -> torch.Tensor:
        """Candidates' tower outputs [C, D] from their token inputs x [C, D] (at position
        ``state.lengths[owner]``), for users ``owner`` [C] of the encoded batch."""
        return self.tower.extend(x, state.history, owner, backend)

    def score_candidates(self, state: HistoryState, items: torch.Tensor, owner: torch.Tensor,
                         backend: TowerBackend = "torch") -> torch.Tensor:
        """Task probabilities [C, tasks] of candidate ``items`` [C] for users ``owner`` [C]
        (indices into the encoded batch): equal to appending them as targets to the history."""
        if self.ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        has_action = "action" in self.sparse.sequence_features and not self.interleaved
        rows, x = self.summed_tokens(items, torch.zeros_like(items) if has_action else None,  # unknown action
                                     state.lengths[owner])
        h = self.extend(state, x, owner, backend)
        ctx = state.context[owner] if state.context is not None else None
        return self.ranking.probabilities(self.ranking(h, rows, ctx))

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Normalised item vectors: ids [N] -> [N, D]."""
        return self.head.normalize(self.sparse.lookup(ids))
