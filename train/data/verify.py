"""``genrec data inspect --verify``: read every row group of every file of a dataset and check
it against its schema and manifest, so damage shows before a training job starts, not hours in.

Checks, each failing with a ``DataFormatError`` that names the file, the row (and its user)
and the field:

* every page decodes (and matches its CRC where the writer stored one);
* ``user_id`` and ``item_ids`` are present, ids are >= 0, every user has at least
  ``MIN_EVENTS`` events (leave-one-out holds out two);
* ``timestamps`` / ``actions`` have one value per event where present; action bits and
  ``ctx_*`` ids lie inside what the manifest declares;
* the counts in ``dataset.json`` and ``items.parquet`` agree with the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from genrec.train.data.files import InteractionFiles
from genrec.train.data.schema import (
    CONTEXT_PREFIX,
    INTERACTIONS_DIR,
    INTERACTIONS_FILE,
    MIN_EVENTS,
    REMAKE,
    DataFormatError,
    DatasetInfo,
    read_info,
    read_items,
)


@dataclass
class VerifyReport:
    files: int = 0
    row_groups: int = 0
    users: int = 0
    events: int = 0
    users_with_timestamps: int = 0
    item_id_max: int = -1
    interactions: str = INTERACTIONS_FILE  # or "interactions/": what the counts above were read from


class _RowGroup:
    """One decoded row group and how to name one of its rows in an error."""

    def __init__(self, file: Path, index: int, first_row: int, table: pa.Table) -> None:
        self.file, self.index, self.first, self.table = file, index, first_row, table
        self.user_id = table.column("user_id").combine_chunks()

    def where(self, row: int) -> str:
        user = self.user_id[row].as_py()
        return f"{self.file}: row {self.first + row} (user {user}, row group {self.index})"

    def lists(self, name: str) -> pa.ListArray:
        return self.table.column(name).combine_chunks()


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _value_row(lengths: np.ndarray, value_index: int) -> tuple[int, int]:
    """(row, position in that row's list) of the ``value_index``-th flattened value."""
    ends = np.cumsum(lengths)
    row = int(np.searchsorted(ends, value_index, side="right"))
    return row, value_index - int(ends[row] - lengths[row])


def _values(rg: _RowGroup, name: str, arr: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(list length per row, 0 for a null list; the flattened values) of a list column whose
    lists hold no null values."""
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    flat = arr.flatten()
    if flat.null_count:
        row, pos = _value_row(lengths, _first(flat.is_null().to_numpy(zero_copy_only=False)))
        raise DataFormatError(f"{rg.where(row)}: {name}[{pos}] is null; lists hold no nulls "
                              "(a whole list may be null where the column allows it)")
    return lengths, flat.to_numpy()


def _check_range(rg: _RowGroup, name: str, arr: pa.ListArray, lo: int, hi: int | None, why: str) -> None:
    """Every value of list column ``name`` is in [lo, hi) (hi None: no upper bound)."""
    lengths, values = _values(rg, name, arr)
    bad = _first((values < lo) | (values >= hi) if hi is not None else values < lo)
    if bad is not None:
        row, pos = _value_row(lengths, bad)
        span = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise DataFormatError(f"{rg.where(row)}: {name}[{pos}] = {values[bad]} is not {span} ({why})")


def _check_items(rg: _RowGroup) -> np.ndarray:
    """The user ids and item lists of one row group; returns the events per user."""
    if rg.user_id.null_count:
        row = _first(rg.user_id.is_null().to_numpy(zero_copy_only=False))
        raise DataFormatError(f"{rg.file}: row {rg.first + row} (row group {rg.index}): user_id is null; "
                              "every row needs a user id")
    items = rg.lists("item_ids")
    if items.null_count:
        row = _first(items.is_null().to_numpy(zero_copy_only=False))
        raise DataFormatError(f"{rg.where(row)}: item_ids is null; every user needs a list of item ids")
    lengths = pc.list_value_length(items).to_numpy()
    short = _first(lengths < MIN_EVENTS)
    if short is not None:
        raise DataFormatError(f"{rg.where(short)}: item_ids has {lengths[short]} events; training needs at least "
                              f"{MIN_EVENTS} (leave-one-out holds out two): drop such users when converting")
    _check_range(rg, "item_ids", items, 0, None, "item ids are non-negative")
    return lengths


def _check_per_event(rg: _RowGroup, name: str, lengths: np.ndarray) -> pa.ListArray:
    """A nullable per-event list column has one value per event where a user has it."""
    arr = rg.lists(name)
    present = ~arr.is_null().to_numpy(zero_copy_only=False)
    got = _values(rg, name, arr)[0]
    bad = _first(present & (got != lengths))
    if bad is not None:
        raise DataFormatError(f"{rg.where(bad)}: {name} has {got[bad]} values for {lengths[bad]} item_ids; "
                              f"give one per event, or null for the whole user")
    return arr


# unix seconds stop here (the year 2096): a log in milliseconds lies far beyond it
MAX_UNIX_SECONDS = 4_000_000_000


def _check_times(rg: _RowGroup, times: pa.ListArray) -> None:
    """Timestamps are unix seconds, each user's in time order (the format's promise: the
    reader's time cuts search them)."""
    _check_range(rg, "timestamps", times, 0, MAX_UNIX_SECONDS, "unix seconds, not milliseconds")
    lengths, values = _values(rg, "timestamps", times)
    if values.size < 2:
        return
    step = np.diff(values)
    starts = np.cumsum(lengths)[:-1]  # (a difference across two users' lists is no order)
    inside = np.ones(step.size, bool)
    inside[starts[(starts > 0) & (starts <= step.size)] - 1] = False
    bad = _first(inside & (step < 0))
    if bad is not None:
        row, pos = _value_row(lengths, bad + 1)
        raise DataFormatError(f"{rg.where(row)}: timestamps[{pos}] = {values[bad + 1]} is before timestamps[{pos - 1}] "
                              f"= {values[bad]}; each user's events are in time order")


def _check_group(rg: _RowGroup, info: DatasetInfo, report: VerifyReport) -> tuple[np.ndarray, np.ndarray]:
    """Checks one row group and counts it into ``report``; returns its user ids and item ids
    (for the checks across row groups)."""
    lengths = _check_items(rg)
    times = _check_per_event(rg, "timestamps", lengths)
    _check_times(rg, times)
    n_actions = len(info.action_names)
    _check_range(rg, "actions", _check_per_event(rg, "actions", lengths), 0, 1 << n_actions,
                 f"bitmasks over dataset.json's {n_actions} action_names")
    for feature, card in info.context_features.items():
        name = CONTEXT_PREFIX + feature
        _check_range(rg, name, rg.lists(name), 0, card, f"dataset.json context_features['{feature}'] = {card}")
    items = rg.lists("item_ids").flatten().to_numpy()
    report.users += rg.table.num_rows
    report.events += int(lengths.sum())
    report.users_with_timestamps += rg.table.num_rows - times.null_count
    report.item_id_max = max(report.item_id_max, int(items.max()) if items.size else -1)
    return rg.user_id.to_numpy(), items


def _verify_interactions(path: Path, info: DatasetInfo, report: VerifyReport) -> tuple[np.ndarray, np.ndarray]:
    """Checks every row group and that each user is one row; returns the logged catalogue
    (item ids ascending, events per item)."""
    log = InteractionFiles(path)  # every file's footer and schema, the same in every file
    for feature in info.context_features:
        if CONTEXT_PREFIX + feature not in log.schema.names:
            raise DataFormatError(f"{log.paths[0]}: no column '{CONTEXT_PREFIX}{feature}' for the manifest's "
                                  f"context feature '{feature}'; {REMAKE}")
    none = np.zeros(0, np.int64)
    users, items = [none], [(none, none)]  # (a log of no rows: nothing to compare)
    for unit, table in log.tables(log.schema.names):
        u, i = _check_group(_RowGroup(log.paths[unit.file], unit.group, unit.first, table), info, report)
        users.append(u)
        items.append(np.unique(i, return_counts=True))
    report.files += len(log.paths)
    report.interactions = f"{INTERACTIONS_DIR}/" if log.partitioned else INTERACTIONS_FILE
    report.row_groups += len(log.units)
    ids = np.sort(np.concatenate(users))
    twice = _first(ids[1:] == ids[:-1])
    if twice is not None:
        raise DataFormatError(f"{path / report.interactions}: user {ids[twice]} has more than one row; each user "
                              f"is one row (merge their events when converting); {REMAKE}")
    logged, where = np.unique(np.concatenate([i for i, _ in items]), return_inverse=True)
    return logged, np.bincount(where, weights=np.concatenate([c for _, c in items])).astype(np.int64)


def _verify_items(path: Path, info: DatasetInfo, report: VerifyReport, logged: tuple[np.ndarray, np.ndarray]) -> None:
    file = path / "items.parquet"
    ids, counts = read_items(path)
    low = _first(counts < 1)
    if low is not None:
        raise DataFormatError(f"{file}: row {low}: count {counts[low]} of item {ids[low]} is below 1; {REMAKE}")
    bad = _first(np.diff(ids) <= 0)
    if bad is not None:
        raise DataFormatError(f"{file}: row {bad + 1}: item_id {ids[bad + 1]} follows {ids[bad]}; "
                              f"ids must be sorted and distinct; {REMAKE}")
    want_ids, want_counts = logged
    if ids.size == want_ids.size and not (np.array_equal(ids, want_ids) and np.array_equal(counts, want_counts)):
        at = _first((ids != want_ids) | (counts != want_counts))
        raise DataFormatError(f"{file}: row {at}: item {ids[at]} with count {counts[at]}, but the logs hold item "
                              f"{want_ids[at]} {want_counts[at]} times; the files do not belong together: {REMAKE}")
    if ids.size != info.num_items or int(counts.sum()) != report.events:
        raise DataFormatError(f"{file}: {ids.size} items with {int(counts.sum())} events, but dataset.json says "
                              f"{info.num_items} items and {report.interactions} has {report.events} events; "
                              f"the files do not belong together: {REMAKE}")
    report.files += 1


def _check_manifest(path: Path, info: DatasetInfo, report: VerifyReport) -> None:
    seen = {"num_users": report.users, "num_events": report.events,
            "users_with_timestamps": report.users_with_timestamps, "item_id_max": report.item_id_max}
    for key, got in seen.items():
        if getattr(info, key) != got:
            raise DataFormatError(f"{path / 'dataset.json'}: {key} is {getattr(info, key)} but {report.interactions} "
                                  f"has {got}; the files do not belong together: {REMAKE}")


def verify_dataset(path: str | Path) -> VerifyReport:
    """Reads the whole dataset at ``path``; raises ``DataFormatError`` at the first problem."""
    path = Path(path)
    info = read_info(path)
    report = VerifyReport(files=1)  # dataset.json, read and checked above
    logged = _verify_interactions(path, info, report)
    _check_manifest(path, info, report)
    _verify_items(path, info, report, logged)
    return report
