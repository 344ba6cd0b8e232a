"""A small HDR-style latency histogram: log-linear buckets, bounded relative error.

Values (seconds) are recorded in microseconds into buckets of width 2^(e - sub_bits) for
the power of two 2^e the value falls in: each power of two splits into 2^(sub_bits - 1)
buckets, so every percentile is exact to within 2^-(sub_bits - 1) of its value (1.6% with
the default 7 bits; reported as its bucket's upper edge) whatever the range, in constant memory, and
histograms merge by adding counts (as in Gil Tene's HdrHistogram).

Example: ``h = Histogram(); h.record(0.0123); h.percentile(99)`` -> ~0.0123.
"""

from __future__ import annotations

import math

import numpy as np


class Histogram:
    """Latencies in seconds in, percentiles in seconds out (the upper edge of their bucket, at
    most the largest value recorded); ``counts[e, s]``: calls in bucket ``s`` of power ``e``."""

    def __init__(self, sub_bits: int = 7, max_seconds: float = 3600.0) -> None:
        self.sub = 1 << sub_bits
        self.sub_bits = sub_bits
        self.exps = int(math.log2(max_seconds * 1e6)) + 2
        self.counts = np.zeros((self.exps, self.sub), np.int64)
        self.total = 0
        self.min, self.max = math.inf, 0.0

    def _index(self, us: int) -> tuple[int, int]:
        if us < self.sub:
            return 0, us
        e = us.bit_length() - self.sub_bits
        return min(e, self.exps - 1), min((us >> e) - self.sub // 2, self.sub - 1) if e > 0 else us

    def record(self, seconds: float, count: int = 1) -> None:
        """Add ``count`` values of ``seconds`` (negative ones count as 0)."""
        us = max(int(seconds * 1e6), 0)
        e, s = self._index(us)
        self.counts[e, s] += count
        self.total += count
        self.min, self.max = min(self.min, seconds), max(self.max, seconds)

    def _value(self, e: int, s: int) -> float:
        """Upper edge (seconds) of a bucket: percentiles never understate latency."""
        if e == 0:
            return (s + 1) / 1e6
        return (((s + self.sub // 2) << e) + (1 << e)) / 1e6

    def percentile(self, p: float) -> float:
        """The value (seconds) at or below which ``p`` percent of the recorded values lie; NaN if none."""
        if self.total == 0:
            return math.nan
        rank = max(1, math.ceil(p / 100 * self.total))
        seen = 0
        for e in range(self.exps):
            row = self.counts[e]
            if seen + row.sum() < rank:
                seen += int(row.sum())
                continue
            for s in range(self.sub):
                seen += int(row[s])
                if seen >= rank:
                    return min(self._value(e, s), self.max)
        return self.max

    def merge(self, other: Histogram) -> None:
        """Add ``other``'s values (same ``sub_bits`` and ``max_seconds``) to this histogram."""
        self.counts += other.counts
        self.total += other.total
        self.min, self.max = min(self.min, other.min), max(self.max, other.max)
