"""What a batch cost and what it reused: seconds per stage, and each result's history tokens.

``mark`` adds a stage's seconds to an engine's ``stages`` (the contract's ``Engine.stages``);
``Accounting`` fills each result's ``history_tokens`` (the window the tower read),
``cached_tokens`` / ``evicted_tokens`` (what the per-user K/V cache gave it and took from other
users) and the cache's gauges after the batch, and counts history tokens in the cache's stats.
"""

from __future__ import annotations

import time

import numpy as np

from genrec.serve.contract import Result
from genrec.serve.kvcache import KVCache
from genrec.serve.requests import UserInput, Work, history_window


def mark(stages: dict[str, float], stage: str, t0: float) -> float:
    """Adds the seconds since ``t0`` to ``stages[stage]``; returns now (the next stage's t0)."""
    now = time.perf_counter()
    stages[stage] = stages.get(stage, 0.0) + now - t0
    return now


def stamp(results: list[Result], t0: float) -> list[Result]:
    """Each result of a batch begun at ``t0`` (perf_counter) gets the batch's compute time and size."""
    ms = (time.perf_counter() - t0) * 1e3
    for r in results:
        r.compute_ms, r.batch_size = ms, len(results)
    return results


class Accounting:
    """History tokens of works on a model whose window holds ``max_history`` events, moving in
    steps of ``window_block``, with ``cache`` (a cache of 0 bytes keeps nothing but counts)."""

    def __init__(self, cache: KVCache, max_history: int, window_block: int) -> None:
        self.cache, self.max_history, self.window_block = cache, max_history, window_block

    def history_tokens(self, user: UserInput) -> int:
        """The tokens of ``user``'s history the tower reads (its window)."""
        n = user.items.size
        return n - history_window(n, self.max_history, self.window_block)

    def account(self, works: list[Work], results: list[Result], cached: np.ndarray | None = None,
                evicted: np.ndarray | None = None) -> list[Result]:
        """Each result's history tokens; with ``cached`` / ``evicted`` (per work [B], from a
        cached encode, which counted the batch's history itself) its cache fields and gauges."""
        gauges = self.cache.gauges() if cached is not None else None
        tokens = [self.history_tokens(w.user) for w in works]
        if cached is None:
            self.cache.count_history(sum(tokens))
        for i, (w, r) in enumerate(zip(works, results)):
            r.history_tokens = tokens[i]
            if cached is not None and evicted is not None:
                r.cached_tokens, r.evicted_tokens = int(cached[i]), int(evicted[i])
                r.cache_lookup, r.cache_gauges = bool(w.user.user_id), gauges
        return results
