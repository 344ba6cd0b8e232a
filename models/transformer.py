"""Transformer tower (SASRec, Llama-style blocks): pre-norm, softmax attention via SDPA.

On jagged rows x [T, D]: the feed-forward runs on the T real rows only; attention pads
q, k, v to the batch's longest sequence and calls ``scaled_dot_product_attention`` with
the same mask HSTU uses (causal, plus target-aware candidates when ``num_targets`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from genrec.kernels.hstu_attention import attention_mask
from genrec.kernels.jagged import jagged_index, jagged_to_padded, padded_to_jagged
from genrec.models.dropout import Dropout
from genrec.models.hstu import CachedHistory, JaggedMeta, KVDims


@dataclass(frozen=True)
class TransformerConfig:
    num_layers: int = 2
    num_heads: int = 2
    ffn_mult: float = 4.0
    dropout: float = 0.2
    activation: Literal["swiglu", "gelu"] = "swiglu"


class FeedForward(nn.Module):
    def __init__(self, dim: int, cfg: TransformerConfig) -> None:
        super().__init__()
        hidden = int(dim * cfg.ffn_mult)
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            hidden = int(2 * hidden / 3)  # keep the parameter count of a 2-matrix FFN
            self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_in = nn.Linear(dim, hidden, bias=not self.swiglu)
        self.w_out = nn.Linear(hidden, dim, bias=not self.swiglu)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w_gate(x)) * self.w_in(x) if self.swiglu else F.gelu(self.w_in(x))
        return self.w_out(self.dropout(h))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, dim: int) -> None:
        super().__init__()
        if dim % cfg.num_heads:
            raise ValueError(f"transformer: dim {dim} is not divisible by num_heads {cfg.num_heads}")
        self.heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = FeedForward(dim, cfg)
        self.dropout = Dropout(cfg.dropout)
        self.attn_dropout = cfg.dropout

    def attend(self, x: torch.Tensor, meta: JaggedMeta, mask: torch.Tensor, index, cache: list | None = None) -> torch.Tensor:
        t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.attn_norm(x)).view(t, 3, h, d // h).unbind(1)
        if cache is not None:
            cache.append((k, v))
        n = meta.max_len
        pad = [jagged_to_padded(z, meta.offsets, n, index=index).transpose(1, 2) for z in (q, k, v)]
        out = F.scaled_dot_product_attention(
            *pad, attn_mask=mask, dropout_p=self.attn_dropout if self.training else 0.0
        )
        return padded_to_jagged(out.transpose(1, 2), meta.offsets, index=index).reshape(t, d)

    def forward(self, x: torch.Tensor, meta: JaggedMeta, mask: torch.Tensor, index, cache: list | None = None) -> torch.Tensor:
        x = x + self.dropout(self.o(self.attend(x, meta, mask, index, cache)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))

    def forward_cached(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], hist: CachedHistory,
                       owner: torch.Tensor) -> torch.Tensor:
        """Candidates [C, D]: softmax attention over their user's cached history and themselves."""
        c, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.attn_norm(x)).view(c, 3, h, d // h).unbind(1)
        lengths = hist.offsets[1:] - hist.offsets[:-1]
        n = max(int(lengths.max()) if lengths.numel() else 0, 1)
        kp = torch.cat([jagged_to_padded(kv[0], hist.offsets, n)[owner], k[:, None]], 1)  # [C, L+1, H, D]
        vp = torch.cat([jagged_to_padded(kv[1], hist.offsets, n)[owner], v[:, None]], 1)
        ar = torch.arange(n + 1, device=x.device)
        mask = (ar[None, :] < lengths[owner][:, None]) | (ar[None, :] == n)  # history + self
        out = F.scaled_dot_product_attention(q[:, :, None], kp.transpose(1, 2), vp.transpose(1, 2),
                                             attn_mask=mask[:, None, None, :])
        x = x + self.o(out.reshape(c, d))
        return x + self.ffn(self.ffn_norm(x))


class TransformerTower(nn.Module):
    """Pre-norm transformer on jagged rows: x [T, D] -> [T, D]."""

    def __init__(self, cfg: TransformerConfig, dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, dim
        self.layers = nn.ModuleList(TransformerLayer(cfg, dim) for _ in range(cfg.num_layers))
        self.final_norm = nn.RMSNorm(dim)

    def kv_dims(self) -> KVDims:
        """The shape of the keys / values it caches per token (its layers and heads)."""
        head = self.dim // self.cfg.num_heads
        return KVDims(self.cfg.num_layers, self.cfg.num_heads, head, head)

    def forward(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None,
                last_only: bool = False) -> torch.Tensor:
        lengths = meta.offsets[1:] - meta.offsets[:-1]
        n = meta.max_len
        mask = attention_mask(lengths, n, meta.num_targets)
        # Padded query rows would attend to nothing (NaN through softmax, which then leaks
        # into the gradients of real keys); letting every row see itself keeps them finite.
        mask = (mask | torch.eye(n, dtype=torch.bool, device=mask.device))[:, None]
        index = jagged_index(meta.offsets, x.shape[0])
        for layer in self.layers:
            x = layer(x, meta, mask, index, cache)
        return self.final_norm(x[meta.offsets[1:] - 1] if last_only else x)

    def forward_cached(self, x: torch.Tensor, hist: CachedHistory, owner: torch.Tensor) -> torch.Tensor:
        for layer, kv in zip(self.layers, hist.layers):
            x = layer.forward_cached(x, kv, hist, owner)
        return self.final_norm(x)

    def encode_history(self, x: torch.Tensor, meta: JaggedMeta, backend: str = "torch",
                       l2: bool = False) -> tuple[torch.Tensor, CachedHistory]:
        """As :meth:`models.hstu.HSTUTower.encode_history` (PyTorch only: no fused ``l2``)."""
        if backend != "torch" or l2:
            raise ValueError(f"the transformer tower runs in PyTorch only, not backend '{backend}'")
        layers: list = []
        h = self(x, meta, cache=layers, last_only=True)
        request = meta.query_times[meta.offsets[1:] - 1] if meta.query_times is not None else None
        return h, CachedHistory(layers, meta.offsets, meta.timestamps, request)

    def extend(self, x: torch.Tensor, hist: CachedHistory, owner: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        """As :meth:`models.hstu.HSTUTower.extend` (PyTorch only)."""
        if backend != "torch":
            raise ValueError(f"the transformer tower runs in PyTorch only, not backend '{backend}'")
        return self.forward_cached(x, hist, owner)

    def native_supported(self) -> bool:
        return False
