"""HSTU tower (Hierarchical Sequential Transduction Units, Zhai et al. 2024).

One layer, on jagged rows x [T, D]::

    u, v, q, k = split(SiLU(W_uvqk LayerNorm(x)))
    a          = hstu_attention(q, k, v)          # pointwise SiLU attention + rel. bias
    x          = x + W_o Dropout(u * LayerNorm(a))  # U-gating

Relative bias = learned weight per position distance + learned weight per log-bucketed
time gap (``query_time_i - time_j``). Sequences without timestamps use positions as times
(the caller fills them; see ``models.recommender``).

:meth:`HSTUTower.forward_padded` is the naive padded formulation over [B, L, D] with the
same parameters: the reference for the jagged path in tests and the baseline in the
training-speed benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from genrec.kernels.hstu_attention import (
    attention_mask,
    hstu_attention,
    hstu_cached_attention,
    hstu_last_row_attention,
    time_bucket,
    token_positions,
)
from genrec.models.dropout import Dropout


@dataclass(frozen=True)
class HSTUConfig:
    num_layers: int = 2
    num_heads: int = 1
    qk_dim: int = 64  # per head
    v_dim: int = 64  # per head; also the width of the U gate
    dropout: float = 0.2
    position_bias: bool = True
    time_bias: bool = True
    num_time_buckets: int = 64
    attention_backend: Literal["auto", "reference", "triton"] = "auto"


@dataclass
class CachedHistory:
    """What candidates need of an encoded history: per-layer keys/values of its tokens."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), [Th, H, D]
    offsets: torch.Tensor  # [B+1] token offsets
    times: torch.Tensor  # [Th] token times (positions where users have no timestamps)
    request_times: torch.Tensor  # [B] the time candidates are scored at


@dataclass
class JaggedMeta:
    """Per-batch structure shared by every layer (computed once per forward)."""

    offsets: torch.Tensor  # [B+1]
    max_len: int  # longest sequence in the batch
    timestamps: torch.Tensor | None  # [T]
    query_times: torch.Tensor | None  # [T]
    num_targets: torch.Tensor | None  # [B]
    plan: dict = field(default_factory=dict)  # what every layer's attention shares (bias codes, layout)


