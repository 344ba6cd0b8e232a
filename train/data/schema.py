"""The interaction-log format: a dataset directory of Parquet files, one row per user.

    DATASET/
      dataset.json          manifest: format version, counts, action names, context features
      interactions.parquet  one row per user (schema below), row groups of ~8k users
      items.parquet         the catalogue seen in the logs: item_id, count

or, for logs that outgrow one file, the user rows spread over a folder (``Layout``):

    DATASET/
      interactions/         every *.parquet below it, in sorted path order, the same schema;
        date=2026-11-30/      Hive partitions allowed: here the UTC day of each user's last
          part-00000.parquet  event (users without timestamps: date=__HIVE_DEFAULT_PARTITION__)
          part-00001.parquet  parts: users spread by a hash of their id
      ...

Each user is in exactly one file. ``train.data.files.InteractionFiles`` lists and reads the
files of either layout; nothing else opens them by name.

``interactions.parquet`` columns (every file of ``interactions/`` alike):

| column       | type              | null? | meaning                                           |
|--------------|-------------------|-------|---------------------------------------------------|
| user_id      | int64             | no    | user key                                          |
| item_ids     | list<int64>       | no    | events in time order, oldest first                |
| timestamps   | list<int64>       | yes   | unix seconds per event; null = unknown for user   |
| actions      | list<int64>       | yes   | per-event bitmask; bit i = ``action_names[i]``    |
| ctx_<name>   | list<int64>       | yes   | pooled per-user context feature (multi-hot ids)   |

Item ids are kept as the source gives them (no re-indexing), so a served id is a logged id.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

FORMAT = "genrec.interactions"
# 1: one interactions.parquet; 2: an interactions/ folder (an older genrec, which knows only
# version 1, then says "upgrade" instead of "interactions.parquet is missing")
FORMAT_VERSION = 2
INTERACTIONS_FILE = "interactions.parquet"
INTERACTIONS_DIR = "interactions"
ROW_GROUP_SIZE = 8192
CONTEXT_PREFIX = "ctx_"
# leave-one-out holds out a user's last two events; training needs one more before them
MIN_EVENTS = 3
DATASET_FILES = ("dataset.json", INTERACTIONS_FILE, INTERACTIONS_DIR, "items.parquet")
REMAKE = "re-create the dataset with 'genrec data convert' or 'genrec data synth'"

BASE_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("item_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("timestamps", pa.list_(pa.int64()), nullable=True),
        pa.field("actions", pa.list_(pa.int64()), nullable=True),
    ]
)


class DataFormatError(ValueError):
    """Input data does not follow its format; the message names the file (and line)."""


@contextmanager
def arrow_errors(path: Path, where: str = "") -> Iterator[None]:
    """Re-raises Arrow's read errors, which name no file ("Received invalid number of bytes
    (corrupt data page?)"), as a DataFormatError naming ``path`` and ``where`` in it."""
    at = f" ({where})" if where else ""
    try:
        yield
    except FileNotFoundError:
        raise DataFormatError(f"{path}: missing; the dataset is incomplete: {REMAKE}") from None
    except (pa.ArrowException, OSError) as e:  # Arrow's IO and decode errors are OSErrors
        raise DataFormatError(
            f"{path}{at}: cannot be read as Parquet ({' '.join(str(e).split()).rstrip('.')}); the file is damaged "
            f"or truncated: {REMAKE} ('genrec data inspect --verify DIR' reads every file of a dataset)"
        ) from e


