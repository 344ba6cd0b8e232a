"""Users' encoded histories kept between calls: user id -> the window's events and every layer's
keys / values of its tokens, least recently used users evicted under a byte budget.

What a cached token is worth (HSTU): token j's keys / values at every layer depend on the
window's events 0..j (item, action, time, position in the window) and on token j's query time,
the next event's time (the last event's: the request time). A cached token is reused when
item, action, time and query time of every token up to it equal the request's: the longest
common prefix of the two windows (a window that moved has other events at each position, so
nothing matches). It is capped at n - 1: a call always encodes its last event again, at its
request time, and reads the user vector there. Histories that grow by a few events between
calls (the ads pipeline: 3-5 calls per page view) then encode only the new events.

An entry holds its user's keys k [layers, n, H * Dqk] and values v [layers, n, H * Dv] in the
layout of one history of the native backend (``kernels.hstu_native.NativeHistory``; the
PyTorch layers read views of it, [n, H, D] per layer) and the window's events as int64 arrays.
An entry in the cache is never written: a call either copies a reused prefix out, or *takes*
the entry out of the cache (``lookup(take=True)``), writes its new tokens into the entry's
storage after the prefix (``Entry.room``: storage for more tokens than it holds, so a history
that grows by a few events is not copied whole every call: 4 MiB a layer at 8,000 events)
and puts a new entry back. A taken entry is invisible to other calls, and the engine takes
one only while no other call of it runs (``serve.packed.PackedPath.encode_cached``): nobody
holds a view of the storage it writes. A failed call loses that user's entry; the cache stays
consistent either way.

The torch engine owns one (``TorchEngine(kv_cache_mb=)``); the SGLang engine keeps the same
prefixes in its radix cache (``pool_tokens``).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (the config is read by processes that have not imported torch yet: serve.worker)
    import torch

    from genrec.kernels.hstu_bounded import BlockSums


@dataclass(frozen=True)
class CacheConfig:
    """``[serve.cache]``: the engines' per-user K/V caches and the history window they rely on.

    ``kv_cache_mb`` defaults to on: a call without ``User.user_id`` is untouched by it, a call
    with one gets the same answer (within float rounding) for less tower work, and memory is
    bounded by the budget. ``window_block``: the window over histories longer than the model's
    moves in steps of this many events (``serve.requests.history_window``) so that a cached
    prefix survives new events; 1 slides it with every event (the tower always sees its last
    ``max_history`` events, but a long history's cache is then invalid after each new event).
    Set it where histories outgrow the window: 32 cost no NDCG@10 on ML-1M validation (+0.0003
    +- 0.0016 against 1 at the recipe's window of 199 events; benchmarks/notes/
    2026-12-03-long-histories.md); keep it a small fraction of the window (the tower then sees
    between window - block + 1 and window events). The default, 1, reads what a model was
    evaluated on. A block larger than a model's window is that window."""

    kv_cache_mb: float = 1024.0  # the torch engine's cache budget per engine process (MiB); 0: off
    window_block: int = 1  # events the window over a long history moves by (both engines)
    # the SGLang engine's KV pool (its radix cache and the batch being encoded), in tokens, as
    # SGLangEngine's own default: SGLang allocates the whole pool when it starts (a 2-layer tower
    # of 64 + 64 wide heads: 1 KiB a token), where the torch engine's budget is only an upper bound
    pool_tokens: int = 262144

    def __post_init__(self) -> None:
        if self.kv_cache_mb < 0:
            raise ValueError(f"serve.cache.kv_cache_mb = {self.kv_cache_mb}; it must be >= 0 (0: no cache)")
        if self.window_block < 1:
            raise ValueError(f"serve.cache.window_block = {self.window_block}; it must be at least 1")
        if self.pool_tokens < 1:
            raise ValueError(f"serve.cache.pool_tokens = {self.pool_tokens}; it must be at least 1")


@dataclass
class Entry:
    """One user's encoded window: its events [n] (int64) and keys / values of its n tokens."""

    items: np.ndarray
    actions: np.ndarray
    times: np.ndarray  # event times as the tower read them (positions where the user sent none)
    query_times: np.ndarray  # each token's query time (the next event's; the last: the request's)
    k: torch.Tensor  # [layers, n, H * Dqk]
    v: torch.Tensor  # [layers, n, H * Dv]
    # the storage k and v are the first n tokens of ([layers, capacity, width] each), where it
    # has room for more; None: k and v are the whole storage
    room: tuple[torch.Tensor, torch.Tensor] | None = None
    # a bounded tower's block summaries of these tokens per layer (None: not kept)
    sums: list[BlockSums | None] | None = None

    @property
    def tokens(self) -> int:
        return int(self.items.size)

    @property
    def held(self) -> int:
        """Tokens of storage the entry holds: its tokens and its room (the budget counts these
        and a bounded tower's block summaries: :meth:`nbytes`)."""
        return int(self.room[0].shape[1]) if self.room is not None else self.tokens

    def nbytes(self, token_bytes: int) -> int:
        """Bytes the entry holds (what the budget counts): ``held x token_bytes`` (its keys,
        values and events) and the storage of its block summaries, where it keeps them."""
        total, seen = self.held * token_bytes, set()
        for s in self.sums or ():
            for t in (s.kb, s.vb) if s is not None else ():
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total


# the events an entry matches on, in Entry's order
EVENT_FIELDS = ("items", "actions", "times", "query_times")


def common_prefix(entry: Entry, events: tuple[np.ndarray, ...]) -> int:
    """How many leading tokens of a window of ``events`` (items, actions, times, query times,
    [n] each) ``entry`` has encoded: its longest common prefix with the entry, at most n - 1."""
    n = events[0].size
    m = min(n - 1, entry.tokens)
    if m <= 0:
        return 0
    same = np.ones(m, bool)
    for name, new in zip(EVENT_FIELDS, events):
        same &= getattr(entry, name)[:m] == new[:m]
    return m if same.all() else int(np.argmin(same))


class KVCache:
    """user id -> :class:`Entry`, least recently used first out, under ``budget_bytes``.

    An entry costs what it holds (:meth:`Entry.nbytes`): ``token_bytes`` a token of storage (its
    keys and values in every layer, and its four event fields) and a bounded tower's block
    summaries. The budget is ``capacity_tokens`` whole tokens' bytes; an entry larger than that is
    not kept. Counters (:meth:`stats`): ``hits`` (lookups that reused >= 1 token), ``misses``,
    ``history_tokens`` (of every call the engine ran, cached or not), ``cached_tokens``
    (reused), ``evicted_tokens``; gauges ``users``, ``used_tokens`` (the bytes held in tokens'
    worth, rounded up: tokens of storage and their room, and summaries as the tokens their bytes
    would hold), ``capacity_tokens``, ``bytes`` (held). ``budget_bytes = 0``: a cache that keeps
    nothing (``enabled`` False)."""

    def __init__(self, budget_bytes: int, token_bytes: int) -> None:
        if token_bytes < 1:
            raise ValueError("token_bytes must be at least 1")
        self.token_bytes = int(token_bytes)
        self.capacity_tokens = max(int(budget_bytes), 0) // self.token_bytes
        self.budget_bytes = self.capacity_tokens * self.token_bytes  # (whole tokens)
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # oldest use first
        self.charged: dict[str, int] = {}  # user id -> the bytes its entry was charged when put
        self.used_bytes = 0
        self.lock = threading.Lock()  # (an in-process engine may run batches in several threads)
        self.counts = dict.fromkeys(("hits", "misses", "history_tokens", "cached_tokens", "evicted_tokens"), 0)

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    @property
    def used_tokens(self) -> int:
        """The bytes held in tokens' worth (rounded up): the held tokens where no entry keeps summaries."""
        return self._tokens(self.used_bytes)

    def _tokens(self, nbytes: int) -> int:
        return -(-nbytes // self.token_bytes)

    def _drop(self, user_id: str) -> Entry | None:
        """Removes the user's entry (lock held), returning it."""
        entry = self.entries.pop(user_id, None)
        if entry is not None:
            self.used_bytes -= self.charged.pop(user_id)
        return entry

    def lookup(self, user_id: str, events: tuple[np.ndarray, ...], take: bool = False) -> tuple[Entry | None, int]:
        """(the user's entry, how many leading tokens of the window ``events`` it has encoded:
        :func:`common_prefix`); (None, 0) for a user not cached or no token in common. Counts a
        hit or a miss and makes the user the most recently used. ``take``: a hit's entry leaves the cache (its caller may write its
        storage, and puts the user's new entry back)."""
        with self.lock:
            entry = self.entries.get(user_id)
            prefix = 0
            if entry is not None:
                self.entries.move_to_end(user_id)
                prefix = common_prefix(entry, events)
                if prefix and take:
                    self._drop(user_id)
            self.counts["hits" if prefix else "misses"] += 1
            self.counts["cached_tokens"] += prefix
        return (entry if prefix else None), prefix

    def count_history(self, tokens: int) -> None:
        """A call's history tokens (every call the engine runs, whether or not it is cached)."""
        with self.lock:
            self.counts["history_tokens"] += int(tokens)

    def put(self, user_id: str, entry: Entry) -> int:
        """Keeps ``entry`` as the user's (most recently used), replacing the user's last one,
        evicting the least recently used users until it fits; an entry larger than the budget
        is not kept (nor is the user's last one); one that fits without its room to grow is kept
        without the room (a copy), and one that fits only without its block summaries too is kept
        without them (a later call computes them again). Returns the tokens evicted (of other users)."""
        cost = entry.nbytes(self.token_bytes)
        if cost > self.budget_bytes:  # smaller first without its room, then without its summaries too
            smaller = replace(entry, room=None) if entry.room is not None else entry
            if smaller.nbytes(self.token_bytes) > self.budget_bytes and smaller.sums is not None:
                smaller = replace(smaller, sums=None)
            # (without its room, an entry keeps its tokens in copies, not views of the room)
            if entry.room is None or smaller.nbytes(self.token_bytes) <= self.budget_bytes:
                if entry.room is not None:
                    smaller = replace(smaller, k=entry.k.clone(), v=entry.v.clone())
                entry, cost = smaller, smaller.nbytes(self.token_bytes)
        with self.lock:
            self._drop(user_id)
            if cost > self.budget_bytes:
                return 0
            evicted = 0
            while self.used_bytes + cost > self.budget_bytes:
                gone = self._drop(next(iter(self.entries)))
                evicted += gone.tokens if gone is not None else 0
            self.entries[user_id] = entry
            self.charged[user_id] = cost
            self.used_bytes += cost
            self.counts["evicted_tokens"] += evicted
        return evicted

    def gauges(self) -> dict[str, int]:
        """users, used_tokens (the bytes held in tokens' worth: :attr:`used_tokens`), capacity_tokens
        and bytes (what the entries hold: their tokens, room and block summaries) now."""
        with self.lock:
            users, used = len(self.entries), self.used_bytes
        return {"users": users, "used_tokens": self._tokens(used), "capacity_tokens": self.capacity_tokens,
                "bytes": used}

    def stats(self) -> dict[str, int]:
        """The counters and the gauges (class docstring)."""
        with self.lock:
            counts = dict(self.counts)
        return {**counts, **self.gauges()}


def token_bytes(layers: int, key_width: int, value_width: int, element_bytes: int) -> int:
    """Bytes one cached token costs: keys and values of every layer (``element_bytes`` each),
    and its four int64 event fields."""
    return layers * (key_width + value_width) * element_bytes + 8 * len(EVENT_FIELDS)
