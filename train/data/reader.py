"""Streaming reader: Parquet user rows -> ``SequenceBatch`` (KJT + jagged times + targets).

Order of one epoch, fully determined by (seed, epoch, world_size):
1. row groups in a seeded permutation, rows within each group in a seeded permutation
   (a block shuffle: one group of ~8k users in memory at a time);
2. position p of that stream goes to rank ``p % world_size`` (for training the tail is
   cut so every rank gets the same count: DDP and sharded embeddings need equal steps);
3. a rank's samples are cut into windows of ``sort_window`` batches, sorted by length
   inside the window and the batches of the window shuffled: batches of similar lengths
   waste less padding in attention.

``state_dict()`` is (epoch, batches done); loading it replays the plan and skips ahead,
so a resumed job sees exactly the samples it had not seen.

Splits (leave-one-out, as in SASRec / HSTU): ``train`` uses events[:-2] with every position
predicting the next; ``valid`` predicts events[-2] from events[:-2]; ``test`` predicts
events[-1] from events[:-1]. Histories keep their last ``max_seq_len`` events.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from embedding.spec import EmbeddingConfig, IdOutOfRange, prepare_ids
from models.inputs import SequenceBatch
from train.data.schema import CONTEXT_PREFIX, DataFormatError, read_info, validate_schema

Split = Literal["train", "valid", "test"]
MIN_EVENTS = 3


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/synthetic"
    batch_size: int = 128
    eval_batch_size: int = 256
    train_window: Literal["last", "random"] = "last"
    sort_window: int = 16  # batches per length-sorting window; 0 keeps the shuffled order
    context_features: bool = False  # read ctx_* columns into batch.context


class _Group:
    """One row group decoded into flat numpy arrays (list offsets + values)."""

    def __init__(self, table, columns: list[str]) -> None:  # noqa: ANN001 - a pyarrow Table
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
    ) -> None:
        self.path = Path(path)
        self.info = read_info(self.path)
        self.file = self.path / "interactions.parquet"
        self.pf = pq.ParquetFile(self.file)
        validate_schema(self.file, self.pf.schema_arrow)
        self.split, self.embedding, self.max_seq_len = split, embedding, max_seq_len
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world_size
        self.shuffle = (split == "train") if shuffle is None else shuffle
        self.even = (split == "train") if even is None else even
        self.train_window, self.sort_window = train_window, sort_window
        self.item_table = embedding.item_table
        self.context = [f for f in embedding.pooled_features if context_features]
        missing = [f for f in self.context if CONTEXT_PREFIX + f not in self.pf.schema_arrow.names]
        if missing:
            raise DataFormatError(f"{self.file}: no column '{CONTEXT_PREFIX}{missing[0]}' for context feature '{missing[0]}'")
        self.columns = ["item_ids", "timestamps"] + [CONTEXT_PREFIX + f for f in self.context]
        self.group_rows = [self.pf.metadata.row_group(i).num_rows for i in range(self.pf.num_row_groups)]
        self.num_rows = sum(self.group_rows)
        self.epoch, self.batches_done = 0, 0
        self._cache: dict[int, _Group] = {}

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
        if g not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[g] = _Group(self.pf.read_row_group(g, columns=["user_id", *self.columns]), self.columns)
        return self._cache[g]

    def _rank_samples(self) -> Iterator[tuple[int, int]]:
        """(row group, row) of this rank's samples, in epoch order."""
        rng = np.random.default_rng([self.seed, self.epoch])
        n_groups = len(self.group_rows)
        order = rng.permutation(n_groups) if self.shuffle else np.arange(n_groups)
        limit = (self.num_rows // self.world) * self.world if self.even else self.num_rows
        pos = 0
        for g in order:
            n = self.group_rows[g]
            rows = np.random.default_rng([self.seed, self.epoch, int(g)]).permutation(n) if self.shuffle else np.arange(n)
            take = (np.arange(pos, pos + n) % self.world == self.rank) & (np.arange(pos, pos + n) < limit)
            for r in rows[take[: n]]:
                yield int(g), int(r)
            pos += n

    def _batches(self) -> Iterator[list[tuple[int, int]]]:
        window = max(self.sort_window, 1) * self.batch_size
        rng = np.random.default_rng([self.seed, self.epoch, 1 << 20])
        buf: list[tuple[int, int]] = []

        def flush() -> Iterator[list[tuple[int, int]]]:
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
        limit = (self.num_rows // self.world) * self.world if self.even else self.num_rows
        mine = len(range(self.rank, limit, self.world))
        window = max(self.sort_window, 1) * self.batch_size
        full, rest = divmod(mine, window)
        return full * (window // self.batch_size) + -(-rest // self.batch_size)

    def __iter__(self) -> Iterator[SequenceBatch]:
        for i, samples in enumerate(self._batches()):
            if i < self.batches_done:
                continue
            batch = self._build(samples, i)
            self.batches_done = i + 1
            yield batch

    # ----- building a batch ---------------------------------------------------------------
    def _window(self, n: int, g: int, r: int, batch_index: int) -> tuple[int, int]:
        """[start, end) of the events a training sample uses (inputs + shifted targets)."""
        span = self.max_seq_len + 1
        if n <= span:
            return 0, n
        if self.train_window == "last":
            return n - span, n
        rng = np.random.default_rng([self.seed, self.epoch, g, r])
        start = int(rng.integers(0, n - span + 1))
        return start, start + span

    def _build(self, samples: list[tuple[int, int]], batch_index: int) -> SequenceBatch:
        items, times, qtimes, lengths, targets, has_time, users = [], [], [], [], [], [], []
        seen: list[np.ndarray] = []
        ctx: dict[str, list[np.ndarray]] = {f: [] for f in self.context}
        for g, r in samples:
            grp = self._group(g)
            seq = grp.get("item_ids", r)
            ts = grp.get("timestamps", r)
            if seq.size < MIN_EVENTS:
                raise DataFormatError(
                    f"{self.file}: user {grp.user_id[r]} has {seq.size} events; leave-one-out "
                    f"needs at least {MIN_EVENTS} (filter such users when converting)"
                )
            if ts is not None and ts.size != seq.size:
                raise DataFormatError(f"{self.file}: user {grp.user_id[r]} has {ts.size} timestamps for {seq.size} events")
            if self.split == "train":
                s, e = self._window(seq.size - 2, g, r, batch_index)
                hist, tgt = seq[s : e - 1], seq[s + 1 : e]
                t_hist = ts[s : e - 1] if ts is not None else None
                t_query = ts[s + 1 : e] if ts is not None else None
            else:
                end = seq.size - (2 if self.split == "valid" else 1)
                start = max(0, end - self.max_seq_len)
                hist, tgt = seq[start:end], seq[end : end + 1]
                seen.append(seq[:end])
                t_hist = ts[start:end] if ts is not None else None
                t_query = ts[start + 1 : end + 1] if ts is not None else None
            items.append(hist)
            targets.append(tgt)
            lengths.append(hist.size)
            has_time.append(ts is not None)
            zeros = np.zeros(hist.size, np.int64)
            times.append(t_hist if t_hist is not None else zeros)
            qtimes.append(t_query if t_query is not None else zeros)
            users.append(grp.user_id[r])
            for f in self.context:
                v = grp.get(CONTEXT_PREFIX + f, r)
                ctx[f].append(v if v is not None else np.zeros(0, np.int64))
        batch = self._tensors(items, times, qtimes, lengths, targets, has_time, users, ctx)
        if seen:
            batch.seen_lengths = torch.tensor([s.size for s in seen], dtype=torch.int64)
            batch.seen_ids = torch.from_numpy(np.concatenate(seen))
        return batch

    def _ids(self, feature: str, ids: np.ndarray, users: list[int], lengths: list[int]) -> np.ndarray:
        try:
            return prepare_ids(self.embedding.table_of(feature), feature, ids)
        except IdOutOfRange as e:
            bad = np.flatnonzero(ids == e.value)[0]
            user = users[int(np.searchsorted(np.cumsum(lengths), bad, side="right"))] if lengths else "?"
            raise IdOutOfRange(feature, e.value, e.size, f"{self.file}, user {user}") from None

    def _tensors(self, items, times, qtimes, lengths, targets, has_time, users, ctx) -> SequenceBatch:  # noqa: ANN001
        item_values = self._ids(self.embedding.item_feature, np.concatenate(items), users, lengths)
        target_values = np.concatenate(targets)
        tgt_lengths = [t.size for t in targets]
        target_values = self._ids(self.embedding.item_feature, target_values, users, tgt_lengths)
        seq = KeyedJaggedTensor(
            keys=[self.embedding.item_feature],
            values=torch.from_numpy(item_values),
            lengths=torch.tensor(lengths, dtype=torch.int64),
        )
        context = None
        if self.context:
            vals = [self._ids(f, np.concatenate(ctx[f]).astype(np.int64), users, [v.size for v in ctx[f]]) for f in self.context]
            context = KeyedJaggedTensor(
                keys=list(self.context),
                values=torch.from_numpy(np.concatenate(vals)),
                lengths=torch.tensor([v.size for f in self.context for v in ctx[f]], dtype=torch.int64),
            )
        return SequenceBatch(
            seq=seq,
            max_len=max(lengths),
            timestamps=torch.from_numpy(np.concatenate(times).astype(np.int64)),
            query_times=torch.from_numpy(np.concatenate(qtimes).astype(np.int64)),
            has_time=torch.tensor(has_time, dtype=torch.bool),
            targets=torch.from_numpy(target_values),
            context=context,
            user_ids=torch.tensor(users, dtype=torch.int64),
        )


def make_reader(cfg: DataConfig, split: Split, embedding: EmbeddingConfig, max_seq_len: int,
                seed: int = 0, rank: int = 0, world_size: int = 1) -> SequenceReader:
    """A reader for ``split`` with the job's data settings."""
    return SequenceReader(
        cfg.path,
        split,
        embedding=embedding,
        max_seq_len=max_seq_len,
        batch_size=cfg.batch_size if split == "train" else cfg.eval_batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        train_window=cfg.train_window,
        sort_window=cfg.sort_window,
        context_features=cfg.context_features,
    )
