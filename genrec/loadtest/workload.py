"""Request workloads: what the load generator sends, as serialized requests (bytes).

* A JSONL file of Recommend requests: :func:`make_workload` writes one from a dataset's latest
  user events, :func:`load_workload` reads it into a list of serialized requests (a sweep sends
  the list round and round).
* :class:`RepeatedUsers`: users who come back, several calls per page view, histories that grow
  between views. :class:`RepeatedUserWorkload` builds it as it is sent, an endless iterator of
  serialized Rank or Recommend requests over a catalogue of item ids (:func:`catalogue_ids`).

Either is the ``payloads`` of :func:`genrec.loadtest.runner.sweep`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from genrec.loadtest.client import user as client_user
from genrec.proto.v1 import recommender_pb2 as pb


# ----- a workload file --------------------------------------------------------------------------
def make_workload(data: str | Path, out: str | Path, n: int = 2000, history: int = 200, retrieve_k: int = 100,
                  top_k: int = 10, candidates: int = 0, with_actions: bool = False, seed: int = 0) -> Path:
    """Recommend requests from real users' latest events (JSONL, one request a line).

    ``with_actions`` keeps the events' action bitmasks and the user's context features
    (for ranking models with action and context tables)."""
    import pyarrow.dataset as ds

    # either dataset layout (train/data/schema.py), read without loading training code
    folder = Path(data) / "interactions"
    log = ds.dataset(folder if folder.is_dir() else Path(data) / "interactions.parquet", format="parquet",
                     partitioning="hive")
    ctx_cols = [c for c in log.schema.names if c.startswith("ctx_")] if with_actions else []
    t = log.to_table(columns=["item_ids", "timestamps", "actions", *ctx_cols])
    rng = np.random.default_rng(seed)
    rows = rng.choice(t.num_rows, size=n, replace=t.num_rows < n)
    items, times, acts = (t.column(c).to_pylist() for c in ("item_ids", "timestamps", "actions"))
    ctx = {c[4:]: t.column(c).to_pylist() for c in ctx_cols}
    with open(out, "w") as f:
        for r in rows:
            h = items[r][-history:]
            ts = (times[r] or [0] * len(items[r]))[-history:]
            ac = (acts[r] or [0] * len(items[r]))[-history:]
            req = {"history": [[int(i), int(x), int(a) if with_actions else 0] for i, x, a in zip(h, ts, ac)],
                   "retrieve_k": retrieve_k, "top_k": top_k}
            if ctx:
                req["context"] = {k: v[r] for k, v in ctx.items() if v[r]}
            if candidates:
                req["candidates"] = [[int(c), 1.0] for c in rng.choice(items[r], size=min(candidates, len(items[r])))]
            f.write(json.dumps(req) + "\n")
    return Path(out)


def load_workload(path: str | Path, columns: bool = True) -> list[bytes]:
    """JSONL requests -> serialized RecommendRequests (serialized once, before sending); the
    history as ``User.history_columns`` (packed arrays), or with ``columns=False`` as one
    ``Event`` message per event."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        user = client_user([tuple(e) for e in r["history"]], r.get("context", {}), columns=columns)
        req = pb.RecommendRequest(user=user, retrieve_k=r.get("retrieve_k", 0), top_k=r.get("top_k", 0),
                                  candidates=[pb.Candidate(item_id=i, bid=b) for i, b in r.get("candidates", [])])
        out.append(req.SerializeToString())
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


# ----- the repeated-user workload ----------------------------------------------------------------
EPOCH = 1_600_000_000  # the earliest first event (Unix seconds)


