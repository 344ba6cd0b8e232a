"""What flows into a model: one jagged batch of user sequences.

Example, B=2 users with histories [5, 9, 2] and [7] (T = 3 + 1 = 4 events)::

    seq          KJT keys ["item"], values [5, 9, 2, 7], lengths [3, 1]
    timestamps   [T] event times in seconds (0 where the user has none)
    query_times  [T] the time each position predicts for: the next event's time, or the
                 request time for the last one (0 where unknown)
    has_time     [B] whether the user's events carry real timestamps; when not, towers
                 fall back to positions
    targets      [T] next item per position (training) or [B] one target per user (eval)
    num_targets  [B] how many trailing events are ranking candidates (None: none)
    labels       [C, tasks] 0/1 per candidate (the trailing num_targets events), ranking only
    oracle       [C, tasks] true probabilities when the data knows them (synthetic), else NaN
    context      KJT of pooled per-user features, or None
    seen_ids     eval only: every item the user had before the target, untruncated, so the
    seen_lengths full-corpus protocol can exclude the whole history ([E] ids, [B] lengths)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchrec import KeyedJaggedTensor


@dataclass
class SequenceBatch:
    seq: KeyedJaggedTensor
    max_len: int
    timestamps: torch.Tensor | None = None
    query_times: torch.Tensor | None = None
    has_time: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    context: KeyedJaggedTensor | None = None
    user_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    oracle: torch.Tensor | None = None
    seen_ids: torch.Tensor | None = None
    seen_lengths: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.seq.lengths()[: self.batch_size]

    @property
    def batch_size(self) -> int:
        return self.seq.stride()

    def to(self, device: torch.device, non_blocking: bool = False) -> SequenceBatch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, KeyedJaggedTensor)):
                v = v.to(device, non_blocking=non_blocking)
            kw[f.name] = v
        return SequenceBatch(**kw)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, KeyedJaggedTensor)):
                v.record_stream(stream)

    def pin_memory(self) -> SequenceBatch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, KeyedJaggedTensor)):
                v = v.pin_memory()
            kw[f.name] = v
        return SequenceBatch(**kw)


def history_capacity(max_seq_len: int, tokens_per_event: int = 1, ranked: bool = False) -> int:
    """History events a tower of ``max_seq_len`` positions reads for one user.

    A ranking model (``ranked``: it has ranking tasks) keeps one position free for its
    candidates, which sit right after the history; a retrieval-only model reads the user state
    at the last history event and fills every position. Interleaved action tokens
    (``tokens_per_event`` 2) halve it. Offline evaluation (``train.data.reader``) and serving
    (``serve.layout.served_schema``, ``serve.packed``) take the window from here, so both read the same events.

    >>> history_capacity(200), history_capacity(200, ranked=True), history_capacity(200, 2, True)
    (200, 199, 99)
    """
    return (max_seq_len - int(ranked)) // tokens_per_event


def history_window(n: int, cap: int, block: int = 1) -> int:
    """The first of ``n`` history events a tower of ``cap`` history positions reads.

    The window over a long history moves in steps of ``block`` events: it starts at the
    smallest multiple of ``block`` that leaves at most ``cap`` events, so between steps a
    growing history keeps its first event (and every cached key and value after it) and
    the tower sees between ``cap - block + 1`` and ``cap`` events. ``block = 1``: the last
    ``cap`` events, a window that slides with every new event. Evaluation
    (``train.data.samples.loo_eval``) and serving (``serve.engine``, ``serve.packed``, the
    SGLang engine) cut histories with this one function.

    >>> history_window(10, 8), history_window(10, 8, 4), history_window(13, 8, 4)
    (2, 4, 8)
    """
    if not 1 <= block <= cap:
        raise ValueError(f"the history window's block ({block}) must be between 1 and the window ({cap})")
    return 0 if n <= cap else -(-(n - cap) // block) * block
