"""Synthetic ads-like interaction logs with known structure (the embedded default).

The default process is built so that the last item alone cannot tell what comes next but the
history can, as in real logs; each mechanism below says what a first-order (last item ->
next item) model such as the transition baseline cannot see. Per user:

* long-lived interests: a sparse Dirichlet mixture over ``num_topics`` topics (a few stable
  topics per user). Within a topic the items form a series (rank r, then r + 1: episodes,
  sequels, the next size of a consumable); the user's position in each topic's series is
  remembered across detours and sessions;
* sessions: the history is cut into sessions of ``session_len`` events on average
  (geometric); a session's first event comes after a long gap (log-normal, median
  ``session_gap_s``, against ``median_gap_s`` within a session) and opens a topic drawn from
  the user's mixture, resuming its series (``resume``: the item after the last one the user
  consumed in that topic, else a Zipf-popular draw). *First-order*: the last item belongs to
  the previous session, so its successors point into the old topic; the history holds the
  user's topics and the place reached in each, and the request time (the gap) says that a
  new session begins;
* within a session each event stays on the session's topic (``topic_stay``) and is then the
  successor of the topic's last item (``follow``) or a Zipf draw, or switches to another
  topic of the mixture, resuming its series as a session start does. This part is what a
  first-order model can learn, and the default makes it strong (one topic a session, series
  followed closely): the sequence model must match the transition baseline here, not avoid it;
* detours (``detour``): an event is one item of a topic drawn uniformly from the whole
  catalogue, outside the user's interests and any series; the next event returns to the
  session's series, after the item before the detour. *First-order*: after a detour the last
  item is the detour's, whose successors across users are scattered over their own series;
* repeat consumption (``repeat``): an event consumes again one of the ``repeat_window`` items
  before the last (re-orders, re-watches); the session's series then goes on. *First-order*:
  the re-consumed item's successors are those of its first consumption, often already
  consumed. As a target a repeat can never be returned by a server that excludes the history
  (evaluation does as serving does, so it is a miss for every model: docs/training.md);
  Zipf draws repeat popular items too;
* every event is an impression; a click is drawn from a hidden preference model,
  ``p = sigmoid(scale * <user, item> + click_bias)``, a conversion likewise given a click;
* lengths are log-normal.

``session_len = 0`` selects the earlier first-order process (:func:`first_order` gives it
with its defaults, row for row): each event stays on the current topic or redraws one from
the mixture, and is the successor of the previous item (``follow``) or a Zipf draw, with
repeats of the last ``repeat_window`` items (``repeat``) and log-normal gaps of median
``median_gap_s``; the next item then depends on the history only through the last item and
the topic mixture.

Long histories (``long_len`` > 0; off by default, and off leaves every row as it was; they
always use the first-order process, whatever ``session_len`` says): every
user has exactly ``long_len`` events (10^4 for the ads shape: ``genrec data synth
--long_len=10000 --num_users=2000 --num_items=20000 --num_topics=64 --repeat=0 --topic_stay=0.75
--follow=0.5 --interest_concentration=0.08``, the first-order process of the 2026-12-04 figures,
:func:`first_order`; ``topic_stay`` must be below 1, or a user never leaves the first topic) in
two eras. The past era (the first ``1 - long_recent``
of the history) draws its topics from one interest mixture, the recent era (the last
``long_recent``) from a second one; the hidden click preference is the average of both. After
the recent era's first ``long_quiet`` events, with probability ``long_return`` an event resumes
a past-era interest: a topic of the past mixture last seen in the past era (each at most once),
and the item after the last one the user consumed in it (a series resumed, a re-order a year
on); the next event goes back to the recent mixture. Such an event (column ``resumed`` = 1) is
predictable from the full history, which names the topic and its last item, and not from the
last ``long_quiet`` events, which never hold its topic; clicks on it follow a preference only
past-era clicks show. The ``segment`` context is the recent mixture's top topic (no leak of
the past era).

Item ids span ``[1, num_items]`` through an affine bijection of (topic, rank), so the
catalogue can be 10^8 ids without any O(catalogue) array. ``oracle_click`` and
``oracle_conversion`` hold each event's true probabilities, so the best achievable AUC of
a click / conversion model is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from genrec.train.data.schema import DatasetInfo, DatasetWriter, Layout, splitmix64

ACTIONS = ["impression", "click", "conversion"]
CONTEXT = {"segment": None, "device": 4, "region": 64}  # segment cardinality = num_topics


@dataclass(frozen=True)
class SyntheticConfig:
    num_users: int = 6000
    num_items: int = 5000  # size of the id space; up to 10^8
    num_topics: int = 32
    zipf: float = 1.05
    median_len: float = 40.0
    len_sigma: float = 0.9
    min_len: int = 5
    max_len: int = 400
    topic_stay: float = 1.0  # sessions: one topic each (first-order process: 0.75)
    follow: float = 0.85  # series are followed closely (first-order process: 0.5)
    # sessions (module docstring; 0: the first-order process, first_order())
    session_len: float = 4.0  # mean events per session (geometric)
    session_gap_s: float = 86400.0  # median gap before a session's first event (median_gap_s: within one)
    resume: float = 0.95  # a session start or switch continues the series of its topic, else a Zipf draw
    detour: float = 0.25  # share of events that are one item of a random topic, outside any series
    repeat: float = 0.05  # share of events that consume one of the last repeat_window items again
    repeat_window: int = 20
    long_len: int = 0  # > 0: every user has exactly this many events, in two eras (module docstring)
    long_recent: float = 0.3  # share of a long history in its recent era
    long_quiet: int = 1024  # recent-era events before the first resumption (> the window it defeats)
    long_return: float = 0.003  # per later recent-era event: the chance it resumes a past-era interest
    interest_concentration: float = 0.05  # a few stable topics per user (first-order process: 0.08)
    pref_dim: int = 16
    pref_scale: float = 2.0
    click_bias: float = -2.0
    conversion_bias: float = -1.5
    start_time: int = 1_700_000_000
    median_gap_s: float = 600.0
    seed: int = 0
    chunk_users: int = 8192


def first_order(**overrides: object) -> SyntheticConfig:
    """The generator before sessions (the default until 2026-12-05), row for row: no sessions,
    detours or repeats, so the next item depends on the history only through the last item and
    the topic mix. Callers whose figures or checks were taken on those rows pin it."""
    old = {"num_items": 20000, "num_topics": 64, "topic_stay": 0.75, "follow": 0.5, "interest_concentration": 0.08,
           "session_len": 0.0, "repeat": 0.0}
    return SyntheticConfig(**{**old, **overrides})  # type: ignore[arg-type]


def hashed_normal(ids: np.ndarray, dim: int, salt: int) -> np.ndarray:
    """A fixed N(0, 1) vector per id, computed from the id alone: [len(ids), dim]."""
    keys = ids.astype(np.uint64)[:, None] * np.uint64(2 * dim) + np.arange(2 * dim, dtype=np.uint64)
    u = (splitmix64(keys ^ np.uint64(salt)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    u1, u2 = np.clip(u[:, :dim], 1e-12, 1.0), u[:, dim:]
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)


class SyntheticWorld:
    """The hidden structure: topic vectors, the id bijection, the preference model."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        if cfg.num_items < cfg.num_topics * 2:
            raise ValueError("synthetic: num_items must be at least 2 * num_topics")
        if not 0.0 <= cfg.repeat < 1.0 or cfg.repeat_window < 1:
            raise ValueError("synthetic: repeat must be in [0, 1) and repeat_window at least 1")
        if cfg.session_len and (cfg.session_len < 1.0 or not 0.0 <= cfg.resume <= 1.0 or cfg.detour < 0.0
                                or cfg.detour + cfg.repeat >= 1.0):
            raise ValueError("synthetic: session_len must be 0 (off) or >= 1, resume in [0, 1], detour >= 0 and "
                             "detour + repeat < 1")
        if cfg.long_len < 0 or not 0.0 < cfg.long_recent < 1.0 or not 0.0 <= cfg.long_return <= 1.0:
            raise ValueError("synthetic: long_len must be >= 0, long_recent in (0, 1), long_return in [0, 1]")
        if cfg.long_quiet < 0:
            raise ValueError("synthetic: long_quiet must be >= 0")
        if cfg.long_len and cfg.topic_stay >= 1.0:  # one topic for ever: no past-era interest to resume
            raise ValueError("synthetic: long_len needs topic_stay < 1 (the first-order process's 0.75: "
                             "first_order()); with 1 a user never leaves the first topic")
        self.cfg = cfg
        self.per_topic = cfg.num_items // cfg.num_topics
        self.span = self.per_topic * cfg.num_topics
        a = 2654435761 % self.span or 1
        while math.gcd(a, self.span) != 1:
            a += 1
        self.mult, self.shift = a, 7919 % self.span
        rng = np.random.default_rng(cfg.seed + 1)
        self.topic_vecs = rng.standard_normal((cfg.num_topics, cfg.pref_dim))

    def item_id(self, topic: np.ndarray, rank: np.ndarray) -> np.ndarray:
        x = topic.astype(np.int64) * self.per_topic + rank
        return (self.mult * x + self.shift) % self.span + 1

    def item_topic(self, item: np.ndarray) -> np.ndarray:
        return self._index(item) // self.per_topic

    def item_rank(self, item: np.ndarray) -> np.ndarray:
        """An item's rank within its topic (:meth:`item_id`'s inverse, with :meth:`item_topic`)."""
        return self._index(item) % self.per_topic

    def _index(self, item: np.ndarray) -> np.ndarray:
        inv = pow(self.mult, -1, self.span)
        return ((item.astype(np.int64) - 1 - self.shift) % self.span) * inv % self.span

    def item_vectors(self, item: np.ndarray) -> np.ndarray:
        return self.topic_vecs[self.item_topic(item)] + 0.7 * hashed_normal(item, self.cfg.pref_dim, 17)

    def click_prob(self, user_vec: np.ndarray, items: np.ndarray) -> np.ndarray:
        aff = (self.item_vectors(items) * user_vec).sum(-1) / math.sqrt(self.cfg.pref_dim)
        return 1.0 / (1.0 + np.exp(-(self.cfg.pref_scale * aff + self.cfg.click_bias)))

    def zipf_rank(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Truncated Zipf ranks in [0, per_topic) by inverting the continuous power law."""
        s, m = self.cfg.zipf, self.per_topic
        u = rng.random(n)
        if abs(s - 1.0) < 1e-9:
            r = np.exp(u * math.log(m + 1))
        else:
            r = ((m + 1) ** (1 - s) - 1) * u + 1
            r = r ** (1 / (1 - s))
        return np.clip(np.floor(r).astype(np.int64) - 1, 0, m - 1)

    def zipf_probs(self) -> np.ndarray:
        """[per_topic]: the probability :meth:`zipf_rank` draws each rank (the power law's CDF
        between the rank's bounds)."""
        s, m = self.cfg.zipf, self.per_topic
        x = np.arange(1, m + 2, dtype=np.float64)
        cdf = np.log(x) / math.log(m + 1) if abs(s - 1.0) < 1e-9 else (x ** (1 - s) - 1) / ((m + 1) ** (1 - s) - 1)
        return np.diff(cdf)


def _mix_and_lengths(cfg: SyntheticConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray]:
    """n users' topic mixes [n, topics], their cumulative sums, and history lengths [n] (int64),
    drawn in this order from ``rng`` (both processes: the first draws of a chunk)."""
    mix = rng.dirichlet(np.full(cfg.num_topics, cfg.interest_concentration), size=n)
    lengths = np.clip(
        np.round(cfg.median_len * np.exp(cfg.len_sigma * rng.standard_normal(n))), cfg.min_len, cfg.max_len
    ).astype(np.int64)
    return mix, np.cumsum(mix, axis=1), lengths


def _users_chunk(world: SyntheticWorld, rng: np.random.Generator, first_user: int,
                 n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """One chunk's columns, and its users' hidden state (interest mixture [n, topics],
    preference vector [n, pref_dim]) for analyses that compare a model with the truth."""
    cfg = world.cfg
    if cfg.session_len > 0 and not cfg.long_len:
        return _session_chunk(world, rng, first_user, n)
    k = cfg.num_topics
    mix, cum, lengths = _mix_and_lengths(cfg, rng, n)
    long = cfg.long_len > 0
    if long:  # (every draw of this mode after the default's: its rows stay what they were)
        lengths = np.full(n, cfg.long_len, np.int64)
        recent_mix = rng.dirichlet(np.full(k, cfg.interest_concentration), size=n)
        recent_cum = np.cumsum(recent_mix, axis=1)
        recent_from = cfg.long_len - max(1, round(cfg.long_recent * cfg.long_len))
        last_rank = np.full((n, k), -1, np.int64)  # the rank of each user's last item per topic
        last_t = np.full((n, k), -1, np.int64)  # ... and its event's index
        resumed = np.zeros((n, cfg.long_len), np.int8)
        done = np.zeros((n, k), bool)  # past-era topics resumed already
    steps = int(lengths.max())
    topics = np.empty((n, steps), np.int64)
    ranks = np.empty((n, steps), np.int64)
    users = np.arange(n)

    def draw_topic(c: np.ndarray = cum) -> np.ndarray:
        return np.minimum((c < rng.random((n, 1))).sum(1), k - 1)

    topics[:, 0], ranks[:, 0] = draw_topic(), world.zipf_rank(rng, n)
    for t in range(1, steps):
        recent = long and t >= recent_from
        if long:
            last_rank[users, topics[:, t - 1]], last_t[users, topics[:, t - 1]] = ranks[:, t - 1], t - 1
        stay = rng.random(n) < cfg.topic_stay
        if recent:
            stay &= resumed[:, t - 1] == 0  # a resumed interest is one event; then the recent mixture
        topics[:, t] = np.where(stay, topics[:, t - 1], draw_topic(recent_cum if recent else cum))
        follow = stay & (rng.random(n) < cfg.follow)
        ranks[:, t] = np.where(follow, (ranks[:, t - 1] + 1) % world.per_topic, world.zipf_rank(rng, n))
        if cfg.repeat > 0:  # drawn only when on: the default's rows stay what they were
            again = np.flatnonzero(rng.random(n) < cfg.repeat)
            src = t - rng.integers(1, min(t, cfg.repeat_window) + 1, size=again.size)
            topics[again, t], ranks[again, t] = topics[again, src], ranks[again, src]
        if recent and t >= recent_from + cfg.long_quiet:  # a past-era interest resumed, once per topic
            topic = draw_topic()
            seen = last_t[users, topic]  # resumable: last seen in the past era (not since)
            back = np.flatnonzero((rng.random(n) < cfg.long_return) & ~done[users, topic]
                                  & (seen >= 0) & (seen < recent_from))
            topics[back, t], ranks[back, t] = topic[back], (last_rank[back, topic[back]] + 1) % world.per_topic
            done[back, topic[back]], resumed[back, t] = True, 1
    valid = np.arange(steps)[None, :] < lengths[:, None]
    items = world.item_id(topics[valid], ranks[valid])
    gaps = np.exp(math.log(cfg.median_gap_s) + 1.5 * rng.standard_normal(int(lengths.sum())))
    if long:
        mix = (mix + recent_mix) / 2  # the preference: both eras' interests
    extra = {"resumed": list(resumed)} if long else {}
    return _columns(world, rng, first_user, mix, recent_mix if long else mix, lengths, items, gaps, extra)


def _session_chunk(world: SyntheticWorld, rng: np.random.Generator, first_user: int,
                   n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """:func:`_users_chunk` for the session process (``session_len`` > 0; module docstring).

    Per user: ``series`` [n, topics] holds the rank of the last item consumed in each topic
    (-1: none yet), ``cur`` [n] the session's topic; an event is a session start, a detour,
    a repeat or a step of the session (stay and follow, or a switch to another interest)."""
    cfg = world.cfg
    k = cfg.num_topics
    mix, cum, lengths = _mix_and_lengths(cfg, rng, n)
    steps = int(lengths.max())
    topics = np.empty((n, steps), np.int64)
    ranks = np.empty((n, steps), np.int64)
    starts = np.zeros((n, steps), bool)  # the event opens a session (its gap is a between-session one)
    series = np.full((n, k), -1, np.int64)
    users = np.arange(n)

    def draw_topic() -> np.ndarray:
        return np.minimum((cum < rng.random((n, 1))).sum(1), k - 1)

    def resume_or_draw(topic: np.ndarray) -> np.ndarray:
        """The item after the user's last one in ``topic`` (with ``resume``), else a Zipf draw."""
        last = series[users, topic]
        go_on = (last >= 0) & (rng.random(n) < cfg.resume)
        return np.where(go_on, (last + 1) % world.per_topic, world.zipf_rank(rng, n))

    cur = draw_topic()
    topics[:, 0], ranks[:, 0], starts[:, 0] = cur, world.zipf_rank(rng, n), True
    series[users, cur] = ranks[:, 0]
    for t in range(1, steps):
        new = rng.random(n) < 1.0 / cfg.session_len
        u = rng.random(n)
        detour = ~new & (u < cfg.detour)
        again = ~new & ~detour & (u < cfg.detour + cfg.repeat) & (t >= 2)
        step = ~(new | detour | again)
        stay = step & (rng.random(n) < cfg.topic_stay)
        # a session start or an in-session switch: a topic of the user's interests, its series resumed
        cur = np.where(new | (step & ~stay), draw_topic(), cur)
        follow = stay & (rng.random(n) < cfg.follow)
        last = series[users, cur]
        rank = np.where(follow, (last + 1) % world.per_topic, world.zipf_rank(rng, n))
        rank = np.where(stay, rank, resume_or_draw(cur))
        topic = cur.copy()
        # a detour: one item of a topic drawn from the whole catalogue, outside the series
        wander = rng.integers(0, k, n)
        topic[detour], rank[detour] = wander[detour], world.zipf_rank(rng, n)[detour]
        # a repeat: one of the repeat_window items before the last, again
        src = t - 1 - rng.integers(1, min(max(t - 1, 1), cfg.repeat_window) + 1, size=n)
        topic[again], rank[again] = topics[again, src[again]], ranks[again, src[again]]
        topics[:, t], ranks[:, t], starts[:, t] = topic, rank, new
        moved = new | step  # only the session's own events advance a series
        series[users[moved], cur[moved]] = rank[moved]
    valid = np.arange(steps)[None, :] < lengths[:, None]
    items = world.item_id(topics[valid], ranks[valid])
    gaps = np.where(starts[valid], cfg.session_gap_s, cfg.median_gap_s) * np.exp(rng.standard_normal(items.size))
    return _columns(world, rng, first_user, mix, mix, lengths, items, gaps, {})


def _columns(world: SyntheticWorld, rng: np.random.Generator, first_user: int, mix: np.ndarray,
             segment_mix: np.ndarray, lengths: np.ndarray, items: np.ndarray, gaps: np.ndarray,
             extra: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """Both event processes' common tail: clicks and conversions from the hidden preference
    (``mix`` [n, topics] -> user vectors), timestamps from ``gaps`` [events], the context."""
    cfg, n = world.cfg, lengths.size
    user_vec = mix @ world.topic_vecs + 0.5 * rng.standard_normal((n, cfg.pref_dim))
    owner = np.repeat(np.arange(n), lengths)
    p_click = world.click_prob(user_vec[owner], items)
    click = rng.random(p_click.size) < p_click
    p_conv = 1.0 / (1.0 + np.exp(-(p_click * 4 - 2 + cfg.conversion_bias)))
    conv = click & (rng.random(p_click.size) < p_conv)
    actions = 1 | (click.astype(np.int64) << 1) | (conv.astype(np.int64) << 2)
    splits = np.cumsum(lengths)[:-1]
    starts = cfg.start_time + rng.integers(0, 30 * 86400, size=n)
    times = [(s + np.cumsum(g)).astype(np.int64) for s, g in zip(starts, np.split(gaps, splits))]
    return {
        **extra,
        "user_id": list(range(first_user, first_user + n)),
        "item_ids": np.split(items, splits),
        "timestamps": times,
        "actions": np.split(actions, splits),
        "oracle_click": np.split(p_click, splits),
        "oracle_conversion": np.split(p_click * p_conv, splits),
        "ctx_segment": [[int(t)] for t in segment_mix.argmax(1)],
        "ctx_device": [[int(d)] for d in rng.integers(0, CONTEXT["device"], n)],
        "ctx_region": [[int(r)] for r in rng.integers(0, CONTEXT["region"], n)],
    }, {"mix": mix, "user_vec": user_vec}


def chunk_users(cfg: SyntheticConfig) -> int:
    """Users generated together: ``chunk_users``, fewer for long histories (a chunk's [users,
    steps] draws stay near 2^22 entries)."""
    return min(cfg.chunk_users, max(1, 2**22 // cfg.long_len)) if cfg.long_len else cfg.chunk_users


def generate(cfg: SyntheticConfig, out: str | Path, progress: bool = True, layout: Layout | None = None) -> DatasetInfo:
    """Writes a synthetic dataset directory (``layout``: one file or partitioned); the rows
    are deterministic in ``cfg`` (including seed), whatever the layout."""
    world = SyntheticWorld(cfg)
    rng = np.random.default_rng(cfg.seed)
    context = {"segment": cfg.num_topics, "device": CONTEXT["device"], "region": CONTEXT["region"]}
    extra = {"synthetic": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    columns = {"oracle_click": "float32", "oracle_conversion": "float32"} | ({"resumed": "int8"} if cfg.long_len else {})
    with DatasetWriter(out, source="synthetic", action_names=ACTIONS, context_features=context, extra=extra,
                       extra_columns=columns,
                       layout=layout, progress=progress, total=cfg.num_users) as w:
        step = chunk_users(cfg)
        for first in range(0, cfg.num_users, step):
            w.write(_users_chunk(world, rng, first + 1, min(step, cfg.num_users - first))[0])
    return w.info


def hidden_users(cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    """The hidden state of every user of ``generate(cfg)`` (row i: user id i + 1), by replaying
    the same draws: ``mix`` [users, topics], ``user_vec`` [users, pref_dim]."""
    world, rng = SyntheticWorld(cfg), np.random.default_rng(cfg.seed)
    step = chunk_users(cfg)
    parts = [_users_chunk(world, rng, first + 1, min(step, cfg.num_users - first))[1]
             for first in range(0, cfg.num_users, step)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