class HSTULayer(nn.Module):
    def __init__(self, cfg: HSTUConfig, dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        h = cfg.num_heads
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, h * (2 * cfg.v_dim + 2 * cfg.qk_dim))
        self.out_norm = nn.LayerNorm(h * cfg.v_dim)
        self.out = nn.Linear(h * cfg.v_dim, dim)
        self.dropout = Dropout(cfg.dropout)
        self.pos_weights = nn.Parameter(torch.empty(max_seq_len)) if cfg.position_bias else None
        self.time_weights = (
            nn.Parameter(torch.empty(cfg.num_time_buckets)) if cfg.time_bias else None
        )
        self.alpha = cfg.qk_dim**-0.5
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.pos_weights, self.time_weights):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> u [..., H * Dv] (the gate) and v, q, k per head: [..., H, D]."""
        c, h = self.cfg, self.cfg.num_heads
        uvqk = F.silu(self.uvqk(self.norm(x)))
        u, v, q, k = torch.split(uvqk, [h * c.v_dim, h * c.v_dim, h * c.qk_dim, h * c.qk_dim], dim=-1)
        return u, v.unflatten(-1, (h, c.v_dim)), q.unflatten(-1, (h, c.qk_dim)), k.unflatten(-1, (h, c.qk_dim))

    def _gate(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + U-gated output; ``attn`` [..., H, Dv]."""
        return x + self.out(self.dropout(u * self.out_norm(attn.flatten(-2))))

    def forward(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]; appends this layer's (k, v) [T, H, D] to ``cache`` if given."""
        u, v, q, k = self._split(x)
        if cache is not None:
            cache.append((k, v))
        attn = hstu_attention(
            q,
            k,
            v,
            meta.offsets,
            max_seq_len=self.max_seq_len,
            alpha=self.alpha,
            pos_weights=self.pos_weights,
            time_weights=self.time_weights,
            timestamps=meta.timestamps,
            query_times=meta.query_times,
            num_targets=meta.num_targets,
            max_len=meta.max_len,
            backend=self.cfg.attention_backend,
            plan=meta.plan,
        )
        return self._gate(x, u, attn)

    def forward_last(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None) -> torch.Tensor:
        """Only each sequence's last row: x [T, D] -> [B, D] (keys and values of every row still
        go to ``cache``). For the last layer at inference, when only that row is read."""
        u, v, q, k = self._split(x)
        if cache is not None:
            cache.append((k, v))
        attn = hstu_last_row_attention(
            q, k, v, meta.offsets, max_seq_len=self.max_seq_len, alpha=self.alpha, pos_weights=self.pos_weights,
            time_weights=self.time_weights, timestamps=meta.timestamps, query_times=meta.query_times)
        last = meta.offsets[1:] - 1
        return self._gate(x[last], u[last], attn)

    def forward_cached(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], hist: CachedHistory,
                       owner: torch.Tensor, plan: dict | None = None) -> torch.Tensor:
        """Candidate rows x [C, D] against the cached history of their users -> [C, D]
        (``plan``: shared by the layers of one call, see ``hstu_cached_attention``)."""
        u, v, q, k = self._split(x)
        attn = hstu_cached_attention(
            q, k, v, kv[0], kv[1], hist.offsets, owner, max_seq_len=self.max_seq_len, alpha=self.alpha, pos_weights=self.pos_weights,
            time_weights=self.time_weights, hist_times=hist.times, request_times=hist.request_times, plan=plan)
        return self._gate(x, u, attn)

    def forward_padded(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor | None,
        query_times: torch.Tensor | None,
        num_targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Naive padded formulation: x [B, L, D], times [B, L] -> [B, L, D]."""
        c, n = self.cfg, x.shape[1]
        u, v, q, k = self._split(x)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.alpha  # [B, H, L, L]
        if self.pos_weights is not None:
            p = token_positions(n, lengths, num_targets)
            dist = (p[:, :, None] - p[:, None, :]).clamp(0, self.max_seq_len - 1)
            scores = scores + self.pos_weights[dist][:, None]
        if self.time_weights is not None:
            dt = query_times[:, :, None] - timestamps[:, None, :]
            scores = scores + self.time_weights[time_bucket(dt, c.num_time_buckets)][:, None]
        mask = attention_mask(lengths, n, num_targets)[:, None]
        attn = F.silu(scores) * mask / self.max_seq_len
        return self._gate(x, u, torch.matmul(attn, v).transpose(1, 2))


class HSTUTower(nn.Module):
    """A stack of HSTU layers on jagged rows: x [T, D] -> [T, D]."""

    def __init__(self, cfg: HSTUConfig, dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HSTULayer(cfg, dim, max_seq_len) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None,
                last_only: bool = False) -> torch.Tensor:
        """``last_only``: return only each sequence's last row, [B, D] (no targets): the last
        layer then attends from that row alone (:meth:`HSTULayer.forward_last`)."""
        if last_only and meta.num_targets is not None:
            raise ValueError("last_only needs sequences without targets")
        for i, layer in enumerate(self.layers):
            if last_only and i == len(self.layers) - 1:
                return self.final_norm(layer.forward_last(x, meta, cache))
            x = layer(x, meta, cache)
        return self.final_norm(x[meta.offsets[1:] - 1] if last_only else x)

    def forward_cached(self, x: torch.Tensor, hist: CachedHistory, owner: torch.Tensor) -> torch.Tensor:
        """Candidates [C, D] of users ``owner`` [C] against ``hist`` (from ``forward(cache=)``)."""
        plan: dict = {}  # the candidates' grouping and bias codes, computed by the first layer
        for layer, kv in zip(self.layers, hist.layers):
            x = layer.forward_cached(x, kv, hist, owner, plan)
        return self.final_norm(x)

    def forward_padded(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: torch.Tensor | None,
        query_times: torch.Tensor | None,
        num_targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for layer in self.layers:
            x = layer.forward_padded(x, lengths, timestamps, query_times, num_targets)
        return self.final_norm(x)
