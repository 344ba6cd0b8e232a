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

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from genrec.models.hstu import JaggedMeta
from genrec.models.recommender import GenerativeRecommender, HistoryState
from genrec.serve.native import ServeKernels
from genrec.serve.requests import UserInput, history_window


def context_kjt(users: list[UserInput], names: list[str]) -> KeyedJaggedTensor:
    """The users' context features as the pooled tables take them (a feature a user lacks: no ids)."""
    vals = [u.context.get(f, np.zeros(0, np.int64)) for f in names for u in users]
    return KeyedJaggedTensor(keys=names, values=torch.from_numpy(np.concatenate(vals)),
                             lengths=torch.tensor([v.size for v in vals], dtype=torch.int64))


def packed_supports(model: GenerativeRecommender) -> bool:
    """Whether the packed path computes this model: an HSTU tower with the summed action
    encoding (one token per event) and no other sequence features."""
    feats = set(model.sparse.sequence_features)
    return (model.cfg.arch == "generative" and model.cfg.tower == "hstu" and not model.interleaved
            and feats <= {model.item_feature, "action"})


def pack_users(users: list[UserInput], cap: int, has_action: bool, block: int = 1) -> tuple[np.ndarray, ...]:
    """The batch's history rows packed (user by user, each cut to its window of at most ``cap``
    events moving in steps of ``block``, :func:`history_window`):
    items, actions (0 without an action table), event and query times (int64, as sent),
    positions [T], and lengths [B]. Users without timestamps use positions as times (event
    j at j, queried at j + 1), as ``models.tokens`` does; a history's last row is queried at
    the request time."""
    cuts = [history_window(u.items.size, cap, block) for u in users]
    lengths = np.array([u.items.size - c for u, c in zip(users, cuts)], np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise ValueError("every user needs at least one history event")
    items = np.concatenate([u.items[c:] for u, c in zip(users, cuts)]).astype(np.int64, copy=False)
    actions = (np.concatenate([u.actions[c:] for u, c in zip(users, cuts)]).astype(np.int64, copy=False)
               if has_action else np.zeros_like(items))
    times, qtimes = [], []
    for u, c, h in zip(users, cuts, lengths):
        if u.has_time:
            t = u.times[c:]
            times.append(t)
            qtimes += [t[1:], [u.request_time]]
        else:
            times.append(np.arange(h))
            qtimes.append(np.arange(1, h + 1))
    positions = np.concatenate([np.arange(h) for h in lengths])
    return (items, actions, np.concatenate(times).astype(np.int64), np.concatenate(qtimes).astype(np.int64),
            positions, lengths)


class PackedPath:
    """The engine's packed path for one model: ``encode(users)`` -> (user vectors [B, D],
    HistoryState), ``score(state, users, candidates)`` -> task probabilities per user. The
    histories are laid out once in numpy (no KeyedJaggedTensor), the token inputs made by
    ``model.summed_tokens`` or the native gathers, the tower run by the model's own
    ``encode_history_tokens`` / ``extend`` on ``backend`` ("torch" or "native")."""

    def __init__(self, model: GenerativeRecommender, backend: str = "torch", micro_batch: int = 4096,
                 stages: dict[str, float] | None = None) -> None:
        if not packed_supports(model):
            raise ValueError("the packed path needs an HSTU tower with summed action encoding and no other "
                             "sequence features")
        if backend == "native" and not model.tower.native_supported():
            raise ValueError("the tower's native backend does not cover this model here (fp32 dense weights, "
                             "widths in multiples of 8, the library built: HSTUTower.native_supported)")
        self.model, self.backend, self.micro_batch = model, backend, micro_batch
        self.kernels = ServeKernels(model) if backend == "native" else None
        if backend == "native":  # the weights laid out for the kernel now, not on the first request
            model.tower.native_weights()
        self.cap = model.cfg.max_seq_len - 1  # one position stays free for the candidates (serve.engine.schema_of)
        self.has_action = "action" in model.sparse.sequence_features
        self.stages = stages if stages is not None else {}  # seconds per stage, summed over calls

    def _mark(self, stage: str, t0: float) -> float:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - t0
        return now

    def encode(self, users: list[UserInput]) -> tuple[torch.Tensor, HistoryState]:
        """User vectors [B, D] and the encoded histories, through ``model.encode_history_tokens``."""
        if not torch.is_inference_mode_enabled():  # (the engine's run is in it already)
            with torch.inference_mode():
                return self.encode(users)
        t0 = time.perf_counter()
        m, k = self.model, self.kernels
        items, actions, tk, tq, positions, lens = pack_users(users, self.cap, self.has_action)
        if k is not None and k.rows is not None:
            x = k.tokens(items, actions if self.has_action else None, positions)
        else:
            x = m.summed_tokens(torch.from_numpy(items), torch.from_numpy(actions) if self.has_action else None,
                                torch.from_numpy(positions))[1]
        ctx = None
        if m.ranking is not None and m.ranking_context:
            ctx = (k.context(users) if k is not None and k.pooled is not None
                   else m.sparse.pooled(context_kjt(users, list(m.embedding_cfg.pooled_features))).values())
        offsets = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        offsets = torch.from_numpy(offsets)
        meta = JaggedMeta(offsets, int(lens.max()), torch.from_numpy(tk), torch.from_numpy(tq), None)
        t0 = self._mark("history_lookup", t0)
        out = m.encode_history_tokens(x, meta, ctx, self.backend)
        self._mark("history_tower", t0)
        return out

    def score(self, state: HistoryState, users: list[int], candidates: list[np.ndarray]) -> list[np.ndarray]:
        """Task probabilities [c, tasks] of each ``candidates[i]`` (table rows) for batch user
        ``users[i]``, through ``model.extend`` and the ranking head (in micro-batches of
        users on the PyTorch backend)."""
        m, k = self.model, self.kernels
        if m.ranking is None:
            raise ValueError("this model has no ranking tasks (model.ranking.tasks)")
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.score(state, users, candidates)
        counts = np.array([c.size for c in candidates], np.int64)
        tasks = len(m.cfg.ranking.tasks)
        if counts.sum() == 0:
            return [np.zeros((0, tasks), np.float32) for _ in candidates]
        groups, start, size = [], 0, 0
        for i, c in enumerate(counts):  # whole users per micro-batch (the native backend: all at once)
            if size and k is None and size + c > self.micro_batch:
                groups.append((start, i))
                start, size = i, 0
            size += c
        groups.append((start, len(candidates)))
        probs = [self._score_group(state, np.asarray(users[s:e], np.int64), candidates[s:e], counts[s:e])
                 for s, e in groups]
        probs = np.concatenate(probs)
        return np.split(probs, np.cumsum(counts)[:-1])

    def _score_group(self, state: HistoryState, users: np.ndarray, candidates: list[np.ndarray],
                     counts: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        m, k = self.model, self.kernels
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
        h = m.extend(state, x, owner_t, self.backend)
        t0 = self._mark("candidate_tower", t0)
        if k is not None and k.mlp is not None:  # the context's share of the first layer once per user
            cand_offsets = np.concatenate([[0], np.cumsum(counts)])
            logits = k.rank(h, rows, state.context, cand_offsets, users)
        else:
            logits = m.ranking(h, rows, state.context[owner_t] if state.context is not None else None)
        probs = torch.sigmoid(logits.float()).numpy()
        self._mark("ranking_head", t0)
        return probs
