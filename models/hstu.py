"""HSTU tower (Hierarchical Sequential Transduction Units, Zhai et al. 2024).

One layer, on jagged rows x [T, D]::

    u, v, q, k = split(SiLU(W_uvqk LayerNorm(x)))
    a          = hstu_attention(q, k, v)          # pointwise SiLU attention + rel. bias
    x          = x + W_o Dropout(u * LayerNorm(a))  # U-gating

Relative bias = learned weight per position distance + learned weight per log-bucketed
time gap (``query_time_i - time_j``). Sequences without timestamps use positions as times
(the caller fills them; see ``models.recommender``).

One model, many backends: the layers call the attention ops of ``kernels.hstu_attention``
with the configured ``attention_backend`` (reference, coded, Triton); the tower's serving
methods (:meth:`HSTUTower.encode_history`, :meth:`HSTUTower.extend`) also take
``backend="native"``, the whole tower in the C++ kernel of ``kernels.hstu_native``, which
receives the tower's weights as arguments. ``tests/test_hstu_parity.py`` runs every backend
against the reference.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from genrec.kernels import bf16_ops, hstu_bounded, hstu_native
from genrec.kernels.hstu_attention import (
    AttentionPlan,
    bias_table,
    hstu_attention,
    hstu_cached_attention,
    hstu_last_row_attention,
)
from genrec.kernels.hstu_bounded import hstu_bounded_attention
from genrec.kernels.hstu_candidates import hstu_cached_attention_blocked
from genrec.kernels.hstu_paged import hstu_paged_attention, hstu_paged_attention_pool
from genrec.kernels.jagged import lengths_to_offsets
from genrec.models.dropout import Dropout

# how the tower's serving methods run: its layers in PyTorch (each attention through
# ``HSTUConfig.attention_backend``), the same with the candidates' attention GEMMs in bf16
# ("torch-bf16": ``kernels.hstu_candidates``, for CPUs with AVX512-BF16 / AMX, where they run
# about twice the fp32 rate; histories are encoded as on "torch"), or the whole tower in the
# C++ kernel (CPU inference)
TowerBackend = Literal["torch", "torch-bf16", "native"]
TOWER_BACKENDS: tuple[str, ...] = ("torch", "torch-bf16", "native")  # the parity test runs each against the reference


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
    attention_backend: Literal["auto", "reference", "coded", "triton", "native"] = "auto"
    # > 0: a bounded reach into long histories (kernels.hstu_bounded, training and serving
    # alike): the last `window` events in full, earlier ones as summaries of `summary_block`
    window: int = 0
    summary_block: int = 64

    def __post_init__(self) -> None:
        if self.window < 0 or self.summary_block < 1:
            raise ValueError(f"hstu.window = {self.window}, hstu.summary_block = {self.summary_block}: the window "
                             "must be >= 0 (0: full attention) and the summary block >= 1")

    def kv_dims(self) -> KVDims:
        """The K/V cache shape of a tower of this config (:meth:`HSTUTower.kv_dims`)."""
        return KVDims(self.num_layers, self.num_heads, self.qk_dim, self.v_dim)


class KVDims(NamedTuple):
    """What one cached token holds in a tower: per layer, ``heads`` keys of ``key_dim`` and
    values of ``value_dim``. E.g. an HSTU tower of 2 layers, 2 heads, qk 8, v 8: keys
    [T, 2, 8] and values [T, 2, 8] per layer; ``key_width`` = ``value_width`` = 16."""

    layers: int
    heads: int
    key_dim: int  # per head
    value_dim: int  # per head

    @property
    def key_width(self) -> int:
        return self.heads * self.key_dim

    @property
    def value_width(self) -> int:
        return self.heads * self.value_dim


@dataclass
class CachedHistory:
    """What candidates need of an encoded history: per-layer keys/values of its tokens."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), [Th, H, D]; [] when only ``native``
    offsets: torch.Tensor  # [B+1] token offsets
    times: torch.Tensor  # [Th] token times (positions where users have no timestamps)
    request_times: torch.Tensor  # [B] the time candidates are scored at
    # the same keys / values in the native backend's layout, when encoded there
    native: hstu_native.NativeHistory | None = None
    # a bounded tower's block summaries, per layer and user, where known (kernels.hstu_bounded)
    sums: list[list[hstu_bounded.BlockSums | None]] | None = None


