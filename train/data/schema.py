"""The interaction-log format: a dataset directory of Parquet files, one row per user.

    DATASET/
      dataset.json          manifest: format version, counts, action names, context features
      interactions.parquet  one row per user (schema below), row groups of ~8k users
      items.parquet         the catalogue seen in the logs: item_id, count

``interactions.parquet`` columns:

| column       | type              | null? | meaning                                           |
|--------------|-------------------|-------|---------------------------------------------------|
| user_id      | int64             | no    | user key                                          |
| item_ids     | list<int64>       | no    | events in time order, oldest first                |
| timestamps   | list<int64>       | yes   | unix seconds per event; null = unknown for user   |
| actions      | list<int64>       | yes   | per-event bitmask; bit i = ``action_names[i]``    |
| ctx_<name>   | list<int64>       | yes   | pooled per-user context feature (multi-hot ids)   |

Item ids are kept as the source gives them (no re-indexing), so a served id is a logged id.

The user rows may instead be every ``*.parquet`` under an ``interactions/`` folder (Hive
partitions such as ``date=2026-11-30/`` allowed), each user in one file, all with the same
columns; ``train.data.files.InteractionFiles`` lists and reads the files of either layout.
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = "genrec.interactions"
FORMAT_VERSION = 1
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


def _fsync_dir(path: Path) -> None:
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
        for f in self.tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(self.tmp)
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
        _fsync_dir(self.out.parent)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class DatasetWriter:
    """Streams user rows into a dataset directory and writes the manifest on close. The
    directory appears (or replaces an earlier dataset) only when ``close`` succeeds.

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
    ) -> None:
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
        )
        self._stage = StagedDir(self.dir)
        try:
            # page CRCs let the reader and 'inspect --verify' tell a flipped bit from data
            self._writer = pq.ParquetWriter(self._stage.tmp / "interactions.parquet", self.schema,
                                            write_page_checksum=True)
        except BaseException:
            self._stage.discard()
            raise
        self._counts: list[tuple[np.ndarray, np.ndarray]] = []

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
        return self.info

    def abort(self) -> None:
        """Drops everything written: the target directory stays as it was."""
        self._writer.close()
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
