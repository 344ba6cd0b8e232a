"""Synthetic ads-like interaction logs with known structure (the embedded default).

Generative process, per user:
* interests: a sparse Dirichlet mixture over ``num_topics`` topics;
* each event stays in the current topic (``topic_stay``) or redraws one from the mixture;
* within a topic, the item is the successor of the previous item (``follow``: an
  item-to-item pattern a sequential model can learn) or a Zipf-popular draw;
* repeat consumption (``repeat``): with that probability an event instead consumes again
  one of the user's last ``repeat_window`` items (uniformly; its topic with it), as buyers
  re-order and viewers re-watch. Off by default; the Zipf draws alone already repeat
  popular items (on the default, 19% of the test targets are in their user's history,
  which a server that excludes the history can never return: docs/training.md);
* every event is an impression; a click is drawn from a hidden preference model,
  ``p = sigmoid(scale * <user, item> + click_bias)``, a conversion likewise given a click;
* timestamps are a heavy-tailed (log-normal) gap process; lengths are log-normal.

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
    num_items: int = 20000  # size of the id space; up to 10^8
    num_topics: int = 64
    zipf: float = 1.05
    median_len: float = 40.0
    len_sigma: float = 0.9
    min_len: int = 5
    max_len: int = 400
    topic_stay: float = 0.75
    follow: float = 0.5
    repeat: float = 0.0  # share of events that consume one of the last repeat_window items again
    repeat_window: int = 20
    interest_concentration: float = 0.08
    pref_dim: int = 16
    pref_scale: float = 2.0
    click_bias: float = -2.0
    conversion_bias: float = -1.5
    start_time: int = 1_700_000_000
    median_gap_s: float = 600.0
    seed: int = 0
    chunk_users: int = 8192


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
        inv = pow(self.mult, -1, self.span)
        x = ((item.astype(np.int64) - 1 - self.shift) % self.span) * inv % self.span
        return x // self.per_topic

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


def _users_chunk(world: SyntheticWorld, rng: np.random.Generator, first_user: int,
                 n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """One chunk's columns, and its users' hidden state (interest mixture [n, topics],
    preference vector [n, pref_dim]) for analyses that compare a model with the truth."""
    cfg = world.cfg
    k = cfg.num_topics
    mix = rng.dirichlet(np.full(k, cfg.interest_concentration), size=n)
    cum = np.cumsum(mix, axis=1)
    lengths = np.clip(
        np.round(cfg.median_len * np.exp(cfg.len_sigma * rng.standard_normal(n))), cfg.min_len, cfg.max_len
    ).astype(np.int64)
    steps = int(lengths.max())
    topics = np.empty((n, steps), np.int64)
    ranks = np.empty((n, steps), np.int64)

    def draw_topic() -> np.ndarray:
        return np.minimum((cum < rng.random((n, 1))).sum(1), k - 1)

    topics[:, 0], ranks[:, 0] = draw_topic(), world.zipf_rank(rng, n)
    for t in range(1, steps):
        stay = rng.random(n) < cfg.topic_stay
        topics[:, t] = np.where(stay, topics[:, t - 1], draw_topic())
        follow = stay & (rng.random(n) < cfg.follow)
        ranks[:, t] = np.where(follow, (ranks[:, t - 1] + 1) % world.per_topic, world.zipf_rank(rng, n))
        if cfg.repeat > 0:  # drawn only when on: the default's rows stay what they were
            again = np.flatnonzero(rng.random(n) < cfg.repeat)
            src = t - rng.integers(1, min(t, cfg.repeat_window) + 1, size=again.size)
            topics[again, t], ranks[again, t] = topics[again, src], ranks[again, src]
    valid = np.arange(steps)[None, :] < lengths[:, None]
    items = world.item_id(topics[valid], ranks[valid])
    gaps = np.exp(math.log(cfg.median_gap_s) + 1.5 * rng.standard_normal(int(lengths.sum())))
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
        "user_id": list(range(first_user, first_user + n)),
        "item_ids": np.split(items, splits),
        "timestamps": times,
        "actions": np.split(actions, splits),
        "oracle_click": np.split(p_click, splits),
        "oracle_conversion": np.split(p_click * p_conv, splits),
        "ctx_segment": [[int(t)] for t in mix.argmax(1)],
        "ctx_device": [[int(d)] for d in rng.integers(0, CONTEXT["device"], n)],
        "ctx_region": [[int(r)] for r in rng.integers(0, CONTEXT["region"], n)],
    }, {"mix": mix, "user_vec": user_vec}


def generate(cfg: SyntheticConfig, out: str | Path, progress: bool = True, layout: Layout | None = None) -> DatasetInfo:
    """Writes a synthetic dataset directory (``layout``: one file or partitioned); the rows
    are deterministic in ``cfg`` (including seed), whatever the layout."""
    world = SyntheticWorld(cfg)
    rng = np.random.default_rng(cfg.seed)
    context = {"segment": cfg.num_topics, "device": CONTEXT["device"], "region": CONTEXT["region"]}
    extra = {"synthetic": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    with DatasetWriter(out, source="synthetic", action_names=ACTIONS, context_features=context, extra=extra,
                       extra_columns={"oracle_click": "float32", "oracle_conversion": "float32"},
                       layout=layout, progress=progress, total=cfg.num_users) as w:
        for first in range(0, cfg.num_users, cfg.chunk_users):
            w.write(_users_chunk(world, rng, first + 1, min(cfg.chunk_users, cfg.num_users - first))[0])
    return w.info


def hidden_users(cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    """The hidden state of every user of ``generate(cfg)`` (row i: user id i + 1), by replaying
    the same draws: ``mix`` [users, topics], ``user_vec`` [users, pref_dim]."""
    world, rng = SyntheticWorld(cfg), np.random.default_rng(cfg.seed)
    parts = [_users_chunk(world, rng, first + 1, min(cfg.chunk_users, cfg.num_users - first))[1]
             for first in range(0, cfg.num_users, cfg.chunk_users)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
