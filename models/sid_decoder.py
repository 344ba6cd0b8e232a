"""Generative retrieval: the next item decoded as its semantic-ID code, level by level.

The tower's output h at a history position, L2-normalised (the dense user vector: what
every serving path already has), is the decoder's prompt. A small causal
transformer reads ``[proj(h), code_1, ..., code_{L-1}]`` (one token per level) and its
output at token l gives the logits of level l+1's code. Training teacher-forces the next
item's code at every history position of the batch (the positions the retrieval head
trains), so a step adds one short decoder pass per position, not a second tower pass.

Why the tower's own output as the prompt (and not the history's semantic-ID tokens): the
history already goes through the TorchRec item tables and the HSTU tower for dense
retrieval and ranking; conditioning the decoder on that state makes the generative channel
one more head on the same encoder (one pass serves dense retrieval, ranking and decoding),
and the prompt's K/V (the history's) is what SGLang caches across calls.

Every level's softmax is restricted to the codes the code trie admits under the prefix
(``SemanticIds.step``), in training and in decoding, so the decoded probability of an item
is the product of its levels' conditionals over existing codes: a beam can only end on a
real item, and training spends nothing on codes no item has.

``beam_search`` is the PyTorch reference the SGLang model is checked against: it recomputes
the (at most L-token) prefix at each level instead of keeping a K/V cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from genrec.models.sid import SemanticIds

NEG = float("-inf")


@dataclass(frozen=True)
class SIDConfig:
    enabled: bool = False
    codebook: str = ""  # a ``genrec sid build`` file (sid.safetensors); read when the model is built
    num_layers: int = 2
    num_heads: int = 2
    dim: int = 0  # 0: the tower's dimension
    dropout: float = 0.1
    weight: float = 1.0  # the decoder loss's weight beside the retrieval loss
    beam_width: int = 50  # evaluation's beam (decoded items per user)

    def __post_init__(self) -> None:
        if self.enabled and not self.codebook:
            raise ValueError("model.sid.codebook: the semantic-ID file (genrec sid build) is required")
        if self.beam_width < 1:
            raise ValueError("model.sid.beam_width must be at least 1")


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention + MLP over the (at most L) decoder tokens."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.sid: dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, D] -> q, k, v [..., H, T, D/H] of the normed input."""
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        shape = (*x.shape[:-1], self.heads, x.shape[-1] // self.heads)
        return tuple(t.reshape(shape).transpose(-3, -2) for t in (q, k, v))  # type: ignore[return-value]

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x [..., T, D] and attention output [..., H, T, D/H]."""
        a = attn.transpose(-3, -2).reshape(x.shape)
        x = x + self.drop(self.out(a))
        return x + self.drop(self.mlp(self.norm2(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class SIDDecoder(nn.Module):
    """Example: ``loss = dec.loss(h [P, Dt], targets [P])``; ``items, scores = dec.beam_search(h [B, Dt], 20)``."""

    def __init__(self, cfg: SIDConfig, tower_dim: int, sid: SemanticIds) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim or tower_dim
        self.levels = sid.num_levels
        self.sizes = tuple(int(s) for s in sid.sizes)
        self.prompt = nn.Sequential(nn.LayerNorm(tower_dim), nn.Linear(tower_dim, dim))
        # level l's code as the input token l+1 (the last level is never an input)
        self.register_buffer("code_offsets", torch.tensor([0, *self.sizes[:-1]]).cumsum(0)[:-1].clone(),
                             persistent=False)
        self.code_emb = nn.Embedding(max(1, sum(self.sizes[:-1])), dim)
        self.level_emb = nn.Embedding(self.levels, dim)
        for e in (self.code_emb, self.level_emb):
            nn.init.normal_(e.weight, std=dim**-0.5)
        self.blocks = nn.ModuleList(DecoderBlock(dim, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, s) for s in self.sizes)
        self._install(sid)
        self.register_load_state_dict_post_hook(self._rebuild)

    def _install(self, sid: SemanticIds) -> None:
        """The codebook travels in the model's state (checkpoints, artifacts) as ``book_*``
        buffers; the trie is rebuilt whenever they are loaded."""
        self.sid = sid
        for k, v in sid.state_dict().items():
            self.register_buffer(f"book_{k}", v.clone())

    def _rebuild(self, module: nn.Module, incompatible: object) -> None:
        sid = SemanticIds.from_state_dict({k[5:]: b for k, b in self.named_buffers(recurse=False)
                                           if k.startswith("book_")})
        if tuple(int(s) for s in sid.sizes) != self.sizes:
            raise ValueError(f"semantic-ID sizes {tuple(sid.sizes)} differ from the model's {self.sizes}")
        self.sid = sid

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        """``.to(device)`` moves the trie with the buffers (dtype casts leave its ints alone)."""
        super()._apply(fn, recurse)
        self.sid = self.sid.to(self.book_codes.device)
        return self

    def tokens(self, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Decoder inputs [P, 1 + l, d]: the prompt from h [P, Dt], then codes [P, l] (l < L)."""
        x = [self.prompt(F.normalize(h.float(), dim=-1).to(h.dtype))[:, None]]
        if codes.shape[1]:
            x.append(self.code_emb(codes + self.code_offsets[: codes.shape[1]]))
        x = torch.cat(x, 1)
        return x + self.level_emb.weight[: x.shape[1]]

    def hidden(self, h: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        x = self.tokens(h, codes)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def level_logits(self, out: torch.Tensor, level: int, nodes: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [P, sizes[level]] of level ``level`` from the decoder output at
        that token [P, d], over the codes the trie admits under ``nodes`` [P] (others -inf)."""
        logits = self.heads[level](out).float()
        allowed = self.sid.step(nodes, level) >= 0
        return torch.log_softmax(logits.masked_fill(~allowed, NEG), -1)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over positions and levels of the next item's code's negative log-likelihood
        (each level over the codes existing under the true prefix). h [P, Dt], targets [P]
        item ids; ids without a code (not in the catalogue) are left out."""
        codes = self.sid.codes_of(targets)
        keep = codes[:, 0] >= 0
        if not bool(keep.all()):
            h, codes = h[keep], codes[keep]
        if not codes.shape[0]:
            return h.sum() * 0.0
        out = self.hidden(h, codes[:, :-1])
        nodes = torch.zeros(codes.shape[0], dtype=torch.long, device=codes.device)
        total = h.new_zeros((), dtype=torch.float32)
        for level in range(self.levels):
            logp = self.level_logits(out[:, level], level, nodes)
            total = total - logp.gather(1, codes[:, level : level + 1]).mean()
            nodes = self.sid.step(nodes, level).gather(1, codes[:, level : level + 1]).squeeze(1)
        return total / self.levels

    @torch.no_grad()
    def beam_search(self, h: torch.Tensor, beam: int, seen: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``beam`` most probable items per user, best first: items [B, K] (-1 where fewer
        than K codes exist) and their log-probabilities [B, K]. h [B, Dt] prompts; ``seen =
        (item ids, lengths [B])`` leaves each user's own items out (as dense retrieval leaves
        out the history): at every level, a prefix all of whose items the user has is dropped,
        so the beam's K slots go to items that can be returned."""
        b, dev = h.shape[0], h.device
        scores = torch.zeros(b, 1, device=dev)  # [B, k] beams' log-probabilities
        nodes = torch.zeros(b, 1, dtype=torch.long, device=dev)
        codes = torch.zeros(b, 1, 0, dtype=torch.long, device=dev)
        exhausted = self.exhausted(seen) if seen is not None and seen[0].numel() else None
        for level in range(self.levels):
            k = nodes.shape[1]
            safe = nodes.clamp(min=0).reshape(-1)  # a dead beam (-inf) walks on from the root, still -inf
            out = self.hidden(h.repeat_interleave(k, 0), codes.reshape(b * k, level))[:, level]
            scores, parent, code, nodes = self.choose(scores, out, safe, level, beam, exhausted)
            codes = torch.cat([codes.gather(1, parent[:, :, None].expand(-1, -1, level)), code[:, :, None]], 2)
        valid = torch.isfinite(scores) & (nodes >= 0)
        items = torch.where(valid, self.sid.leaf_item[nodes.clamp(min=0)], torch.full_like(nodes, -1))
        scores = scores.masked_fill(~valid, NEG)
        pad = beam - items.shape[1]  # fewer codes than the beam
        return F.pad(items, (0, pad), value=-1), F.pad(scores, (0, pad), value=NEG)

    def choose(self, scores: torch.Tensor, out: torch.Tensor, nodes: torch.Tensor, level: int, beam: int,
               exhausted: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level of the beam: B users' k prefixes with log-probabilities ``scores`` [B, k],
        decoder outputs at this level ``out`` [B * k, d] and nodes [B * k] -> the ``beam`` best
        (prefix, code) pairs per user: their log-probabilities, parent prefix, code and child
        node, each [B, n] (-inf where fewer exist). Children all of whose items ``exhausted``
        (:meth:`exhausted`) says the user has are left out, the rest keep their probability."""
        b, k = scores.shape
        logp = self.level_logits(out, level, nodes).reshape(b, k, -1)
        child = self.sid.step(nodes, level).reshape(b, k, -1)
        if exhausted is not None:  # prefixes whose every item the user has are no use to the beam
            logp = logp.masked_fill(exhausted(child, level + 1), NEG)
        total = (scores[:, :, None] + logp).reshape(b, -1)
        top, idx = total.topk(min(beam, total.shape[1]), dim=1)
        return top, idx // logp.shape[2], idx % logp.shape[2], child.reshape(b, -1).gather(1, idx)

    def _subtree_sizes(self) -> list[torch.Tensor]:
        """Items under each node, per level: [num_nodes(l)] for l = 0..L (level L: ones)."""
        if getattr(self, "_sizes_of", (None,))[0] is not self.sid:
            codes = self.sid.codes
            sizes = [torch.bincount(self.sid.nodes_of(codes[:, :level])) for level in range(self.levels + 1)]
            self._sizes_of = (self.sid, sizes)
        return self._sizes_of[1]

    def exhausted(self, seen: tuple[torch.Tensor, torch.Tensor]) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """A function (child nodes [B, ...] at ``level``, level) -> whether every item under each
        child is in its user's history: a beam there could only end on items left out."""
        ids, lengths = seen
        b = lengths.numel()
        width = int(lengths.max()) if b else 0
        pad = torch.full((b, max(width, 1)), -1, dtype=torch.long, device=ids.device)
        if width:
            row = torch.repeat_interleave(torch.arange(b, device=ids.device), lengths)
            col = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(
                torch.cumsum(lengths, 0) - lengths, lengths)
            pad[row, col] = ids.long()
        pad = pad.sort(1).values
        pad[:, 1:][pad[:, 1:] == pad[:, :-1]] = -1  # a repeated item counts once
        codes = self.sid.codes_of(pad)  # [B, S, L]; -1 rows: padding and unknown items
        known = codes[..., 0] >= 0
        sizes = self._subtree_sizes()
        seen_nodes = {}

        def exhausted(child: torch.Tensor, level: int) -> torch.Tensor:
            if level not in seen_nodes:
                nodes = self.sid.nodes_of(codes[..., :level].clamp(min=0))
                seen_nodes[level] = torch.where(known, nodes, torch.full_like(nodes, -1)).sort(1).values
            srt = seen_nodes[level]
            flat = child.reshape(b, -1).contiguous()
            count = torch.searchsorted(srt, flat, right=True) - torch.searchsorted(srt, flat)
            full = (count >= sizes[level][flat.clamp(min=0)]) & (flat >= 0)
            return full.reshape(child.shape)

        return exhausted
