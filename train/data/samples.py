"""From one user's events to one training or evaluation sample, and samples to a batch.

Retrieval splits (leave-one-out): ``train`` (events[:-2], every position predicts the
next), ``valid`` (predict events[-2]), ``test`` (predict events[-1]).

Ranking splits (a global time split, for data with timestamps and actions): events before
``cutoff_valid`` train, events in ``[cutoff_valid, cutoff_test)`` are ``rank_valid``
candidates, events from ``cutoff_test`` on are ``rank_test`` candidates: a user's first
``eval_candidates`` of them, in requests of ``num_candidates`` consecutive events, each after
every event before it (as a served request sees the log up to its time). A ranking sample is
a history plus up to K candidate events appended as *targets*: each candidate sees the
history and itself (``num_targets``), carries no action of its own (action id 0), and is
labelled per task from its action bitmask.

When ranking is on, a training sample is, with probability ``candidate_prob``, a history
cut at a random point with the next K events as candidates; otherwise a plain retrieval
window. Events at or after ``cutoff_valid`` never enter training, so no label is seen in
training as an input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from genrec.models.inputs import SequenceBatch, history_window

Split = Literal["train", "valid", "test", "rank_valid", "rank_test"]


@dataclass(frozen=True)
class RankingDataConfig:
    enabled: bool = False
    num_candidates: int = 16  # K candidates per training sample
    eval_candidates: int = 64  # at most this many held-out events per user in rank_valid / rank_test
    candidate_prob: float = 1.0  # share of training samples that carry candidates
    test_fraction: float = 0.1  # labelled events per held-out period (valid, then test), by time


@dataclass
class Sample:
    user: int
    items: np.ndarray  # history events then candidates
    times: np.ndarray
    qtimes: np.ndarray
    has_time: bool
    targets: np.ndarray  # retrieval: next item per history event (train), [1] (valid/test), [] (ranking eval)
    actions: np.ndarray | None = None  # per token action id; 0 = unknown (candidates)
    num_candidates: int = 0
    labels: np.ndarray | None = None  # [candidates, tasks]
    oracle: np.ndarray | None = None  # [candidates, tasks], NaN where unknown
    seen: np.ndarray | None = None  # everything before the target (eval)


@dataclass
class UserEvents:
    user: int
    items: np.ndarray
    times: np.ndarray | None
    actions: np.ndarray | None
    oracle: list[np.ndarray | None] = field(default_factory=list)  # one per task


def _times(ev: UserEvents, s: int, e: int, query: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Times of events [s, e) and their query times: event i is queried at the time of
    event i + 1, the last one at the time of event ``query`` (default e). Zeros without
    timestamps."""
    if ev.times is None:
        return np.zeros(e - s, np.int64), np.zeros(e - s, np.int64)
    qi = np.arange(s + 1, e + 1)
    if qi.size:
        qi[-1] = e if query is None else query
    return ev.times[s:e], ev.times[np.minimum(qi, ev.items.size - 1)]


def _has_time(ev: UserEvents, s: int, e: int) -> bool:
    """Whether events [s, e) are read at their timestamps: the user has them and none is 0 (a
    request's unset time). Else the tower reads positions, as the server decides it for the
    same window (``serve.requests``: all of the window's times > 0)."""
    return ev.times is not None and bool((ev.times[s:e] > 0).all())


def _actions(ev: UserEvents, s: int, e: int) -> np.ndarray | None:
    return None if ev.actions is None else ev.actions[s:e]


def retrieval_window(ev: UserEvents, end: int, span: int, rng: np.random.Generator | None) -> Sample:
    """A training window of events[:end]: inputs and next-item targets, ``span`` events long."""
    s = 0 if end <= span else (end - span if rng is None else int(rng.integers(0, end - span + 1)))
    e = min(end, s + span)
    t, q = _times(ev, s, e - 1, None)
    return Sample(ev.user, ev.items[s : e - 1], t, q, _has_time(ev, s, e - 1), ev.items[s + 1 : e],
                  actions=_actions(ev, s, e - 1))


def loo_eval(ev: UserEvents, end: int, max_len: int, block: int = 1) -> Sample:
    """History events[:end] (its last ``max_len`` events, the window's start a multiple of
    ``block``: ``models.inputs.history_window``), target events[end]; ``seen``: all of events[:end]."""
    s = history_window(end, max_len, block)
    t, q = _times(ev, s, end, end)
    return Sample(ev.user, ev.items[s:end], t, q, _has_time(ev, s, end), ev.items[end : end + 1],
                  actions=_actions(ev, s, end), seen=ev.items[:end])


