"""Readings taken around a load-test step, besides the calls' own latencies.

* The server's per-user cache, from its Prometheus endpoint (``serve.metrics_port``): a
  :func:`scrape` before and after a step -> :func:`cache_figures`, the cache fields of a
  :class:`~genrec.loadtest.results.StepResult` (hit rate, the counters' growth, the gauges).
* The machine's CPU, from /proc/stat: :func:`cpu_times` before and after -> :func:`cpu_shares`,
  busy and steal percentages (the generator's own work included when it shares the machine).

Both read text over plain HTTP or a file: no Prometheus client library, nothing of the server.
"""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

# ----- the server's cache, from its Prometheus metrics ---------------------------------------------
CACHE_COUNTERS = ("history_tokens", "cached_tokens", "evicted_tokens", "hits", "misses")
CACHE_GAUGES = ("bytes", "users", "used_tokens", "capacity_tokens")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value}, summed over the samples' labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)[0], line.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str | None, timeout: float = 2.0) -> dict[str, float] | None:
    """The metrics at ``url`` (parse_metrics), or None without a url or an answer."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_metrics(r.read().decode())
    except (OSError, ValueError):
        return None


def cache_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """StepResult's cache fields from scrapes before and after a step: the counters' growth
    (``genrec_cache_<name>_total``), the hit rate (cached / history tokens), the gauges after
    (``genrec_cache_<name>``). None for what either scrape lacks (a server without a cache, an
    engine that does not count) and for a counter that went back (the server restarted)."""
    def value(m: dict[str, float] | None, name: str) -> float | None:
        if m is None:
            return None
        return m.get(f"genrec_cache_{name}_total", m.get(f"genrec_cache_{name}"))

    grown = {}
    for name in CACHE_COUNTERS:
        a, b = value(before, name), value(after, name)
        grown[name] = b - a if a is not None and b is not None and b >= a else None
    hist, cached = grown["history_tokens"], grown["cached_tokens"]
    return {"hit_rate": cached / hist if hist and cached is not None else None,
            **{f"cache_{n}": grown[n] for n in CACHE_COUNTERS},
            **{f"cache_{n}": value(after, n) for n in CACHE_GAUGES}}


# ----- the machine's CPU, from /proc/stat ------------------------------------------------------
def cpu_times() -> tuple[float, float, float] | None:
    """(busy, steal, total) CPU time of the whole machine so far, in clock ticks, from
    /proc/stat's first line; None where there is none (not Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, idle, iowait, irq, softirq, steal = (float(x) for x in fields[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq, steal, user + nice + system + idle + iowait + irq + softirq + steal


def cpu_shares(before: tuple[float, float, float] | None,
               after: tuple[float, float, float] | None) -> tuple[float, float]:
    """(busy %, steal %) of the machine's CPU time between two :func:`cpu_times` readings."""
    if before is None or after is None or after[2] <= before[2]:
        return math.nan, math.nan
    total = after[2] - before[2]
    return 100 * (after[0] - before[0]) / total, 100 * (after[1] - before[1]) / total

