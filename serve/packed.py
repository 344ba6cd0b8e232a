"""The engine's packed path: the model's own methods on a batch laid out once in numpy.

A batch of users' histories is packed (no KeyedJaggedTensor, no padding) and turned into
token inputs by ``GenerativeRecommender.summed_tokens`` or, on a served artifact, the
native gathers of ``serve.native.ServeKernels``; the tower runs through the model's
``encode_history_tokens`` / ``extend`` on the backend the engine selected ("torch": its
layers; "native": its C++ kernel, ``kernels.hstu_native``). Covers the HSTU tower with the
summed action encoding (:func:`packed_supports`); other models take the batch path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from genrec.embedding.spec import EmbeddingConfig
from genrec.kernels import hstu_native
from genrec.kernels.hstu_bounded import BlockSums
from genrec.models.hstu import CachedHistory, HSTUTower, JaggedMeta, PagedMeta
from genrec.models.inputs import history_capacity
from genrec.models.recommender import GenerativeRecommender, HistoryState, ModelConfig, TowerBackend
from genrec.serve.accounting import mark
from genrec.serve.kvcache import Entry, KVCache
from genrec.serve.layout import context_kjt, pack_users
from genrec.serve.native import ServeKernels
from genrec.serve.requests import UserInput, history_window


def packed_covers(cfg: ModelConfig, emb: EmbeddingConfig) -> bool:
    """Whether the packed path computes a model of these configs: an HSTU tower with the summed
    action encoding (one token per event) and no other sequence features."""
    return (cfg.arch == "generative" and cfg.tower == "hstu" and cfg.ranking.encoding != "interleaved"
            and set(emb.sequence_features) <= {emb.item_feature, "action"})


def packed_supports(model: GenerativeRecommender) -> bool:
    """:func:`packed_covers` for ``model``."""
    return packed_covers(model.cfg, model.embedding_cfg)


# candidate_precision "auto" (serve.scoring) scores a micro-batch in bf16 from this many candidate
# x history-event pairs: below it the fp32 native kernel is faster than bf16's conversions and
# dispatch (the crossover measured on an AVX512-BF16 CPU, with the fused bf16 attention:
# benchmarks/notes/2026-12-06-fused-candidates.md)
BF16_FROM_PAIRS = 200_000


class PackedPath:
    """The engine's packed path for one model: ``encode(users)`` -> (user vectors [B, D],
    HistoryState), ``score(state, users, candidates)`` -> task probabilities per user. The
    histories are laid out once in numpy (no KeyedJaggedTensor), the token inputs made by
    ``model.summed_tokens`` or the native gathers, the tower run by the model's own
    ``encode_history_tokens`` / ``extend`` on ``backend`` ("torch" or "native").
    ``window_block``: the window over long histories moves in steps of this many events
    (:func:`history_window`). :meth:`encode_cached` encodes with a per-user K/V cache, reusing
    each cached prefix (its new tokens through the tower's extend). ``score_backend``: the tower's
    backend for the candidates (default ``backend``; "torch-bf16": their attention GEMMs in
    bf16 against the keys / values either backend encoded, ``kernels.hstu_candidates``), for
    micro-batches of at least ``score_from`` candidate x history-event pairs; smaller ones take
    ``backend`` (where bf16's conversions cost more than its GEMMs save: :data:`BF16_FROM_PAIRS`)."""

    def __init__(self, model: GenerativeRecommender, backend: TowerBackend = "torch", micro_batch: int = 4096,
                 stages: dict[str, float] | None = None, window_block: int = 1,
                 score_backend: TowerBackend | None = None, score_from: int = 0) -> None:
        if not packed_supports(model):
            raise ValueError("the packed path needs an HSTU tower with summed action encoding and no other "
                             "sequence features")
        if backend == "native" and not model.tower.native_supported():
            raise ValueError("the tower's native backend does not cover this model here (fp32 dense weights, "
                             "widths in multiples of 8, the library built: HSTUTower.native_supported)")
        self.model, self.backend, self.micro_batch = model, backend, micro_batch
        self.score_backend, self.score_from = score_backend or backend, score_from
        self.kernels = ServeKernels(model) if backend == "native" else None
        if backend == "native":  # the weights laid out for the kernel now, not on the first request
            model.tower.native_weights()
        # the events offline evaluation reads (serve.layout.schema_of: the same function)
        self.cap = history_capacity(model.cfg.max_seq_len, 2 if model.interleaved else 1, bool(model.cfg.ranking.tasks))
        history_window(self.cap, self.cap, window_block)  # (a block outside 1..cap: the error names it)
        self.block = window_block
        self.has_action = "action" in model.sparse.sequence_features
        self.stages = stages if stages is not None else {}  # seconds per stage, summed over calls

    def _mark(self, stage: str, t0: float) -> float:
        return mark(self.stages, stage, t0)

    def encode(self, users: list[UserInput]) -> tuple[torch.Tensor, HistoryState]:
        """User vectors [B, D] and the encoded histories, through ``model.encode_history_tokens``."""
        if not torch.is_inference_mode_enabled():  # (the engine's run is in it already)
            with torch.inference_mode():
                return self.encode(users)
        t0 = time.perf_counter()
        items, actions, tk, tq, positions, lens = pack_users(users, self.cap, self.has_action, self.block)
        x = self.tokens(items, actions, positions)
        ctx = self.context(users)
        t0 = self._mark("history_lookup", t0)
        out = self._encode(x, lens, tk, tq, ctx)
        self._mark("history_tower", t0)
        return out

    def tokens(self, items: np.ndarray, actions: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Token inputs [N, D] of events at window positions (the native gathers where there are)."""
        k = self.kernels
        if k is not None and k.rows is not None:
            return k.tokens(items, actions if self.has_action else None, positions)
        return self.model.summed_tokens(torch.from_numpy(items), torch.from_numpy(actions) if self.has_action else None,
                                        torch.from_numpy(positions))[1]

    def context(self, users: list[UserInput]) -> torch.Tensor | None:
        """The users' pooled context [B, E] when the ranking head reads it."""
        m, k = self.model, self.kernels
        if m.ranking is None or not m.ranking_context:
            return None
        return (k.context(users) if k is not None and k.pooled is not None
                else m.sparse.pooled(context_kjt(users, list(m.embedding_cfg.pooled_features))).values())

    def _encode(self, x: torch.Tensor, lens: np.ndarray, tk: np.ndarray, tq: np.ndarray,
                ctx: torch.Tensor | None) -> tuple[torch.Tensor, HistoryState]:
        offsets = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        meta = JaggedMeta(torch.from_numpy(offsets), int(lens.max()), torch.from_numpy(tk), torch.from_numpy(tq), None)
        return self.model.encode_history_tokens(x, meta, ctx, self.backend)

    def encode_cached(self, users: list[UserInput], cache: KVCache, alone: Callable[[], bool] | None = None,
                      ) -> tuple[torch.Tensor, HistoryState, np.ndarray, np.ndarray]:
        """:meth:`encode` with ``cache``: (user vectors [B, D], the encoded histories, tokens
        reused per user [B], tokens evicted per user [B]). A user with a ``user_id`` whose cached
        window shares a prefix with this one (``serve.kvcache``) encodes only the rest, through
        ``tower.extend_paged`` over the prefix's keys / values (such users of the batch together);
        the others through ``encode_history_tokens`` as :meth:`encode`. Users with an id are kept
        in the cache afterwards. The state is one packed history as :meth:`encode` gives, so
        candidates are scored the same way. ``alone()``: whether this call is the only one of the
        engine running, asked after the entries are taken out of the cache: then a lone warm user
        grows its entry's storage in place (``serve.kvcache``) instead of copying its prefix."""
        t0 = time.perf_counter()
        items, actions, tk, tq, positions, lens = pack_users(users, self.cap, self.has_action, self.block)
        b = lens.size
        offsets = np.zeros(b + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        entries: list[Entry | None] = [None] * b
        prefix = np.zeros(b, np.int64)
        take = alone is not None and b == 1  # (in place: one warm user, see _extend)
        for i, u in enumerate(users):
            if u.user_id:
                s, e = offsets[i], offsets[i + 1]
                entries[i], prefix[i] = cache.lookup(u.user_id, (items[s:e], actions[s:e], tk[s:e], tq[s:e]),
                                                     take=take)
        in_place = take and alone is not None and alone()  # (asked after the take: see the docstring)
        cache.count_history(int(lens.sum()))
        keep = positions >= np.repeat(prefix, lens)  # the rows to encode: all but the reused prefixes
        x = self.tokens(items[keep], actions[keep], positions[keep])
        ctx = self.context(users)
        t0 = self._mark("history_lookup", t0)
        warm = np.flatnonzero(prefix > 0)
        if warm.size == 0:  # (today's encode, then its keys / values kept)
            vec, state = self._encode(x, lens, tk, tq, ctx)
            kv = _split_kv(self.model.tower, state.history, offsets, [bool(u.user_id) for u in users])
        else:
            vec, state, kv = self._encode_warm(x, keep, warm, entries, prefix, lens, offsets, tk, tq, ctx, in_place)
        t0 = self._mark("history_tower", t0)
        evicted = np.zeros(b, np.int64)
        for i, u in enumerate(users):
            pair = kv[i]  # (every user with an id has its keys / values)
            if u.user_id and pair is not None:
                s, e = offsets[i], offsets[i + 1]
                evicted[i] = cache.put(u.user_id, Entry(items[s:e].copy(), actions[s:e].copy(), tk[s:e].copy(),
                                                        tq[s:e].copy(), pair.k, pair.v, pair.room, pair.sums))
        self._mark("cache_update", t0)
        return vec, state, prefix, evicted

    def _encode_warm(self, x: torch.Tensor, keep: np.ndarray, warm: np.ndarray, entries: list[Entry | None],
                     prefix: np.ndarray, lens: np.ndarray, offsets: np.ndarray, tk: np.ndarray, tq: np.ndarray,
                     ctx: torch.Tensor | None, in_place: bool = False,
                     ) -> tuple[torch.Tensor, HistoryState, list[Kept | None]]:
        """A batch with cached prefixes: the cold users through the encode, the warm ones' new
        tokens through ``tower.extend_paged``; (vectors, one packed state, each user's k / v)."""
        m, b = self.model, lens.size
        cold = np.flatnonzero(prefix == 0)
        owner = np.repeat(np.arange(b), lens)[keep]  # each row of x: its user
        kv: list[Kept | None] = [None] * b
        vec = torch.empty(b, m.pos_emb.weight.shape[1])
        if cold.size:
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in cold])
            vec_c, state_c = self._encode(x[torch.from_numpy(np.isin(owner, cold))], lens[cold], tk[rows], tq[rows], None)
            vec[torch.from_numpy(cold)] = vec_c
            cold_offsets = np.concatenate([[0], np.cumsum(lens[cold])])
            for j, pair in zip(cold, _split_kv(m.tower, state_c.history, cold_offsets, [True] * cold.size)):
                kv[j] = pair
        new = np.isin(owner, warm)
        vec_w, kv_w = self._extend(x[torch.from_numpy(new)], [entries[i] for i in warm], prefix[warm], lens[warm],
                                   tk, tq, offsets[warm], in_place and warm.size == 1)
        vec[torch.from_numpy(warm)] = vec_w
        for j, pair in zip(warm, kv_w):
            kv[j] = pair
        every = [p for p in kv if p is not None]  # (each user is cold or warm: none is missing)
        return vec, HistoryState(_packed_history(m.tower, every, offsets, tk, tq, self.backend),
                                 torch.from_numpy(lens), ctx), kv

    def _extend(self, x: torch.Tensor, entries: list[Entry], prefix: np.ndarray, lens: np.ndarray, tk: np.ndarray,
                tq: np.ndarray, starts: np.ndarray, in_place: bool = False) -> tuple[torch.Tensor, list[Kept]]:
        """Warm users' new tokens x (rows ``prefix[i]..lens[i]-1`` of each, in order) over their
        cached prefixes: (user vectors [W, D], each user's k / v [layers, n, H D] afterwards,
        and for an entry grown in place its storage). ``in_place`` (one user, its entry taken
        out of the cache): the new tokens are written into the entry's storage after the
        prefix, grown with room for :func:`room` more tokens where it is full."""
        tower, w, big = self.model.tower, lens.size, int(lens.max())
        c = tower.kv_dims()
        dtype = x.dtype
        if in_place:
            (e,), p = entries, int(prefix[0])
            ks, vs = e.room if e.room is not None and e.room[0].shape[1] >= big else _grown(e, p, big + room(big))
            kp, vp = ks[:, None], vs[:, None]  # [layers, 1, capacity, width]
        else:
            kp = torch.empty(c.layers, w, big, c.key_width, dtype=dtype)
            vp = torch.empty(c.layers, w, big, c.value_width, dtype=dtype)
            for i, (e, p, n) in enumerate(zip(entries, prefix, lens)):
                kp[:, i, :p], vp[:, i, :p] = e.k[:, :p], e.v[:, :p]
                if n < big:  # padding the op reads (masked, so it must be finite)
                    kp[:, i, n:], vp[:, i, n:] = 0, 0
        rows = np.concatenate([np.arange(s + p, s + n) for s, p, n in zip(starts, prefix, lens)])
        key_times = np.zeros((w, kp.shape[2]), np.int64)  # every row's event time, per history
        for i, (s, n) in enumerate(zip(starts, lens)):
            key_times[i, :n] = tk[s : s + n]
        sums = None
        if self.backend == "native" and not tower.cfg.window:  # the C++ kernel, in the storage as it lies
            vec = self.model.head.normalize(tower.extend_native(x, kp, vp, prefix, lens, key_times, tq[rows]).float())
        else:
            vec, sums = self._extend_paged(x, kp, vp, entries, prefix, lens, key_times[:, :big], tq[rows], big)
        user_sums = [[layer[i] for layer in sums] if sums is not None else None for i in range(w)]
        if in_place:
            return vec, [Kept(kp[:, 0, :big], vp[:, 0, :big], (kp[:, 0], vp[:, 0]), user_sums[0])]
        if w == 1:  # [layers, 1, n, .] is one history's layout already
            return vec, [Kept(kp[:, 0], vp[:, 0], None, user_sums[0])]
        # copies (never views: a one-layer slice is contiguous already, and a view would keep the
        # whole batch's buffer alive for as long as any of these users stays cached)
        own = torch.contiguous_format
        return vec, [Kept(kp[:, i, :n].clone(memory_format=own), vp[:, i, :n].clone(memory_format=own), None,
                          user_sums[i]) for i, n in enumerate(lens)]

    def _extend_paged(self, x: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, entries: list[Entry],
                      prefix: np.ndarray, lens: np.ndarray, key_times: np.ndarray, query_times: np.ndarray,
                      big: int) -> tuple[torch.Tensor, list | None]:
        """:meth:`_extend`'s new tokens through ``tower.extend_paged`` (PyTorch ops; ``key_times``
        [W, big], ``query_times`` [new rows]): (user vectors [W, D], a bounded tower's block
        summaries per layer and user, else None)."""
        tower, w = self.model.tower, lens.size
        c = tower.kv_dims()
        seq = torch.from_numpy(np.repeat(np.arange(w), lens - prefix))
        index = torch.from_numpy(np.concatenate([np.arange(p, n) for p, n in zip(prefix, lens)]))
        sums = ([[e.sums[layer] if e.sums is not None else None for e in entries] for layer in range(c.layers)]
                if tower.cfg.window else None)  # (a bounded tower's block summaries: updated by each layer)
        meta = PagedMeta(seq, index, torch.from_numpy(lens), torch.from_numpy(np.ascontiguousarray(key_times)),
                         torch.from_numpy(query_times), sums=sums)

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys = kp[layer, :, :big].view(w, big, c.heads, c.key_dim)
            values = vp[layer, :, :big].view(w, big, c.heads, c.value_dim)
            keys[seq, index], values[seq, index] = k, v
            return keys, values

        h = tower.extend_paged(x, meta, store)  # [new rows, D]
        last = torch.from_numpy(np.cumsum(lens - prefix) - 1)
        return self.model.head.normalize(h[last].float()), sums

    def score(self, state: HistoryState, users: list[int], candidates: list[np.ndarray]) -> list[np.ndarray]:
        """Task probabilities [c, tasks] of each ``candidates[i]`` (table rows) for batch user
        ``users[i]``, through ``model.extend`` and the ranking head, in micro-batches of at most
        ``micro_batch`` candidates (:func:`micro_batches`; one user's candidates may span several)."""
        m = self.model
        if m.ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.score(state, users, candidates)
        counts = np.array([c.size for c in candidates], np.int64)
        tasks = len(m.cfg.ranking.tasks)
        if counts.sum() == 0:
            return [np.zeros((0, tasks), np.float32) for _ in candidates]
        parts = []
        for group in micro_batches(counts, self.micro_batch):  # (batch index, first, end) per user piece
            parts.append(self._score_group(state, np.array([users[i] for i, _, _ in group], np.int64),
                                           [candidates[i][s:e] for i, s, e in group],
                                           np.array([e - s for _, s, e in group], np.int64)))
        return np.split(np.concatenate(parts), np.cumsum(counts)[:-1])

    def _score_group(self, state: HistoryState, users: np.ndarray, candidates: list[np.ndarray],
                     counts: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        m, k = self.model, self.kernels
        ranking = m.ranking
        if ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        owner = np.repeat(users, counts)  # each candidate's batch user, grouped by user
        cands = np.concatenate(candidates).astype(np.int64, copy=False)
        owner_t = torch.from_numpy(owner)
        positions = state.lengths.numpy()[owner]  # each candidate sits right after its user's history
        if k is not None and k.rows is not None:
            rows = torch.empty(cands.size, k.dim)
            x = k.tokens(cands, np.zeros_like(cands) if self.has_action else None, positions, rows)
        else:
            c = torch.from_numpy(cands)
            rows, x = m.summed_tokens(c, torch.zeros_like(c) if self.has_action else None, torch.from_numpy(positions))
        t0 = self._mark("candidate_lookup", t0)
        pairs = int(counts @ state.lengths.numpy()[users]) if self.score_from else 0
        backend = self.score_backend if pairs >= self.score_from else self.backend
        h = m.extend(state, x, owner_t, backend)
        t0 = self._mark("candidate_tower", t0)
        if backend == "torch-bf16":  # the head's GEMMs in bf16 too
            logits = ranking(h, rows, state.context[owner_t] if state.context is not None else None, torch.bfloat16)
        elif k is not None and k.mlp is not None:  # the context's share of the first layer once per user
            cand_offsets = np.concatenate([[0], np.cumsum(counts)])
            logits = k.rank(h, rows, state.context, cand_offsets, users)
        else:
            logits = ranking(h, rows, state.context[owner_t] if state.context is not None else None)
        probs = ranking.probabilities(logits).numpy()
        self._mark("ranking_head", t0)
        return probs


def micro_batches(counts: np.ndarray, size: int) -> list[list[tuple[int, int, int]]]:
    """The candidates of users with ``counts`` [U] candidates each, taken in order and cut into
    ceil(total / size) micro-batches of equal size (to one candidate): per micro-batch, the
    (user index, first, end) pieces of users' candidates it holds. A user with more than
    ``size`` candidates spans several micro-batches, so one call's 2,000 candidates are cut too
    (a micro-batch bounds the candidates-by-history score matrix the tower makes per layer).
    E.g. counts [3, 5], size 4 -> [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)]]."""
    if size < 1:
        raise ValueError(f"micro_batch = {size}; it must be at least 1")
    ends = np.cumsum(counts)
    starts, total = ends - counts, int(ends[-1]) if ends.size else 0
    n = -(-total // size)
    cuts = np.arange(n + 1) * total // n if n else np.zeros(1, np.int64)
    out = []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        lo, hi = int(np.searchsorted(ends, a, side="right")), int(np.searchsorted(starts, b, side="left"))
        out.append([(i, max(a - int(starts[i]), 0), min(b, int(ends[i])) - int(starts[i]))
                    for i in range(lo, hi) if counts[i]])
    return out


class Kept(NamedTuple):
    """A user's keys and values after a call, [layers, n, H D] each, as the cache keeps them."""

    k: torch.Tensor
    v: torch.Tensor
    room: tuple[torch.Tensor, torch.Tensor] | None = None  # the storage k and v lie in (grown in place)
    sums: list[BlockSums | None] | None = None  # a bounded tower's block summaries, per layer


def room(n: int) -> int:
    """Tokens of room an entry of n tokens is given when its storage grows: an eighth (at least
    16), so a history growing by a few events a call is copied once per n / 8 new events."""
    return max(16, n // 8)


def _grown(e: Entry, prefix: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New storage ([layers, capacity, width] keys and values) holding ``e``'s first ``prefix`` tokens."""
    ks = e.k.new_empty(e.k.shape[0], capacity, e.k.shape[2])
    vs = e.v.new_empty(e.v.shape[0], capacity, e.v.shape[2])
    ks[:, :prefix], vs[:, :prefix] = e.k[:, :prefix], e.v[:, :prefix]
    return ks, vs


def _split_kv(tower: HSTUTower, hist: CachedHistory, offsets: np.ndarray,
              wanted: list[bool]) -> list[Kept | None]:
    """Each history's keys / values [layers, n, H D] of an encoded batch (copies: the cache
    must not hold the batch's buffers), None where not ``wanted``."""
    if not any(wanted):
        return [None] * len(wanted)
    native = hist.native
    if native is not None and isinstance(native.k, torch.Tensor) and isinstance(native.v, torch.Tensor) and (
            native.rows is None):  # (an encode's: [layers, Th, width])
        k, v = native.k, native.v
    else:
        k, v = (torch.stack([kv[i].flatten(-2) for kv in tower.cached_layers(hist)]) for i in (0, 1))
    return [Kept(k[:, s:e].clone(), v[:, s:e].clone()) if want else None
            for s, e, want in zip(offsets[:-1], offsets[1:], wanted)]


def _packed_history(tower: HSTUTower, kv: list[Kept], offsets: np.ndarray,
                    tk: np.ndarray, tq: np.ndarray, backend: TowerBackend) -> CachedHistory:
    """One packed history of the batch from each user's keys / values [layers, n, H D]: what
    ``encode_history`` gives on ``backend``, for ``tower.extend`` to score candidates against."""
    k = kv[0][0] if len(kv) == 1 else torch.cat([p[0] for p in kv], dim=1)
    v = kv[0][1] if len(kv) == 1 else torch.cat([p[1] for p in kv], dim=1)
    off = torch.from_numpy(offsets)
    times, request = torch.from_numpy(tk), torch.from_numpy(tq[offsets[1:] - 1])
    if backend == "native":
        timed = tower.time_bias
        native = hstu_native.history(k, v, off, times if timed else None, request if timed else None)
        return CachedHistory([], off, times, request, native)
    c, t = tower.kv_dims(), k.shape[1]
    layers = [(k[i].view(t, c.heads, c.key_dim), v[i].view(t, c.heads, c.value_dim)) for i in range(k.shape[0])]
    sums = None
    if any(p.sums is not None for p in kv):  # (a bounded tower's, where this call updated them)
        sums = [[p.sums[i] if p.sums is not None else None for p in kv] for i in range(k.shape[0])]
    return CachedHistory(layers, off, times, request, sums=sums)