@dataclass
class JaggedMeta:
    """Per-batch structure shared by every layer (computed once per forward)."""

    offsets: torch.Tensor  # [B+1]
    max_len: int  # longest sequence in the batch
    timestamps: torch.Tensor | None  # [T]
    query_times: torch.Tensor | None  # [T]
    num_targets: torch.Tensor | None  # [B]
    plan: AttentionPlan = field(default_factory=AttentionPlan)  # what every layer's attention shares
    attention_backend: str | None = None  # this call's, instead of the layers' configured one


@dataclass
class PagedMeta:
    """New tokens of B sequences whose earlier tokens' keys and values sit in a cache
    (:meth:`HSTUTower.extend_paged`); token ``index[i]`` of sequence ``seq[i]`` for each new row."""

    seq: torch.Tensor  # [Tq] int64
    index: torch.Tensor  # [Tq] int64, its position in its sequence
    lengths: torch.Tensor  # [B] tokens of each sequence after this call (cached + new)
    key_times: torch.Tensor | None  # [B, L] every token's time (cached and new); None: no time bias
    query_times: torch.Tensor | None  # [Tq]
    hist_lengths: torch.Tensor | None = None  # [B] tokens before the candidates; None: no candidates
    # a paged pool read in place (SGLang's): the pool slot of each sequence's token j [B, L]
    # (``req_to_token`` rows) and each slot's time [S] (None: no time bias; ``key_times`` unused).
    # Then the store returns the layer's whole pool buffers [S, H, D], not per-sequence copies.
    slots: torch.Tensor | None = None
    slot_times: torch.Tensor | None = None
    # a bounded tower's block summaries per layer and sequence before the call (None where not
    # kept), replaced by each layer with its summaries after it (kernels.hstu_bounded.block_sums)
    sums: list[list[hstu_bounded.BlockSums | None]] | None = None


