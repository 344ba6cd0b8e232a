"""Fair shares between callers: who a call is from, and how much of the server it may hold.

The ads pipeline is several callers (tenants) on one serving tier; a retry storm from one of
them must not take the others' latency. Three layers, cheapest first, each checked before a
request is decoded:

1. gRPC's core (serve.server.ConnectionConfig): handler slots and the pending bound, for
   everyone at once (it cannot tell callers apart): a flood that keeps every slot and the
   pending queue full gets other callers' calls refused there too, before any share is
   checked. What holds them apart is that a caller's refused calls free their slots within a
   millisecond, so a flood fills the core's queues only once the front-end's event loop is
   saturated; where callers are not trusted, a proxy in front that limits each connection is
   the layer that keeps them apart.
2. :class:`Shares` (here): a caller's calls at once (``max_share`` of the handler slots, or
   its quota's ``max_concurrent``) and its rate (a token bucket, ``qps``): past either, its
   call is refused with RESOURCE_EXHAUSTED naming the caller, while other callers are admitted.
   The share is work-conserving: it binds only while another caller has sent a call within
   the last ``active_s`` seconds (a caller alone may use the whole server), and only a heavy
   caller, one that sent more than ``max_share`` of the recent calls (a light caller's bursts
   pass: a fixed count refused 18.6% of a Poisson caller's calls beside a flood,
   benchmarks/notes/2026-12-06-two-callers.md); a named quota always binds.
3. The batcher's fair queue (serve.batcher): each caller queues on its own and batches take
   calls from the callers in turn, so admitted calls of a flooding caller wait behind each
   other, not in front of everyone else's; and while another caller is active, a heavy caller
   (one sending more than ``max_share`` of the calls) holding more than ``max_share`` of the
   calls in the server is refused once the work ahead passes ``max_share`` of the queueing
   budget (``batch.max_queue_ms``), so its calls in the batches in flight, which every caller
   waits for, never take the budget the others need.

A caller is the value of the ``tenant`` metadata key (``metadata_key``), or without one its
peer's address (host, not port: one client's connections are one caller). A tenant name is
a claim, not an identity (anyone can send any name): put authentication in front (mTLS, a
proxy) where callers are not trusted; what this bounds is how much of the server one name gets.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from dataclasses import dataclass, field

from genrec.serve.batcher import Overloaded

MAX_NAME = 64  # characters of a caller's name (longer names: bounded_name)
# the metadata key the native front end (serve/cpp/front.cc) sets on each Recommender call it
# passes while callers contend: "heavy" or "light", its judgement of the caller (it sees every
# call, the server only those it lets through); a client's own value is dropped there
CONTENTION_KEY = "genrec-contention"


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits (``[[serve.fair.quotas]]``)."""

    tenant: str  # the metadata value it sends
    max_concurrent: int = 0  # its calls in the server at once (0: the share every caller gets)
    qps: float = 0.0  # calls admitted per second, sustained (0: no rate limit)
    burst_s: float = 1.0  # seconds of qps it may send at once (the token bucket's depth)

    def __post_init__(self) -> None:
        where = f"serve.fair.quotas, tenant {self.tenant!r}"
        if len(self.tenant) > MAX_NAME:  # (a longer caller's name is bounded by a digest: it would never match)
            raise ValueError(f"{where}: a tenant name has at most {MAX_NAME} characters")
        if self.max_concurrent < 0:
            raise ValueError(f"{where}: max_concurrent = {self.max_concurrent}; it must be >= 0 (0: the common share)")
        if not (math.isfinite(self.qps) and self.qps >= 0):
            raise ValueError(f"{where}: qps = {self.qps}; it must be a number >= 0 (0: no rate limit)")
        if not (math.isfinite(self.burst_s) and self.burst_s > 0):
            raise ValueError(f"{where}: burst_s = {self.burst_s}; it must be a number > 0")


