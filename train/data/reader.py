"""Streaming reader: Parquet user rows -> ``SequenceBatch`` (KJT + jagged times + targets).

Order of one epoch, fully determined by (seed, epoch, world_size) and the dataset's files:
1. units (a row group of a file: ``train.data.files``; files in sorted path order) in a
   seeded permutation, rows within each unit in a seeded permutation (a block shuffle: one
   group of ~8k users in memory at a time);
2. the ranks split that stream of n rows. One file: position p goes to rank
   ``p % world_size`` (every rank decodes every row group). A partitioned dataset: rank r
   takes the contiguous positions [r n/w, (r+1) n/w), so it reads only its own units (and
   at most the two it shares with its neighbours at the cuts), not the whole dataset. For
   training the tail is cut in both so every rank gets n // w samples: DDP and sharded
   embeddings need equal steps;
3. a rank's samples are cut into windows of ``sort_window`` batches, sorted by length
   inside the window and the batches of the window shuffled: batches of similar lengths
   waste less padding in attention.

``state_dict()`` is (epoch, batches done); loading it replays the plan and skips ahead,
so a resumed job sees exactly the samples it had not seen.

Splits (leave-one-out, as in SASRec / HSTU): ``train`` uses events[:-2] with every position
predicting the next; ``valid`` predicts events[-2] from events[:-2]; ``test`` predicts
events[-1] from events[:-1]. Histories keep their last ``max_seq_len`` events; with
``data.eval_window_block`` > 1 the valid / test window starts at a multiple of the block, as
a server that caches encoded histories cuts them (``models.inputs.history_window``).

``valid_users`` (default 1: every user) is the share of users whose events[-2] is held out
for validation, picked by a fixed hash of the user id; the others train on events[:-1].
0 is the HSTU code's protocol (train on events[:-1], no validation, test the last model).
The test target events[-1] never enters training.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from genrec.embedding.spec import EmbeddingConfig, IdOutOfRange, prepare_ids
from genrec.models.inputs import SequenceBatch, history_capacity
from genrec.train.data.files import InteractionFiles
from genrec.train.data.samples import (
    RankingDataConfig,
    Sample,
    Split,
    UserEvents,
    collate,
    loo_eval,
    retrieval_window,
    with_candidates,
)
from genrec.train.data.schema import (
    CONTEXT_PREFIX,
    MIN_EVENTS,
    REMAKE,
    DataFormatError,
    read_info,
)


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/synthetic"
    batch_size: int = 128
    eval_batch_size: int = 256
    train_window: Literal["last", "random"] = "last"
    # valid / test: the history window starts at a multiple of this many events (a server's
    # ``window_block``, which keeps a cached prefix while a history grows), so evaluation reads
    # what that server reads; 1: the last max_seq_len events
    eval_window_block: int = 1
    sort_window: int = 16  # batches per length-sorting window; 0 keeps the shuffled order
    context_features: bool = False  # read ctx_* columns into batch.context
    # share of users whose events[-2] is held out for validation (hash of the user id);
    # the rest also train on it. 0: no validation split (the HSTU code's protocol).
    valid_users: float = 1.0
    ranking: RankingDataConfig = field(default_factory=RankingDataConfig)


class _Group:
    """One row group of ``file`` decoded into flat numpy arrays (list offsets + values)."""

    def __init__(self, table, columns: list[str], file: Path) -> None:  # noqa: ANN001 - a pyarrow Table
        self.file = file
        self.user_id = table.column("user_id").to_numpy()
        self.cols: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for name in columns:
            arr = table.column(name).combine_chunks()
            valid = ~arr.is_null().to_numpy(zero_copy_only=False)
            offsets = arr.offsets.to_numpy()
            values = arr.values.to_numpy(zero_copy_only=False)
            self.cols[name] = (offsets, values, valid)
        off = self.cols["item_ids"][0]
        self.lengths = off[1:] - off[:-1]

    def get(self, name: str, row: int) -> np.ndarray | None:
        offsets, values, valid = self.cols[name]
        if not valid[row]:
            return None
        return values[offsets[row] : offsets[row + 1]]


class SequenceReader:
    """Iterates one split of a dataset directory as ``SequenceBatch`` es.

    ``for batch in reader`` runs the rest of the current epoch; ``set_epoch`` starts another.
    """

    def __init__(
        self,
        path: str | Path,
        split: Split,
        *,
        embedding: EmbeddingConfig,
        max_seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool | None = None,
        even: bool | None = None,
        train_window: Literal["last", "random"] = "last",
        sort_window: int = 16,
        context_features: bool = False,
        ranking: RankingDataConfig | None = None,
        tasks: dict[str, int] | None = None,
        tokens_per_event: int = 1,
        valid_users: float = 1.0,
        window_block: int = 1,
    ) -> None:
        if not 0.0 <= valid_users <= 1.0:
            raise ValueError(f"data.valid_users must be in [0, 1], got {valid_users}")
        window = history_capacity(max_seq_len, tokens_per_event, ranked=bool(tasks))  # (as served)
        if not 1 <= window_block <= max(window, 1):
            raise ValueError(f"data.eval_window_block must be between 1 and the events the tower reads "
                             f"({window}), got {window_block}")
        self.window_block = window_block
        self.valid_users = valid_users
        self.path = Path(path)
        self.info = read_info(self.path)
        self.log = InteractionFiles(self.path)  # footers only; row groups are read as the plan needs them
        if self.log.num_rows != self.info.num_users:  # (a stray or stale file would be read as more users)
            raise DataFormatError(f"{self.path}: the interactions files hold {self.log.num_rows} rows but "
                                  f"dataset.json says {self.info.num_users} users; the files do not belong "
                                  f"together (a stray or stale file?): {REMAKE}")
        self.split, self.embedding, self.max_seq_len = split, embedding, max_seq_len
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world_size
        self.shuffle = (split == "train") if shuffle is None else shuffle
        self.even = (split == "train") if even is None else even
        if max_seq_len < 2:
            raise ValueError("max_seq_len must be at least 2")
        self.train_window, self.sort_window = train_window, sort_window
        self.item_table = embedding.item_table
        self.context = [f for f in embedding.pooled_features if context_features]
        missing = [f for f in self.context if CONTEXT_PREFIX + f not in self.log.schema.names]
        if missing:
            raise DataFormatError(f"{self.log.paths[0]}: no column '{CONTEXT_PREFIX}{missing[0]}' for context "
                                  f"feature '{missing[0]}'")
        self.ranking = ranking or RankingDataConfig()
        self.tpe = tokens_per_event
        self.task_masks = list((tasks or {}).values())
        self.oracle_columns = [f"oracle_{t}" for t in (tasks or {})]
        names = self.log.schema.names
        self.with_actions = "action" in embedding.sequence_features
        if split.startswith("rank") and not self.task_masks:
            raise ValueError(f"split '{split}' needs ranking tasks (model.ranking.tasks)")
        self.columns = ["item_ids", "timestamps"] + [CONTEXT_PREFIX + f for f in self.context]
        if self.with_actions or self.task_masks:
            self.columns.append("actions")
        self.columns += [c for c in self.oracle_columns if c in names]
        self.cutoffs = ranking_cutoffs(self.path, self.ranking.test_fraction) if self.ranking.enabled else (np.inf, np.inf)
        self.group_rows = [u.rows for u in self.log.units]
        self.num_rows = self.log.num_rows
        self.epoch, self.batches_done = 0, 0
        self._cache: dict[int, _Group] = {}
        self._window: set[int] = set()  # the units of the sort window being batched
        self._samples: list[tuple[int, int]] = []  # (unit, row) of the batch being built: errors name its file

    # ----- resumable position -------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done, "seed": self.seed,
                "world_size": self.world, "rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"reader state was saved with seed {state['seed']}, this reader has {self.seed}")
        if state.get("world_size", self.world) != self.world:
            # A different world size reshuffles the epoch; restart it rather than skip blindly.
            self.epoch, self.batches_done = int(state["epoch"]), 0
            return
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.batches_done = epoch, 0

    # ----- the plan -----------------------------------------------------------------------
    def _group(self, g: int) -> _Group:
        """Unit ``g`` decoded. Kept: every unit of the current sort window (its batches draw
        from all of them in turn: a window can span several small files), else the last two."""
        if g in self._cache:
            self._cache[g] = self._cache.pop(g)  # most recently used last
            return self._cache[g]
        while len(self._cache) >= 2:
            old = next((k for k in self._cache if k not in self._window), None)
            if old is None:
                break
            del self._cache[old]
        # a damaged page surfaces here, mid-epoch: read_unit names the file and rows, not just Arrow's words
        table = self.log.read_unit(g, ["user_id", *self.columns])
        self._cache[g] = _Group(table, self.columns, self.log.paths[self.log.units[g].file])
        return self._cache[g]

    def _span(self) -> range:
        """This rank's positions in the epoch's stream of rows (step 2 of the module docstring)."""
        n, w, r = self.num_rows, self.world, self.rank
        if not self.log.partitioned:  # interleaved: the order of every earlier run, kept so they resume the same
            return range(r, (n // w) * w if self.even else n, w)
        if self.even:
            return range(r * (n // w), (r + 1) * (n // w))
        return range(r * n // w, (r + 1) * n // w)

    def _rank_samples(self) -> Iterator[tuple[int, int]]:
        """(unit, row) of this rank's samples, in epoch order."""
        rng = np.random.default_rng([self.seed, self.epoch])
        n_groups = len(self.group_rows)
        order = rng.permutation(n_groups) if self.shuffle else np.arange(n_groups)
        span = self._span()
        pos = 0
        for g in order:
            n = self.group_rows[g]
            if pos >= span.stop or pos + n <= span.start:  # none of this rank's: never read
                pos += n
                continue
            rows = np.random.default_rng([self.seed, self.epoch, int(g)]).permutation(n) if self.shuffle else np.arange(n)
            p = np.arange(pos, pos + n)
            take = (p >= span.start) & (p < span.stop) & ((p - span.start) % span.step == 0)
            for r in rows[take]:
                yield int(g), int(r)
            pos += n

    def _batches(self) -> Iterator[list[tuple[int, int]]]:
        window = max(self.sort_window, 1) * self.batch_size
        rng = np.random.default_rng([self.seed, self.epoch, 1 << 20])
        buf: list[tuple[int, int]] = []

        def flush() -> Iterator[list[tuple[int, int]]]:
            self._window = {g for g, _ in buf}
            if self.sort_window:
                buf.sort(key=lambda s: self._group(s[0]).lengths[s[1]])
            chunks = [buf[i : i + self.batch_size] for i in range(0, len(buf), self.batch_size)]
            if self.sort_window and self.shuffle:
                chunks = [chunks[i] for i in rng.permutation(len(chunks))]
            yield from chunks

        for s in self._rank_samples():
            buf.append(s)
            if len(buf) == window:
                yield from flush()
                buf = []
        if buf:
            yield from flush()

    def __len__(self) -> int:
        mine = len(self._span())
        window = max(self.sort_window, 1) * self.batch_size
        full, rest = divmod(mine, window)
        return full * (window // self.batch_size) + -(-rest // self.batch_size)

    def __iter__(self) -> Iterator[SequenceBatch]:
        for i, samples in enumerate(self._batches()):
            if i < self.batches_done:
                continue
            batch = self._build(samples, i)
            self.batches_done = i + 1
            if batch is not None:
                yield batch

    # ----- building a batch ---------------------------------------------------------------
    def _events(self, grp: _Group, r: int) -> UserEvents:
        seq = grp.get("item_ids", r)
        ts = grp.get("timestamps", r)
        if seq.size < MIN_EVENTS:
            raise DataFormatError(
                f"{grp.file}: user {grp.user_id[r]} has {seq.size} events; leave-one-out "
                f"needs at least {MIN_EVENTS} (filter such users when converting)"
            )
        if ts is not None and ts.size != seq.size:
            raise DataFormatError(f"{grp.file}: user {grp.user_id[r]} has {ts.size} timestamps for {seq.size} events")
        acts = grp.get("actions", r) if "actions" in grp.cols else None
        oracle = [grp.get(c, r) if c in grp.cols else None for c in self.oracle_columns]
        return UserEvents(int(grp.user_id[r]), seq, ts, acts, oracle)

    def _train_end(self, ev: UserEvents) -> int:
        """Events usable for training: events[:-2] (events[:-1] for users not held out for
        validation), and (ranking) only before cutoff_valid."""
        end = train_events(ev.user, ev.items.size, self.valid_users)
        if self.ranking.enabled and ev.times is not None:
            end = min(end, int(np.searchsorted(ev.times, self.cutoffs[0], side="left")))
        return end

    def _sample(self, ev: UserEvents, g: int, r: int) -> Sample | list[Sample] | None:
        """The user's sample for this split: one, or (ranking evaluation) one per request."""
        rk, msl = self.ranking, self.max_seq_len // self.tpe  # events that fit the tower
        if self.split == "valid" and not holds_valid(ev.user, self.valid_users):
            return None
        if self.split in ("valid", "test"):
            cap = history_capacity(self.max_seq_len, self.tpe, ranked=bool(self.task_masks))  # as served
            return loo_eval(ev, ev.items.size - (2 if self.split == "valid" else 1), cap, self.window_block)
        labelled = ev.actions is not None and ev.times is not None
        if self.split in ("rank_valid", "rank_test"):
            if not labelled:
                return None
            lo, hi = (self.cutoffs[0], self.cutoffs[1]) if self.split == "rank_valid" else (self.cutoffs[1], np.inf)
            idx = np.flatnonzero((ev.times >= lo) & (ev.times < hi) & (ev.actions != 0))[:rk.eval_candidates]
            # one request per num_candidates consecutive held-out events, each after every event
            # before it, as a served request sees the log up to its time (and as training cuts);
            # a request with no event before it (a user's first) is cold start: not ranked here
            # the history a served Rank reads: the candidates share one position after it, so it
            # keeps every place but one (history_capacity), whatever the number of candidates
            k, cap = self._max_candidates(rk.num_candidates), history_capacity(self.max_seq_len, self.tpe, ranked=True)
            return [with_candidates(ev, int(idx[c]), idx[c:c + k], cap + idx[c:c + k].size, self.task_masks,
                                    train=False)
                    for c in range(0, idx.size, k) if idx[c] > 0] or None
        end = self._train_end(ev)
        rng = np.random.default_rng([self.seed, self.epoch, g, r])
        if end < 2:
            return None
        if self.task_masks and labelled and rk.num_candidates and rng.random() < rk.candidate_prob:
            cut = int(rng.integers(1, end))  # history events[:cut], candidates from events[cut:]
            cand = np.arange(cut, min(end, cut + self._max_candidates(rk.num_candidates)))
            cand = cand[ev.actions[cand] != 0]
            if cand.size:
                return with_candidates(ev, cut, cand, self._hist_cap(cand.size), self.task_masks, train=True)
        return retrieval_window(ev, end, msl + 1, rng if self.train_window == "random" else None)

    def _max_candidates(self, k: int) -> int:
        """Candidates take at most half the tower's tokens; the history keeps the rest."""
        return max(1, min(k, self.max_seq_len // 2))

    def _hist_cap(self, k: int) -> int:
        """History events + k candidates that fit max_seq_len tokens (history + k overall)."""
        return (self.max_seq_len - k) // self.tpe + k

    def _build(self, samples: list[tuple[int, int]], batch_index: int) -> SequenceBatch | None:
        out: list[Sample] = []
        ctx: dict[str, list[np.ndarray]] = {f: [] for f in self.context}
        self._samples = samples
        for g, r in samples:
            grp = self._group(g)
            sample = self._sample(self._events(grp, r), g, r)
            if sample is None:
                continue
            mine = sample if isinstance(sample, list) else [sample]
            out += mine
            for f in self.context:
                v = grp.get(CONTEXT_PREFIX + f, r)
                ctx[f] += [v if v is not None else np.zeros(0, np.int64)] * len(mine)
        if not out:
            return None
        return collate(out, self.embedding.item_feature, self.with_actions, ctx, self._ids)

    def _ids(self, feature: str, ids: np.ndarray, users: list[int], lengths: list[int]) -> np.ndarray:
        try:
            return prepare_ids(self.embedding.table_of(feature), feature, ids)
        except IdOutOfRange as e:
            bad = np.flatnonzero(ids == e.value)[0]
            user = users[int(np.searchsorted(np.cumsum(lengths), bad, side="right"))] if lengths else "?"
            file = next((self._group(g).file for g, r in self._samples if self._group(g).user_id[r] == user), self.path)
            raise IdOutOfRange(feature, e.value, e.size, f"{file}, user {user}") from None


def holds_valid(user: int, share: float) -> bool:
    """Whether ``user``'s events[-2] is a validation target: a fixed multiplicative hash of
    the id, so the same users are held out in every epoch, rank and run."""
    if share >= 1.0:
        return True
    return ((user * 0x9E3779B1) & 0xFFFFFFFF) < share * 2**32


def train_events(user: int, num_events: int, valid_share: float) -> int:
    """How many of a user's first events retrieval trains on: all but the test event, and
    all but the validation one too when the user is held out for validation."""
    return num_events - (2 if holds_valid(user, valid_share) else 1)


@lru_cache(maxsize=8)
def ranking_cutoffs(dataset: Path, fraction: float) -> tuple[float, float]:
    """(cutoff_valid, cutoff_test): the times after which the last 2x and 1x ``fraction``
    of labelled, timestamped events of the dataset at ``dataset`` fall."""
    t = InteractionFiles(dataset).read(["timestamps", "actions"])
    times = t.column("timestamps").combine_chunks()
    acts = t.column("actions").combine_chunks()
    labelled = ~(times.is_null().to_numpy(zero_copy_only=False) | acts.is_null().to_numpy(zero_copy_only=False))
    allt = times.filter(pa.array(labelled)).flatten().to_numpy()
    if allt.size == 0:
        raise DataFormatError(f"{dataset}: ranking needs users with both timestamps and actions; none found")
    lo, hi = np.quantile(allt, [1 - 2 * fraction, 1 - fraction])
    return float(lo), float(hi)


def make_reader(cfg: DataConfig, split: Split, embedding: EmbeddingConfig, max_seq_len: int,
                seed: int = 0, rank: int = 0, world_size: int = 1,
                tasks: dict[str, int] | None = None, tokens_per_event: int = 1) -> SequenceReader:
    """A reader for ``split`` with the job's data settings."""
    return SequenceReader(
        cfg.path,
        split,
        embedding=embedding,
        max_seq_len=max_seq_len,
        batch_size=cfg.batch_size if split == "train" else cfg.eval_batch_size,
        shuffle=split == "train",
        even=split == "train",
        seed=seed,
        rank=rank,
        world_size=world_size,
        train_window=cfg.train_window,
        sort_window=cfg.sort_window,
        context_features=cfg.context_features,
        ranking=cfg.ranking,
        tasks=tasks,
        tokens_per_event=tokens_per_event,
        valid_users=cfg.valid_users,
        window_block=cfg.eval_window_block,
    )