# (layer, new keys [Tq, H, Dqk], new values [Tq, H, Dv]) -> that layer's keys and values of
# every sequence, [B, L, H, D], the new ones written at their (seq, index): an engine's cache;
# with ``PagedMeta.slots``, the layer's pool buffers [S, H, D], the new ones written at their slots
KVStore = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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

    def _split(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> u [..., H * Dv] (the gate) and v, q, k per head: [..., H, D], in x's
        dtype; ``dtype`` bf16: the linear layer and SiLU run in it (inference, ``kernels.bf16_ops``)."""
        c, h = self.cfg, self.cfg.num_heads
        if dtype == torch.bfloat16:
            y = self.norm(x)
            uvqk = bf16_ops.linear(y.flatten(0, -2), self.uvqk.weight, self.uvqk.bias, silu=True)
            uvqk = uvqk.to(x.dtype).unflatten(0, y.shape[:-1])
        else:  # (bf16 under autocast: SiLU's native passes, kernels.bf16_ops)
            uvqk = bf16_ops.silu(self.uvqk(self.norm(x)))
        u, v, q, k = torch.split(uvqk, [h * c.v_dim, h * c.v_dim, h * c.qk_dim, h * c.qk_dim], dim=-1)
        return u, v.unflatten(-1, (h, c.v_dim)), q.unflatten(-1, (h, c.qk_dim)), k.unflatten(-1, (h, c.qk_dim))

    def _gate(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """Residual + U-gated output; ``attn`` [..., H, Dv]; ``dtype``: as in :meth:`_split`."""
        if dtype == torch.bfloat16:
            g = u * self.out_norm(attn.flatten(-2))
            y = bf16_ops.linear(g.flatten(0, -2), self.out.weight, self.out.bias).unflatten(0, g.shape[:-1])
            return x + y
        return x + self.out(self.dropout(u * self.out_norm(attn.flatten(-2))))

    def forward(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]; appends this layer's (k, v) [T, H, D] to ``cache`` if given."""
        u, v, q, k = self._split(x)
        if cache is not None:
            cache.append((k, v))
        return self._gate(x, u, self._attention(q, k, v, meta))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: JaggedMeta) -> torch.Tensor:
        if self.cfg.window:
            return hstu_bounded_attention(
                q, k, v, meta.offsets, window=self.cfg.window, block=self.cfg.summary_block,
                max_seq_len=self.max_seq_len, alpha=self.alpha, pos_weights=self.pos_weights,
                time_weights=self.time_weights, timestamps=meta.timestamps, query_times=meta.query_times,
                num_targets=meta.num_targets, max_len=meta.max_len)
        return hstu_attention(
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
            backend=meta.attention_backend or self.cfg.attention_backend,
            plan=meta.plan,
        )

    def forward_last(self, x: torch.Tensor, meta: JaggedMeta, cache: list | None = None) -> torch.Tensor:
        """Only each sequence's last row: x [T, D] -> [B, D] (keys and values of every row still
        go to ``cache``). For the last layer at inference, when only that row is read."""
        u, v, q, k = self._split(x)
        if cache is not None:
            cache.append((k, v))
        last = meta.offsets[1:] - 1
        if self.cfg.window:  # (the bounded pass has no last-row shortcut: every row, then the last)
            return self._gate(x[last], u[last], self._attention(q, k, v, meta)[last])
        attn = hstu_last_row_attention(
            q, k, v, meta.offsets, max_seq_len=self.max_seq_len, alpha=self.alpha, pos_weights=self.pos_weights,
            time_weights=self.time_weights, timestamps=meta.timestamps, query_times=meta.query_times,
            backend=self._backend(meta.attention_backend))
        return self._gate(x[last], u[last], attn)

    def forward_cached(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], hist: CachedHistory,
                       owner: torch.Tensor, plan: AttentionPlan | None = None,
                       dtype: torch.dtype | None = None, index: int = 0) -> torch.Tensor:
        """Candidate rows x [C, D] against the cached history of their users -> [C, D]
        (``plan``: shared by the layers of one call, see ``hstu_cached_attention``; ``dtype``:
        the precision of its GEMMs, None: x's; ``index``: this layer's, for ``hist.sums``)."""
        u, v, q, k = self._split(x, dtype)
        if self.cfg.window:  # each user's window rows and block summaries, at their own positions
            kb, vb, offsets, positions, times = hstu_bounded.bounded_history(
                kv[0], kv[1], hist.offsets, hist.times if self.time_weights is not None else None, self.cfg.window,
                self.cfg.summary_block, hist.sums[index] if hist.sums is not None else None)
            attn = hstu_cached_attention_blocked(
                q, k, v, kb, vb, offsets, owner, max_seq_len=self.max_seq_len, alpha=self.alpha,
                pos_weights=self.pos_weights, time_weights=self.time_weights, hist_times=times,
                request_times=hist.request_times, plan=plan, dtype=dtype, key_positions=positions,
                query_positions=hist.offsets[1:] - hist.offsets[:-1])
            return self._gate(x, u, attn, dtype)
        attn = hstu_cached_attention(
            q, k, v, kv[0], kv[1], hist.offsets, owner, max_seq_len=self.max_seq_len, alpha=self.alpha, pos_weights=self.pos_weights,
            time_weights=self.time_weights, hist_times=hist.times, request_times=hist.request_times,
            backend="blocked" if dtype is not None else self._backend(), plan=plan, dtype=dtype)
        return self._gate(x, u, attn, dtype)

    def forward_paged(self, x: torch.Tensor, meta: PagedMeta, store: KVStore, index: int) -> torch.Tensor:
        """New rows x [Tq, D] against their sequences' cached keys / values -> [Tq, D]; this
        layer's new keys and values go to ``store`` (as layer ``index``) first."""
        if self.cfg.window and (meta.slots is not None or meta.hist_lengths is not None):
            raise ValueError("hstu.window > 0: a bounded tower extends a cached history by its new events (an "
                             "engine's cache); a paged pool and candidates in the same pass are not supported")
        u, v, q, k = self._split(x)
        keys, values = store(index, k, v)
        if self.cfg.window:  # each new event's window and the summaries of the cached blocks before it
            attn = hstu_bounded.hstu_bounded_paged_attention(
                q, keys, values, meta.seq, meta.index, meta.lengths, window=self.cfg.window,
                block=self.cfg.summary_block, max_seq_len=self.max_seq_len, alpha=self.alpha,
                pos_weights=self.pos_weights, time_weights=self.time_weights, key_times=meta.key_times,
                query_times=meta.query_times, sums=meta.sums[index] if meta.sums is not None else None)
            return self._gate(x, u, attn)
        if meta.slots is not None:  # the pool read in place through the slot map (Triton on CUDA)
            attn = hstu_paged_attention_pool(
                q, keys, values, meta.slots, meta.seq, meta.index, meta.lengths, max_seq_len=self.max_seq_len,
                alpha=self.alpha, pos_weights=self.pos_weights, time_weights=self.time_weights,
                slot_times=meta.slot_times, query_times=meta.query_times, hist_lengths=meta.hist_lengths)
            return self._gate(x, u, attn)
        attn = hstu_paged_attention(
            q, keys, values, meta.seq, meta.index, meta.lengths, max_seq_len=self.max_seq_len, alpha=self.alpha,
            pos_weights=self.pos_weights, time_weights=self.time_weights, key_times=meta.key_times,
            query_times=meta.query_times, hist_lengths=meta.hist_lengths)
        return self._gate(x, u, attn)

    def _backend(self, override: str | None = None) -> str:
        """The attention backend for the ops without a Triton or native kernel (last row, cached)."""
        b = override or self.cfg.attention_backend
        return "auto" if b in ("triton", "native") else b

    def weights(self) -> hstu_native.LayerWeights:
        """This layer's weights for a kernel that runs whole layers."""
        return hstu_native.LayerWeights(
            self.norm.weight, self.norm.bias, self.uvqk.weight, self.uvqk.bias, self.out_norm.weight,
            self.out_norm.bias, self.out.weight, self.out.bias,
            bias_table(self.pos_weights, self.time_weights, self.max_seq_len, self.out.weight.dtype))