@dataclass(frozen=True)
class FairConfig:
    """``[serve.fair]``: per-caller limits, checked before a request is decoded."""

    enabled: bool = True
    metadata_key: str = "tenant"  # callers name themselves with this metadata key
    # a caller's calls at once, as a fraction of the handler slots (connections.max_concurrent_rpcs):
    # one caller alone cannot take every slot, whatever it sends
    max_share: float = 0.5
    # a caller counts as active this long after its last call; while no other caller is, one
    # caller may hold every slot (the share is work-conserving)
    active_s: float = 1.0
    quotas: tuple[TenantQuota, ...] = field(default_factory=tuple)  # named tenants' own limits

    def __post_init__(self) -> None:
        if not 0 < self.max_share <= 1:
            raise ValueError(f"serve.fair.max_share = {self.max_share}; it must be in (0, 1]")
        if not (math.isfinite(self.active_s) and self.active_s >= 0):
            raise ValueError(f"serve.fair.active_s = {self.active_s}; it must be a number >= 0")
        # gRPC delivers metadata keys in lower case: any other key would never be found
        if not re.fullmatch(r"[0-9a-z_.-]+", self.metadata_key) or self.metadata_key.endswith("-bin") \
                or self.metadata_key.startswith("grpc-"):
            raise ValueError(f"serve.fair.metadata_key = {self.metadata_key!r}: a gRPC metadata key as it arrives "
                             "(lower-case letters, digits, '_', '-', '.'; not 'grpc-...' nor a '-bin' key)")
        if self.metadata_key == CONTENTION_KEY:
            raise ValueError(f"serve.fair.metadata_key = {CONTENTION_KEY!r} is the front end's own key for how a "
                             "caller stands; name callers by another")
        names = [q.tenant for q in self.quotas]
        if len(set(names)) != len(names) or "" in names:
            raise ValueError(f"serve.fair.quotas name each tenant once, none empty: {names}")


def bounded_name(name: str) -> str:
    """``name`` where it fits in MAX_NAME characters, else its head, "~" and 16 hex digits of a
    digest of the whole: a bounded key that still tells apart two names sharing a long prefix
    (cut alone, they were one caller, sharing one share). The native front end
    (serve/cpp/front.cc) bounds its callers' names the same way, with its own digest."""
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "replace"), digest_size=8).hexdigest()
    return f"{name[:MAX_NAME - 17]}~{digest}"


def caller_of(metadata: tuple | None, peer: str, key: str) -> str:
    """The caller's name: its ``key`` metadata value, else its peer's host ("ipv4:10.0.0.7")."""
    for k, v in metadata or ():
        if k == key:
            return bounded_name(v if isinstance(v, str) else v.decode(errors="replace"))
    host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer  # (the port dropped: "ipv4:h:p", "ipv6:[h]:p")
    return bounded_name(host)