@dataclass(frozen=True)
class RepeatedUsers:
    """Users who come back (``genrec loadtest --workload repeated --repeated.KEY=VALUE``).

    A population of ``users``; user ``u`` (0-based) opens each page view with probability
    proportional to ``(u + 1) ** -zipf``. A page view is ``calls_per_view`` calls, sent one
    after another, with the same history and request time; before each of a user's page views
    after the first, ``appended`` events join the end of the history, later than the previous
    view's request time, and the new request time is later still. A first history holds
    ``history`` events. A call is a Rank of ``candidates`` given items or, with ``method =
    "Recommend"``, retrieves ``retrieve_k`` and returns ``top_k``. Ranges are inclusive, drawn
    uniformly. Each call carries ``User.user_id = user_prefix + str(u)``: engines that keep
    encoded histories file them under it (default prefix ``h{history}s{seed}u``, so workloads
    of different shapes against one server never share a user)."""

    catalogue: str = ""  # for the CLI: an artifact (its corpus ids) or a dataset (items.parquet) folder
    users: int = 1000
    zipf: float = 1.1
    history: int = 200
    calls_per_view: tuple[int, int] = (3, 5)
    appended: tuple[int, int] = (1, 5)
    candidates: tuple[int, int] = (100, 500)
    method: Literal["Rank", "Recommend"] = "Rank"
    retrieve_k: int = 100
    top_k: int = 10
    seed: int = 0
    user_prefix: str = ""

    def __post_init__(self) -> None:
        for name, least in (("calls_per_view", 1), ("appended", 0), ("candidates", 1)):
            r = getattr(self, name)
            if len(r) != 2 or not least <= r[0] <= r[1]:
                raise ValueError(f"repeated.{name} = {list(r)}: give [low, high] with {least} <= low <= high")
        if self.users < 1 or self.history < 1 or self.zipf < 0:
            raise ValueError(f"repeated: users ({self.users}) and history ({self.history}) must be at least 1, "
                             f"zipf ({self.zipf}) at least 0")


@dataclass(frozen=True)
class Call:
    """One call of the repeated-user workload: its serialized request and where it stands."""

    payload: bytes
    user: int
    view: int  # the user's page views before this one (0: the first; its history was never sent)
    index: int  # the call's place in its page view (0: the first)
    history: int  # events in the history sent
    candidates: int  # given candidates (0: Recommend retrieves)


@dataclass
class _Visitor:
    """What the generator keeps per user: the events appended since the first history (which
    is drawn again from the user's own seed when needed, so 8,000-event histories are never
    held), the request time and the page views so far."""

    request_time: int
    items: list[int] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    views: int = 0