def with_candidates(ev: UserEvents, hist_end: int, cand: np.ndarray, max_len: int, masks: list[int],
                    train: bool) -> Sample:
    """History events[:hist_end] (last max_len - len(cand)) plus candidate events ``cand``."""
    k = cand.size
    s = max(0, hist_end - (max_len - k))
    t, q = _times(ev, s, hist_end, int(cand[0]))
    req = ev.times[cand[0]] if ev.times is not None else 0
    items = np.concatenate([ev.items[s:hist_end], ev.items[cand]])
    times = np.concatenate([t, np.full(k, req, np.int64)])
    qtimes = np.concatenate([q, np.full(k, req, np.int64)])
    acts = np.concatenate([ev.actions[s:hist_end], np.zeros(k, np.int64)])
    labels = np.stack([(ev.actions[cand] & m) != 0 for m in masks], 1).astype(np.float32)
    oracle = np.stack([o[cand] if o is not None else np.full(k, np.nan, np.float32) for o in ev.oracle], 1) \
        if ev.oracle else None
    targets = ev.items[s + 1 : hist_end + 1] if train else np.zeros(0, np.int64)
    return Sample(ev.user, items, times, qtimes, _has_time(ev, s, hist_end), targets, actions=acts, num_candidates=k,
                  labels=labels, oracle=oracle)


def collate(samples: list[Sample], item_feature: str, with_actions: bool, context: dict[str, list[np.ndarray]],
            check_ids) -> SequenceBatch:  # noqa: ANN001 - (feature, ids, samples, lengths) -> ids
    """Samples -> one ``SequenceBatch`` (KJT keys: the item feature, then 'action' if used)."""
    lengths = [s.items.size for s in samples]
    users = [s.user for s in samples]
    items = check_ids(item_feature, np.concatenate([s.items for s in samples]), users, lengths)
    keys, values, lens = [item_feature], [items], list(lengths)
    if with_actions:
        acts = [s.actions if s.actions is not None else np.zeros(s.items.size, np.int64) for s in samples]
        keys.append("action")
        values.append(check_ids("action", np.concatenate(acts), users, lengths))
        lens += lengths
    targets = np.concatenate([s.targets for s in samples])
    targets = check_ids(item_feature, targets, users, [s.targets.size for s in samples])
    batch = SequenceBatch(
        seq=KeyedJaggedTensor(keys=keys, values=torch.from_numpy(np.concatenate(values)),
                              lengths=torch.tensor(lens, dtype=torch.int64)),
        max_len=max(lengths),
        timestamps=torch.from_numpy(np.concatenate([s.times for s in samples]).astype(np.int64)),
        query_times=torch.from_numpy(np.concatenate([s.qtimes for s in samples]).astype(np.int64)),
        has_time=torch.tensor([s.has_time for s in samples], dtype=torch.bool),
        targets=torch.from_numpy(targets),
        user_ids=torch.tensor(users, dtype=torch.int64),
    )
    if any(s.num_candidates for s in samples):
        batch.num_targets = torch.tensor([s.num_candidates for s in samples], dtype=torch.int64)
        batch.labels = torch.from_numpy(np.concatenate([s.labels for s in samples if s.num_candidates]))
        if samples[0].oracle is not None:
            batch.oracle = torch.from_numpy(np.concatenate([s.oracle for s in samples if s.num_candidates]))
    if any(s.seen is not None for s in samples):
        batch.seen_lengths = torch.tensor([s.seen.size for s in samples], dtype=torch.int64)
        # as table rows, as the items and targets (and the corpus, and what the server excludes)
        batch.seen_ids = torch.from_numpy(check_ids(item_feature, np.concatenate([s.seen for s in samples]), users,
                                                    [s.seen.size for s in samples]))
    if context:
        names = list(context)
        vals = [check_ids(f, np.concatenate(context[f]).astype(np.int64), users, [v.size for v in context[f]])
                for f in names]
        batch.context = KeyedJaggedTensor(
            keys=names, values=torch.from_numpy(np.concatenate(vals)),
            lengths=torch.tensor([v.size for f in names for v in context[f]], dtype=torch.int64))
    return batch
