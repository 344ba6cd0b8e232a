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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = "genrec.interactions"
FORMAT_VERSION = 1
ROW_GROUP_SIZE = 8192
CONTEXT_PREFIX = "ctx_"

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


class DatasetWriter:
    """Streams user rows into a dataset directory and writes the manifest on close.

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
        self.dir.mkdir(parents=True, exist_ok=True)
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
        self._writer = pq.ParquetWriter(self.dir / "interactions.parquet", self.schema)
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
        self._writer.close()
        ids, counts = self._merge_counts() if self._counts else (np.zeros(0, np.int64),) * 2
        pq.write_table(pa.table({"item_id": ids, "count": counts}), self.dir / "items.parquet")
        self.info.num_items = int(ids.size)
        self.info.item_id_max = int(ids.max()) if ids.size else -1
        (self.dir / "dataset.json").write_text(json.dumps(asdict(self.info), indent=2) + "\n")
        return self.info

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._writer.close()


def read_info(path: str | Path) -> DatasetInfo:
    p = Path(path) / "dataset.json"
    if not p.exists():
        raise DataFormatError(
            f"{path}: no dataset.json; create a dataset with 'genrec data synth' or 'genrec data convert'"
        )
    raw = json.loads(p.read_text())
    if raw.get("format") != FORMAT:
        raise DataFormatError(f"{p}: format is {raw.get('format')!r}, expected {FORMAT!r}")
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise DataFormatError(
            f"{p}: format_version {raw['format_version']} is newer than this genrec reads "
            f"({FORMAT_VERSION}); upgrade genrec"
        )
    return DatasetInfo(**raw)


def read_items(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(item ids sorted ascending, interaction counts) of the dataset's catalogue."""
    t = pq.read_table(Path(path) / "items.parquet")
    return t.column("item_id").to_numpy(), t.column("count").to_numpy()


def validate_schema(path: Path, schema: pa.Schema) -> None:
    for f in BASE_SCHEMA:
        if f.name not in schema.names:
            raise DataFormatError(f"{path}: missing column '{f.name}' (see train/data/schema.py)")
        got = schema.field(f.name).type
        if not got.equals(f.type):
            raise DataFormatError(f"{path}: column '{f.name}' has type {got}, expected {f.type}")