class RepeatedUserWorkload:
    """:class:`RepeatedUsers` over a catalogue of item ids, as a stream built as it is read.

    >>> import itertools
    >>> w = RepeatedUserWorkload(RepeatedUsers(users=10, history=5, candidates=(2, 2)), np.arange(1, 50))
    >>> [(c.user, c.view, c.index, c.history) for c in itertools.islice(w.calls(), 12)][4:10]
    [(2, 0, 4, 5), (0, 0, 0, 5), (0, 0, 1, 5), (0, 0, 2, 5), (0, 0, 3, 5), (0, 1, 0, 7)]

    Deterministic under ``cfg.seed``: the sequence of page views comes from one generator, the
    events appended and the candidates from another, each user's first history from its own."""

    def __init__(self, cfg: RepeatedUsers, items: np.ndarray) -> None:
        self.items = np.unique(np.asarray(items, dtype=np.int64))
        if self.items.size == 0:
            raise ValueError("repeated users: the catalogue holds no item ids")
        if cfg.method == "Rank" and cfg.candidates[1] > self.items.size:
            raise ValueError(f"repeated.candidates = {list(cfg.candidates)}: the catalogue has {self.items.size} items")
        self.cfg = cfg
        self.prefix = cfg.user_prefix or f"h{cfg.history}s{cfg.seed}u"
        self.popularity = np.arange(1, cfg.users + 1, dtype=np.float64) ** -cfg.zipf
        self.popularity /= self.popularity.sum()
        self._cdf = np.cumsum(self.popularity)

    def views(self, chunk: int = 1024) -> Iterator[tuple[int, int, int]]:
        """(user, calls, events appended before it if the user was seen before) per page view, forever."""
        rng = np.random.default_rng((self.cfg.seed, 0))
        (c0, c1), (a0, a1) = self.cfg.calls_per_view, self.cfg.appended
        while True:
            users = np.minimum(np.searchsorted(self._cdf, rng.random(chunk), side="right"), self.cfg.users - 1)
            calls, appended = rng.integers(c0, c1 + 1, chunk), rng.integers(a0, a1 + 1, chunk)
            yield from zip(users.tolist(), calls.tolist(), appended.tolist())

    def first_history(self, user: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(item ids, increasing timestamps, request time) of ``user``'s first page view."""
        rng = np.random.default_rng((self.cfg.seed, 2, user))
        n = self.cfg.history
        items = self.items[rng.integers(0, self.items.size, n)]
        times = EPOCH + int(rng.integers(0, 86400 * 365)) + np.cumsum(rng.integers(1, 3600, n))
        return items, times, int(times[-1] + rng.integers(1, 60))

    def calls(self) -> Iterator[Call]:
        """Every call, forever, each request serialized when it is reached (the user's part
        once per page view)."""
        cfg, rng = self.cfg, np.random.default_rng((self.cfg.seed, 1))
        visitors: dict[int, _Visitor] = {}
        for user, n, k in self.views():
            base_items, base_times, first_request = self.first_history(user)
            v = visitors.get(user)
            if v is None:
                v = visitors[user] = _Visitor(first_request)
            else:  # new events after the last request, then a later request
                times = v.request_time + np.cumsum(rng.integers(1, 600, k))
                v.items += self.items[rng.integers(0, self.items.size, k)].tolist()
                v.times += times.tolist()
                v.request_time = int((times[-1] if k else v.request_time) + rng.integers(1, 60))
            cols = pb.EventColumns(item_ids=base_items.tolist() + v.items, timestamps=base_times.tolist() + v.times)
            # RankRequest and RecommendRequest both carry the user as field 1: serialized messages
            # concatenate into their merge, so the user is serialized once per page view
            head = pb.RankRequest(user=pb.User(history_columns=cols, request_time=v.request_time,
                                               user_id=f"{self.prefix}{user}")).SerializeToString()
            length = cfg.history + len(v.items)
            for j in range(n):
                if cfg.method == "Rank":
                    c = int(rng.integers(cfg.candidates[0], cfg.candidates[1] + 1))
                    ids = rng.choice(self.items, size=c, replace=False).tolist()
                    tail = pb.RankRequest(candidates=[pb.Candidate(item_id=i, bid=1.0) for i in ids])
                else:
                    c, tail = 0, pb.RecommendRequest(retrieve_k=cfg.retrieve_k, top_k=cfg.top_k)
                yield Call(head + tail.SerializeToString(), user, v.views, j, length, c)
            v.views += 1

    def payloads(self) -> Iterator[bytes]:
        return (c.payload for c in self.calls())

    def users_of(self, n_calls: int) -> list[int]:
        """The users the first ``n_calls`` calls visit, in order of their first visit."""
        seen: dict[int, None] = {}
        calls = 0
        for user, n, _ in self.views():
            if calls >= n_calls:
                break
            seen.setdefault(user, None)
            calls += n
        return list(seen)

    def first_calls(self, users: list[int]) -> Iterator[Call]:
        """A call carrying each user's first-view history, as the stream first sends it (a
        Rank of one candidate, or the Recommend): a cache primed with these holds every active
        user, so what the stream then measures is the steady state of a warm cache."""
        cfg = self.cfg
        for user in users:
            items, times, request = self.first_history(user)
            u = pb.User(history_columns=pb.EventColumns(item_ids=items.tolist(), timestamps=times.tolist()),
                        request_time=request, user_id=f"{self.prefix}{user}")
            if cfg.method == "Rank":
                req = pb.RankRequest(user=u, candidates=[pb.Candidate(item_id=int(self.items[0]), bid=1.0)])
            else:
                req = pb.RecommendRequest(user=u, retrieve_k=cfg.retrieve_k, top_k=cfg.top_k)
            yield Call(req.SerializeToString(), user, 0, 0, cfg.history, 1 if cfg.method == "Rank" else 0)

    def plan(self, n_calls: int) -> dict[str, int]:
        """What the first ``n_calls`` calls touch, without building them: distinct users, page
        views, and the users' history events at their last view (what a cache holding every
        active user holds), in all and at most for one user."""
        seen: dict[int, int] = {}
        calls = views = 0
        for user, n, k in self.views():
            if calls >= n_calls:
                break
            seen[user] = seen[user] + k if user in seen else self.cfg.history
            calls, views = calls + n, views + 1
        return {"users": len(seen), "views": views, "calls": calls, "tokens": sum(seen.values()),
                "max_history": max(seen.values(), default=0)}


def catalogue_ids(path: str | Path) -> np.ndarray:
    """Item ids of an artifact folder (its retrieval corpus) or a dataset folder (items.parquet)."""
    p = Path(path)
    if (p / "dense.safetensors").exists():
        from safetensors import safe_open

        with safe_open(str(p / "dense.safetensors"), "np") as f:
            return f.get_tensor("corpus_ids").astype(np.int64)
    if (p / "items.parquet").exists():
        import pyarrow.parquet as pq

        return pq.read_table(p / "items.parquet", columns=["item_id"]).column("item_id").to_numpy()
    raise FileNotFoundError(f"{path}: no dense.safetensors (an artifact) or items.parquet (a dataset) to take "
                            "item ids from; set repeated.catalogue to one of those folders")