def open_parquet(path: Path, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """Opens a dataset file, checking page CRCs where the writer stored them (ours do);
    ``metadata``: its footer, read before (the file is then not parsed again)."""
    with arrow_errors(path, "footer"):
        return pq.ParquetFile(path, metadata=metadata, page_checksum_verification=True)


@dataclass
class DatasetInfo:
    """The manifest, ``dataset.json``."""

    source: str
    num_users: int
    num_events: int
    num_items: int  # distinct items in the logs (the corpus)
    item_id_max: int
    users_with_timestamps: int = 0
    action_names: list[str] = field(default_factory=list)
    context_features: dict[str, int] = field(default_factory=dict)  # name -> cardinality
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def item_table_size(self) -> int:
        return self.item_id_max + 1


def schema_for(context_features: Iterable[str], extra_columns: dict[str, str] | None = None) -> pa.Schema:
    """The base columns, one ``ctx_<name>`` per context feature, then per-event extras
    (``name -> value type``, e.g. the synthetic generator's ``oracle_click: float32``)."""
    fields = list(BASE_SCHEMA)
    fields += [pa.field(CONTEXT_PREFIX + n, pa.list_(pa.int64()), nullable=True) for n in context_features]
    for name, typ in (extra_columns or {}).items():
        fields.append(pa.field(name, pa.list_(pa.type_for_alias(typ)), nullable=True))
    return pa.schema(fields)


def fsync_path(path: Path) -> None:
    """Flushes ``path`` (a file, or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(out: Path) -> None:
    """A dataset output may replace nothing, an empty directory or an earlier dataset; never a
    file or a directory holding anything else (replacing it would delete a user's files)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataFormatError(f"{out}: exists and is not a directory; choose a new --out directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in DATASET_FILES)
    if foreign:
        raise DataFormatError(f"{out}: exists and holds files that are not part of a genrec dataset "
                              f"({', '.join(foreign[:3])}); choose a new or empty --out directory")


class StagedDir:
    """All-or-nothing output directory: files go into a hidden sibling ``.<name>.tmp-*``,
    which ``commit`` fsyncs and renames onto the target; ``discard`` deletes it. A reader thus
    sees a dataset whole or not at all, and a failed writer (bad input line, full disk,
    Ctrl-C) leaves the target as it was. A sibling, so the rename stays on one filesystem."""

    def __init__(self, out: Path) -> None:
        self.out = out
        check_replaceable(out)  # before the work, not after an hour of conversion
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self._sibling("tmp")
        self.tmp.mkdir()  # not mkdtemp: its 0700 would stay on the dataset; mkdir keeps the umask's mode

    def _sibling(self, kind: str) -> Path:
        return self.out.parent / f".{self.out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def commit(self) -> None:
        for folder, _, files in os.walk(self.tmp):  # a partitioned dataset has folders inside
            for name in files:
                with open(Path(folder) / name, "rb") as fh:
                    os.fsync(fh.fileno())
            fsync_path(Path(folder))
        check_replaceable(self.out)  # it may have changed while we worked
        if self.out.is_dir() and any(self.out.iterdir()):
            # rename() only replaces an empty directory: move the old dataset aside first
            old = self._sibling("old")
            os.replace(self.out, old)
            try:
                os.replace(self.tmp, self.out)
            except OSError:
                os.replace(old, self.out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
        fsync_path(self.out.parent)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed, well-mixed 64-bit hash of each integer (SplitMix64's finaliser)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Layout:
    """Where a ``DatasetWriter`` puts the user rows: one ``interactions.parquet`` (the default),
    or, with ``files`` > 1 or ``partition="date"``, an ``interactions/`` folder holding ``files``
    parts (users spread by a hash of their id) per partition. A date partition is the UTC day
    of a user's last event: the day the user's row was last rewritten as logs landed."""

    files: int = 1
    partition: Literal["none", "date"] = "none"

    def __post_init__(self) -> None:
        if self.files < 1:
            raise ValueError(f"--files must be at least 1, got {self.files}")
        if self.partition not in ("none", "date"):
            raise ValueError(f"--partition must be 'date' (or none), got {self.partition!r}")

    @property
    def partitioned(self) -> bool:
        return self.files > 1 or self.partition != "none"


NO_DATE = "__HIVE_DEFAULT_PARTITION__"  # Hive's folder name for a null partition value
MAX_WAITING_ROWS = 16 * ROW_GROUP_SIZE


class _PartitionedFiles:
    """The writing side of a partitioned ``Layout``: rows -> ``interactions/[date=D/]part-N.parquet``.
    A file's rows wait until they fill a row group (one chunk of users holds few rows of each
    day and part); past ``MAX_WAITING_ROWS`` waiting rows the fullest file gets a smaller row
    group, so memory stays bounded. Every file stays open until ``close``."""

    def __init__(self, folder: Path, schema: pa.Schema, layout: Layout) -> None:
        self.folder, self.schema, self.layout = folder, schema, layout
        self.waiting: dict[str, list[pa.Table]] = {}
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.group = ROW_GROUP_SIZE

    def file_of(self, table: pa.Table) -> list[str]:
        """Each row's file, relative to the folder."""
        part = (splitmix64(table.column("user_id").to_numpy()) % np.uint64(self.layout.files)).tolist()
        names = [f"part-{p:05d}.parquet" for p in part]
        if self.layout.partition == "none":
            return names
        times = table.column("timestamps").combine_chunks()
        lengths = pc.fill_null(pc.list_value_length(times), 0).to_numpy()
        flat = pc.list_flatten(times).to_numpy()
        last = flat[np.maximum(np.cumsum(lengths) - 1, 0)] if flat.size else np.zeros(lengths.size, np.int64)
        days = (last // 86400).astype("datetime64[D]").astype(str)
        return [f"date={d if n else NO_DATE}/{name}" for d, n, name in zip(days.tolist(), lengths.tolist(), names)]

    def write_table(self, table: pa.Table, row_group_size: int = ROW_GROUP_SIZE) -> None:
        self.group = row_group_size
        keys = np.array(self.file_of(table))
        order = np.argsort(keys, kind="stable")  # rows of a file keep their order
        uniq, starts = np.unique(keys[order], return_index=True)
        for key, rows in zip(uniq.tolist(), np.split(order, starts[1:])):
            self.waiting.setdefault(key, []).append(table.take(rows))
            if self._rows(key) >= self.group:
                self._write(key, whole=False)
        while sum(map(self._rows, self.waiting)) > MAX_WAITING_ROWS:  # read here: tests shrink it
            self._write(max(self.waiting, key=self._rows), whole=True)

    def _rows(self, key: str) -> int:
        return sum(t.num_rows for t in self.waiting.get(key, ()))

    def _write(self, key: str, whole: bool) -> None:
        t = pa.concat_tables(self.waiting.pop(key))
        n = t.num_rows if whole else t.num_rows - t.num_rows % self.group
        if key not in self.writers:
            (self.folder / key).parent.mkdir(parents=True, exist_ok=True)
            self.writers[key] = pq.ParquetWriter(self.folder / key, self.schema, write_page_checksum=True)
        self.writers[key].write_table(t.slice(0, n), row_group_size=self.group)
        if n < t.num_rows:
            self.waiting[key] = [t.slice(n)]

    def close(self, flush: bool = True) -> None:
        """Writes what waits (``flush``; false: drops it, the files go with their stage) and
        closes every file."""
        try:
            for key in sorted(self.waiting) if flush else ():
                self._write(key, whole=True)
        finally:
            self.waiting.clear()
            for w in self.writers.values():
                w.close()


class DatasetWriter:
    """Streams user rows into a dataset directory and writes the manifest on close. The
    directory appears (or replaces an earlier dataset) only when ``close`` succeeds.
    ``layout``: one file (default) or a partitioned folder; ``progress``: a bar of users
    written, out of ``total`` where the caller knows it.

    Usage::

        with DatasetWriter(out, source="ml-1m", action_names=["click"]) as w:
            w.write({"user_id": [...], "item_ids": [[...], ...], "timestamps": [...], ...})
    """

    def __init__(
        self,
        out_dir: str | Path,
        source: str,
        action_names: Iterable[str] = (),
        context_features: dict[str, int] | None = None,
        extra: dict | None = None,
        extra_columns: dict[str, str] | None = None,
        layout: Layout | None = None,
        progress: bool = False,
        total: int | None = None,
    ) -> None:
        layout = layout or Layout()
        self.dir = Path(out_dir)
        self.context = dict(context_features or {})
        self.schema = schema_for(self.context, extra_columns)
        self.info = DatasetInfo(
            source=source,
            num_users=0,
            num_events=0,
            num_items=0,
            item_id_max=-1,
            action_names=list(action_names),
            context_features=self.context,
            extra=dict(extra or {}),
            format_version=FORMAT_VERSION if layout.partitioned else 1,  # one file: older versions read it too
        )
        self._stage = StagedDir(self.dir)
        try:
            # page CRCs let the reader and 'inspect --verify' tell a flipped bit from data
            self._writer: pq.ParquetWriter | _PartitionedFiles = (
                _PartitionedFiles(self._stage.tmp / INTERACTIONS_DIR, self.schema, layout) if layout.partitioned
                else pq.ParquetWriter(self._stage.tmp / INTERACTIONS_FILE, self.schema, write_page_checksum=True))
        except BaseException:
            self._stage.discard()
            raise
        self._counts: list[tuple[np.ndarray, np.ndarray]] = []
        self._bar = tqdm(total=total, desc=f"{source} users", unit="user", disable=not progress)

    def write(self, columns: dict[str, list]) -> None:
        n = len(columns["user_id"])
        table = pa.table({c: columns.get(c, [None] * n) for c in self.schema.names}, schema=self.schema)
        self._writer.write_table(table, row_group_size=ROW_GROUP_SIZE)
        items = table.column("item_ids").combine_chunks().flatten().to_numpy()
        ids, counts = np.unique(items, return_counts=True)
        self._counts.append((ids, counts))
        if len(self._counts) > 16:
            self._counts = [self._merge_counts()]
        self.info.num_users += table.num_rows
        self.info.num_events += int(items.size)
        self.info.users_with_timestamps += table.num_rows - table.column("timestamps").null_count
        self._bar.update(table.num_rows)

    def _merge_counts(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.concatenate([c[0] for c in self._counts])
        counts = np.concatenate([c[1] for c in self._counts])
        uniq, inv = np.unique(ids, return_inverse=True)
        return uniq, np.bincount(inv, weights=counts).astype(np.int64)

    def close(self) -> DatasetInfo:
        try:
            self._writer.close()
            if not self.info.num_users:
                raise DataFormatError(f"{self.info.source}: no users to write; {self.dir} was not written")
            ids, counts = self._merge_counts()
            pq.write_table(pa.table({"item_id": ids, "count": counts}), self._stage.tmp / "items.parquet",
                           write_page_checksum=True)
            self.info.num_items = int(ids.size)
            self.info.item_id_max = int(ids.max())
            (self._stage.tmp / "dataset.json").write_text(json.dumps(asdict(self.info), indent=2) + "\n")
            self._stage.commit()
        except BaseException:
            self._stage.discard()
            raise
        finally:
            self._bar.close()
        return self.info

    def abort(self) -> None:
        """Drops everything written: the target directory stays as it was."""
        self._bar.close()
        try:
            if isinstance(self._writer, _PartitionedFiles):
                self._writer.close(flush=False)  # nothing more to write: the files go with the stage
            else:
                self._writer.close()
        finally:
            self._stage.discard()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_info(path: str | Path) -> DatasetInfo:
    p = Path(path) / "dataset.json"
    if not p.exists():
        raise DataFormatError(
            f"{path}: no dataset.json; create a dataset with 'genrec data synth' or 'genrec data convert'"
        )
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFormatError(f"{p}: not valid JSON ({e}); {REMAKE}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise DataFormatError(f"{p}: format is {got!r}, expected {FORMAT!r}")
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise DataFormatError(
            f"{p}: format_version {raw['format_version']} is newer than this genrec reads "
            f"({FORMAT_VERSION}); upgrade genrec"
        )
    _check_manifest_fields(p, raw)
    return DatasetInfo(**raw)


def _check_manifest_fields(p: Path, raw: dict) -> None:
    known = {f.name: f for f in fields(DatasetInfo)}
    for name in raw:
        if name not in known:
            raise DataFormatError(f"{p}: unknown field '{name}' (fields: {', '.join(known)})")
    for name, f in known.items():
        if name not in raw and f.default is MISSING and f.default_factory is MISSING:
            raise DataFormatError(f"{p}: field '{name}' is missing; {REMAKE}")
        lowest = -1 if name == "item_id_max" else 0
        if f.type == "int" and name in raw and (type(raw[name]) is not int or raw[name] < lowest):
            raise DataFormatError(f"{p}: field '{name}' is {raw[name]!r}, expected an integer >= {lowest}")


def read_items(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(item ids sorted ascending, interaction counts) of the dataset's catalogue."""
    file = Path(path) / "items.parquet"
    with arrow_errors(file):
        t = open_parquet(file).read()
    for name in ("item_id", "count"):
        if name not in t.column_names or not t.schema.field(name).type.equals(pa.int64()):
            raise DataFormatError(f"{file}: needs an int64 column '{name}' (see train/data/schema.py); {REMAKE}")
        if t.column(name).null_count:
            raise DataFormatError(f"{file}: column '{name}' has nulls; {REMAKE}")
    return t.column("item_id").to_numpy(), t.column("count").to_numpy()


def validate_schema(path: Path, schema: pa.Schema) -> None:
    for f in BASE_SCHEMA:
        if f.name not in schema.names:
            raise DataFormatError(f"{path}: missing column '{f.name}' (see train/data/schema.py)")
        got = schema.field(f.name).type
        if not got.equals(f.type):
            raise DataFormatError(f"{path}: column '{f.name}' has type {got}, expected {f.type}")
