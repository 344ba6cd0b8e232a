"""How a batch of users' histories is laid out for the tower, and the schema a model serves.

Two layouts of the same events (each history cut to its window, :func:`history_window`):

    packed   :func:`pack_users`: numpy rows user after user (items, actions, times, query
             times, positions [T], lengths [B]): the packed path's input (serve.packed)
    jagged   :func:`collate_users`: a ``SequenceBatch`` of KeyedJaggedTensors, candidates
             appended as targets: the model's own batch path (``encode_history``, ``rank``)

:func:`schema_of` / :func:`served_schema` say what a served model accepts (requests are
decoded against it); the latter from the artifact's configs alone, for a front end that
never builds the tower (serve.sglang_engine).
"""

from __future__ import annotations

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from genrec.embedding.spec import EmbeddingConfig
from genrec.models.inputs import SequenceBatch, history_capacity
from genrec.models.recommender import GenerativeRecommender, ModelConfig
from genrec.serve.requests import ModelSchema, UserInput, history_window


def served_schema(cfg: ModelConfig, emb: EmbeddingConfig, catalogue_size: int,
                  sid_sizes: tuple[int, ...] = ()) -> ModelSchema:
    """What a model of these configs accepts; ``sid_sizes``: its semantic-ID decoder's codes per
    level (() without a decoder)."""
    actions = (emb.table_of("action").num_embeddings or 1).bit_length() - 1 if "action" in emb.sequence_features else 0
    tasks = tuple(t.name for t in cfg.ranking.tasks)
    tpe = 2 if cfg.ranking.encoding == "interleaved" else 1  # tokens per event
    cap = history_capacity(cfg.max_seq_len, tpe, ranked=bool(tasks))  # as offline evaluation reads
    return ModelSchema(emb, actions, tasks, catalogue_size, cap,
                       cfg.sid.beam_width if sid_sizes else 0, tuple(sid_sizes))


def schema_of(model: GenerativeRecommender) -> ModelSchema:
    """What ``model`` accepts (:func:`served_schema` of its configs and catalogue)."""
    sid = model.sid_head
    return served_schema(model.cfg, model.embedding_cfg, int(model.corpus_ids.numel()),
                         tuple(sid.sizes) if sid is not None else ())


def context_kjt(users: list[UserInput], names: list[str]) -> KeyedJaggedTensor:
    """The users' context features as the pooled tables take them (a feature a user lacks: no ids)."""
    vals = [u.context.get(f, np.zeros(0, np.int64)) for f in names for u in users]
    return KeyedJaggedTensor(keys=names, values=torch.from_numpy(np.concatenate(vals)),
                             lengths=torch.tensor([v.size for v in vals], dtype=torch.int64))


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
    times: list[np.ndarray] = []
    qtimes: list[np.ndarray] = []
    for u, c, h in zip(users, cuts, lengths):
        if u.has_time:
            t = u.times[c:]
            times.append(t)
            qtimes += [t[1:], np.array([u.request_time])]
        else:
            times.append(np.arange(h))
            qtimes.append(np.arange(1, h + 1))
    positions = np.concatenate([np.arange(h) for h in lengths])
    return (items, actions, np.concatenate(times).astype(np.int64), np.concatenate(qtimes).astype(np.int64),
            positions, lengths)


def collate_users(users: list[UserInput], model: GenerativeRecommender, device: torch.device,
                  candidates: list[np.ndarray] | None = None, window_block: int = 1) -> SequenceBatch:
    """Histories (each cut to the tower's window, :func:`history_window`) -> a SequenceBatch;
    with ``candidates`` (one array per user) they are appended as targets, seen at the request time."""
    cap = schema_of(model).max_history
    cands = candidates or [np.zeros(0, np.int64)] * len(users)
    cut = [slice(history_window(u.items.size, cap, window_block), None) for u in users]
    items = [np.concatenate([u.items[c], k]) for u, c, k in zip(users, cut, cands)]
    lengths = [x.size for x in items]
    keys, values, lens = [model.item_feature], [np.concatenate(items)], list(lengths)
    if "action" in model.sparse.sequence_features:
        keys.append("action")
        values.append(np.concatenate([np.concatenate([u.actions[c], np.zeros(k.size, np.int64)])
                                      for u, c, k in zip(users, cut, cands)]))
        lens += lengths
    times, qtimes = [], []
    for u, c, k in zip(users, cut, cands):
        t = u.times[c]
        times.append(np.concatenate([t, np.full(k.size, u.request_time, np.int64)]))
        qtimes.append(np.concatenate([t[1:], [u.request_time], np.full(k.size, u.request_time, np.int64)]))
    batch = SequenceBatch(
        seq=KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                              lengths=torch.tensor(lens, dtype=torch.int64)),
        max_len=max(lengths), timestamps=torch.from_numpy(np.concatenate(times)),
        query_times=torch.from_numpy(np.concatenate(qtimes)),
        has_time=torch.tensor([u.has_time for u in users], dtype=torch.bool),
    )
    if candidates is not None:
        batch.num_targets = torch.tensor([k.size for k in cands], dtype=torch.int64)
    ctx_names = list(model.embedding_cfg.pooled_features)
    if ctx_names and model.ranking_context:
        batch.context = context_kjt(users, ctx_names)
    return batch.to(device)