_version = operator.attrgetter("_version")


def _unchanged(key: tuple[list[torch.Tensor], list[int], list[int]]) -> bool:
    """Whether each parameter still has the storage and version it had (a replaced
    Parameter object goes unseen: assign into the existing ones, as load_state_dict does)."""
    params, ptrs, versions = key
    return list(map(_version, params)) == versions and list(map(torch.Tensor.data_ptr, params)) == ptrs


class HSTUTower(nn.Module):
    """A stack of HSTU layers on jagged rows: x [T, D] -> [T, D]."""

    def __init__(self, cfg: HSTUConfig, dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(HSTULayer(cfg, dim, max_seq_len) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(dim)
        self.time_bias = cfg.time_bias

    def kv_dims(self) -> KVDims:
        """The shape of the keys / values it caches per token (its layers and heads)."""
        return self.cfg.kv_dims()

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

    def encode_history(self, x: torch.Tensor, meta: JaggedMeta, backend: TowerBackend = "torch",
                       l2: bool = False) -> tuple[torch.Tensor, CachedHistory]:
        """Histories without candidates through the tower, read at their last rows.

        x [T, D] token inputs of B histories (``meta``; every history has a token) ->
        (each history's last row after the tower [B, D], the per-layer keys / values that
        candidates are then scored against with :meth:`extend`). ``backend="native"``: the
        C++ kernel (CPU inference, :meth:`native_supported`); there ``l2`` also L2-normalizes
        the rows in the final norm's pass (eps 1e-6: a retrieval head's user vectors)."""
        if meta.num_targets is not None:
            raise ValueError("encode_history takes histories without targets (score those with extend)")
        if backend == "native":
            times = self._native_times(meta.timestamps, meta.query_times)
            out, native, request = hstu_native.encode(self.native_weights(), x, meta.offsets, *times, l2=l2)
            if out.dtype != x.dtype:
                out = out.to(x.dtype)
            return out, CachedHistory([], meta.offsets, meta.timestamps, request, native)
        if backend not in ("torch", "torch-bf16"):
            raise ValueError(f"unknown tower backend '{backend}'; use one of {', '.join(TOWER_BACKENDS)}")
        if l2:
            raise ValueError("l2 is the native backend's fused readout; normalize the rows yourself on 'torch'")
        request = meta.query_times[meta.offsets[1:] - 1] if meta.query_times is not None else None
        layers: list = []
        h = self(x, meta, cache=layers, last_only=True)
        return h, CachedHistory(layers, meta.offsets, meta.timestamps, request)

    def extend(self, x: torch.Tensor, hist: CachedHistory, owner: torch.Tensor,
               backend: TowerBackend = "torch") -> torch.Tensor:
        """Candidates x [C, D] of users ``owner`` [C] against ``hist`` (:meth:`encode_history`,
        or ``forward(cache=)``) -> [C, D]: what the full pass gives them as targets appended
        to their user's history. Natively, runs of one user's candidates are scored together."""
        if backend == "native":
            native = hist.native
            if native is None:  # encoded by the PyTorch layers: the kernel's layout
                k, v = (torch.stack([kv[i].flatten(-2) for kv in hist.layers]) for i in (0, 1))
                request, times = self._native_times(hist.times, hist.request_times)
                native = hstu_native.history(k, v, hist.offsets, times, request)
            # with the weights that encoded the history (one weight check per request, not two)
            out = hstu_native.score(native.tower or self.native_weights(), x, native, owner)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        if backend not in ("torch", "torch-bf16"):
            raise ValueError(f"unknown tower backend '{backend}'; use one of {', '.join(TOWER_BACKENDS)}")
        plan = AttentionPlan()  # the candidates' grouping and bias codes, built by the first layer
        dtype = torch.bfloat16 if backend == "torch-bf16" else None
        for i, (layer, kv) in enumerate(zip(self.layers, self.cached_layers(hist))):
            x = layer.forward_cached(x, kv, hist, owner, plan, dtype, i)
        return self.final_norm(x)

    forward_cached = extend  # the name the transformer tower shares

    def extend_paged(self, x: torch.Tensor, meta: PagedMeta, store: KVStore) -> torch.Tensor:
        """New tokens x [Tq, D] of sequences whose earlier tokens' keys / values are cached ->
        [Tq, D], what the full pass over each whole sequence gives these rows; each layer
        writes its new keys / values through ``store`` before attending (``kernels.hstu_paged``).
        Incremental encoding of a grown history (and its candidates, ``meta.hist_lengths``)."""
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(x, meta, store, i)
        return self.final_norm(x)

    def extend_native(self, x: torch.Tensor, k: torch.Tensor | list[torch.Tensor], v: torch.Tensor | list[torch.Tensor],
                      prefix: np.ndarray, lengths: np.ndarray, key_times: np.ndarray | None,
                      query_times: np.ndarray | None, slots: np.ndarray | None = None) -> torch.Tensor:
        """:meth:`extend_paged` on the C++ kernel, read at each sequence's last row: new tokens
        x [Tq, D] of W sequences (``prefix[w]`` cached of ``lengths[w]``, every one with a new
        token) whose keys / values hold the cached rows, the new rows' written after them:
        ``k`` [layers, W, cap, H Dqk], ``v`` [layers, W, cap, H Dv] (an engine cache's storage),
        or with ``slots`` [W, L] per-layer pool rows read in place (``hstu_native.extend``) ->
        [W, D] after the final norm. ``key_times`` [W, cap or L], ``query_times`` [Tq] (ignored
        without a time bias)."""
        if self.cfg.window:
            raise ValueError("extend_native: a bounded tower (hstu.window) extends through extend_paged")
        timed = self.time_bias
        out = hstu_native.extend(self.native_weights(), x, k, v, prefix, lengths, key_times if timed else None,
                                 query_times if timed else None, slots)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def cached_layers(self, hist: CachedHistory) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k [Th, H, Dqk], v [Th, H, Dv]) of ``hist``: views of its native layout
        when the native backend encoded it (gathered where a slot map places its rows)."""
        if hist.layers or hist.native is None:
            return hist.layers
        c, native = self.kv_dims(), hist.native
        out = []
        for i in range(c.layers):
            k, v = native.layer(i)
            out.append((k.view(-1, c.heads, c.key_dim), v.view(-1, c.heads, c.value_dim)))
        return out

    # ---- the native backend: this tower's weights for the kernel -----------------------------
    def plain_linears(self) -> bool:
        """Whether every layer's linear maps are ``nn.Linear`` with their weight tensors, as the
        native kernel and the bf16 GEMMs read them (not an artifact's int8 / fp8 quantized
        dense layers, which only their own forward computes)."""
        return all(type(m) is nn.Linear for la in self.layers for m in (la.uvqk, la.out))

    def native_supported(self) -> bool:
        """Whether ``backend="native"`` computes this tower here (shapes it covers, and the
        library builds: ``kernels.native``)."""
        if not self.plain_linears():
            return False
        c, fn = self.layers[0].cfg, self.final_norm
        eps = [la.norm.eps for la in self.layers] + [la.out_norm.eps for la in self.layers]
        affine = isinstance(fn, nn.LayerNorm) and fn.weight is not None and fn.bias is not None
        bias = all(la.uvqk.bias is not None and la.out.bias is not None for la in self.layers)
        return (not c.window and affine and hstu_native.supports(fn.normalized_shape[0], c.num_heads, c.qk_dim, c.v_dim,
                                                self.layers[0].out.weight.dtype, [*eps, fn.eps], bias)
                and hstu_native.library() is not None)

    def native_weights(self) -> hstu_native.NativeTower:
        """The layers' weights laid out for the kernel, rebuilt when a parameter's storage or
        version changes (an in-place update, ``load_state_dict``, ``.to()``)."""
        if self.training:
            raise RuntimeError("the native backend is for inference: call model.eval() first")
        cached = self.__dict__.get("_native")
        if cached is not None and _unchanged(cached[0]):
            return cached[1]
        params = list(self.parameters())
        key = (params, [p.data_ptr() for p in params], [p._version for p in params])
        first = self.layers[0]
        nb = first.time_weights.numel() if first.time_weights is not None else 1
        tower = hstu_native.NativeTower([la.weights() for la in self.layers], self.final_norm.weight,
                                        self.final_norm.bias, first.cfg.num_heads, first.cfg.qk_dim,
                                        first.cfg.v_dim, first.max_seq_len, nb, first.alpha)
        self.__dict__["_native"] = (key, tower)  # not a submodule: outside state_dict
        return tower

    def _native_times(self, times: torch.Tensor | None, query: torch.Tensor | None) -> tuple:
        """(query times, key times) for the kernel: None where the layers have no time bias."""
        if not self.time_bias:
            return None, None
        if times is None or query is None:
            raise ValueError("this tower has a time bias: pass timestamps and query times")
        return query, times

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_native", None)  # pointers into this process's memory: rebuilt on use
        return state

    def forward_padded(self, x: torch.Tensor, lengths: torch.Tensor, timestamps: torch.Tensor | None,
                       query_times: torch.Tensor | None, num_targets: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, D], times [B, L] padded -> [B, L, D] (padded slots 0): the valid rows
        through :meth:`forward` with the reference attention over the whole padded length L
        (dense [B, L, L] scores), the naive formulation the training-speed benchmark times."""
        n = x.shape[1]
        valid = torch.arange(n, device=x.device)[None, :] < lengths[:, None]
        pick = (lambda t: t[valid]) if timestamps is not None else (lambda t: None)  # noqa: E731
        meta = JaggedMeta(lengths_to_offsets(lengths), n, pick(timestamps), pick(query_times), num_targets,
                          attention_backend="reference")
        out = x.new_zeros(x.shape)
        out[valid] = self(x[valid], meta)
        return out