class _Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``depth`` held."""

    def __init__(self, rate: float, depth: float) -> None:
        self.rate, self.depth, self.tokens, self.at = rate, depth, depth, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.depth, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Shares:
    """Calls each caller holds now, and its rate; :meth:`acquire` before the work,
    :meth:`release` after (in a ``finally``). Called from the event loop and, with the
    thread-pool listener (serve.frontend), from its handler threads: one lock around each."""

    def __init__(self, cfg: FairConfig, slots: int) -> None:
        self.cfg = cfg
        self.default = max(1, int(cfg.max_share * slots))
        self.quotas = {q.tenant: q for q in cfg.quotas}
        self.buckets = {q.tenant: _Bucket(q.qps, max(q.qps * q.burst_s, 1.0)) for q in cfg.quotas if q.qps > 0}
        self.slots = slots
        self.held: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        # the last call of the two callers seen most recently, newest first: whether another caller
        # is active needs only the newest one that is not the caller (no per-caller table to scan)
        self.recent: list[tuple[str, float]] = []
        # arrival rates (calls counted with weight exp(-age / active_s)) and occupancy (calls held,
        # averaged over time with the same weight): each (value, when), the callers' and everyone's
        self.rates: dict[str, tuple[float, float]] = {}
        self.total_rate = (0.0, 0.0)
        self.occupancy: dict[str, tuple[float, float]] = {}
        self.total_occupancy = (0.0, 0.0)
        self.total_held = 0
        self.pruned_at = 0.0
        self.lock = threading.Lock()

    def others_active(self, caller: str, now: float) -> bool:
        """Whether a caller other than ``caller`` sent a call within ``active_s`` seconds."""
        since = now - self.cfg.active_s
        return any(c != caller and t >= since for c, t in self.recent)

    def contended(self, caller: str) -> float | None:
        """``max_share`` for a heavy caller (:meth:`heavy`) while another caller is active, ``0.0``
        for a light one, else None (alone, or shares off): how ``Batcher.admit(..., share=)``
        holds it. A heavy caller gets ``max_share`` of the queueing budget; a light one's bursts
        ride on the budget the heavy caller leaves, and may wait up to twice it (the calls in
        flight it waits for are mostly the heavy caller's)."""
        if not self.cfg.enabled:
            return None
        with self.lock:
            now = time.monotonic()
            if not self.others_active(caller, now):
                return None
            return self.cfg.max_share if self.heavy(caller, now) else 0.0

    def _weight(self, at: float, now: float) -> float:
        return math.exp(-(now - at) / max(self.cfg.active_s, 1e-3))

    def _decayed(self, rate: tuple[float, float], now: float) -> float:
        return rate[0] * self._weight(rate[1], now)

    def _averaged(self, occupancy: tuple[float, float], held: int, now: float) -> float:
        """A time average of calls held (``held`` since its last update), brought to ``now``."""
        d = self._weight(occupancy[1], now)
        return occupancy[0] * d + held * (1.0 - d)

    def heavy(self, caller: str, now: float) -> bool:
        """Whether ``caller`` sent more than ``max_share`` of the calls of the last ~``active_s``,
        or held more than ``max_share`` of the calls in the server over that time (a caller of
        few, long calls is heavy by what it holds, a flood by what it sends)."""
        share = self.cfg.max_share
        if self._decayed(self.rates.get(caller, (0.0, now)), now) > share * self._decayed(self.total_rate, now):
            return True
        mine = self._averaged(self.occupancy.get(caller, (0.0, now)), self.held.get(caller, 0), now)
        return mine > share * self._averaged(self.total_occupancy, self.total_held, now)

    def _count(self, caller: str, now: float) -> None:
        self.rates[caller] = (self._decayed(self.rates.get(caller, (0.0, now)), now) + 1.0, now)
        self.total_rate = (self._decayed(self.total_rate, now) + 1.0, now)
        # callers come and go: keep those seen within a few active_s (checked once per active_s, so
        # a server with thousands of recent callers does not rebuild the tables on every call)
        if len(self.rates) > 4096 and now - self.pruned_at > self.cfg.active_s:
            self.pruned_at = now
            self.rates = {c: r for c, r in self.rates.items() if self._decayed(r, now) > 0.01 or c in self.held}
            self.occupancy = {c: o for c, o in self.occupancy.items() if c in self.rates}

    def _hold(self, caller: str, held: int, now: float) -> None:
        """``caller`` holds ``held`` calls from ``now`` on (occupancy brought up to date first)."""
        before = self.held.get(caller, 0)
        self.occupancy[caller] = (self._averaged(self.occupancy.get(caller, (0.0, now)), before, now), now)
        self.total_occupancy = (self._averaged(self.total_occupancy, self.total_held, now), now)
        self.total_held += held - before
        if held > 0:
            self.held[caller] = held
        else:
            self.held.pop(caller, None)  # (callers come and go: the dict holds only those in the server)

    def _seen(self, caller: str, now: float) -> None:
        self.recent = [(caller, now), *[(c, t) for c, t in self.recent if c != caller][:1]]

    def label(self, caller: str) -> str:
        """A bounded metrics label: the tenant's name where it has a quota, else "other"."""
        return caller if caller in self.quotas else "other"

    def acquire(self, caller: str) -> None:
        """Counts a call of ``caller`` in, or raises ``Overloaded`` naming the limit it passed."""
        if not self.cfg.enabled:
            return
        with self.lock:
            self._acquire(caller)

    def _acquire(self, caller: str) -> None:
        now = time.monotonic()
        self._seen(caller, now)
        self._count(caller, now)
        quota = self.quotas.get(caller)
        if quota and quota.max_concurrent:
            limit = quota.max_concurrent
        elif self.others_active(caller, now):  # a heavy caller's share; a light one may burst to twice it
            limit = self.default if self.heavy(caller, now) else min(2 * self.default, self.slots)
        else:  # alone: every slot
            limit = self.slots
        held = self.held.get(caller, 0)
        if held >= limit:
            self._refuse(caller)
            raise Overloaded(f"caller {caller!r} has {held} calls in the server, its share; retry with backoff")
        bucket = self.buckets.get(caller)
        if bucket is not None and not bucket.take():
            self._refuse(caller)
            raise Overloaded(f"caller {caller!r} is past its rate ({bucket.rate:g} calls/s); retry with backoff")
        self._hold(caller, held + 1, now)

    def release(self, caller: str) -> None:
        if not self.cfg.enabled:
            return
        with self.lock:
            self._hold(caller, max(self.held.get(caller, 0) - 1, 0), time.monotonic())

    def _refuse(self, caller: str) -> None:
        key = self.label(caller)
        self.refused[key] = self.refused.get(key, 0) + 1
