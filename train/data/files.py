"""The Parquet files that hold a dataset's user rows, in either layout (``train.data.schema``):
one ``interactions.parquet``, or every ``*.parquet`` under ``interactions/`` (Hive partition
folders such as ``date=2026-11-30/`` allowed), found with ``pyarrow.dataset`` and taken in
sorted path order, so a dataset's files, and the units below, are numbered the same on every
rank and every run.

A unit of work is one row group of one file. ``InteractionFiles`` reads only the footers when
it opens a dataset (the row counts the reader's epoch plan needs) and checks that every file
has the schema of the first; row groups are decoded on demand. Every read error names the
file, and the row group and rows where it has one.

Example::

    log = InteractionFiles("data/ml1m")
    log.units[0]                      # Unit(file=0, group=0, rows=6040, first=0)
    log.read(["item_ids"])            # one table, every file in order
    for unit, table in log.tables(["user_id", "item_ids"]):  # row group by row group
        ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from genrec.train.data.schema import (
    INTERACTIONS_DIR,
    INTERACTIONS_FILE,
    REMAKE,
    DataFormatError,
    arrow_errors,
    open_parquet,
    validate_schema,
)


@dataclass(frozen=True)
class Unit:
    """One row group: ``file`` (index into ``InteractionFiles.paths``), ``group`` (its index in
    that file), ``rows``, and ``first``, the file's row number of its first row."""

    file: int
    group: int
    rows: int
    first: int


def interaction_paths(dataset: str | Path) -> list[Path]:
    """The dataset's interactions files: ``[DATASET/interactions.parquet]``, or the sorted
    ``*.parquet`` files under ``DATASET/interactions/`` (names starting with '.' or '_', such
    as ``_SUCCESS``, are skipped, as Hive and Spark write them)."""
    dataset = Path(dataset)
    single, folder = dataset / INTERACTIONS_FILE, dataset / INTERACTIONS_DIR
    if not folder.is_dir():
        return [single]
    if single.exists():
        raise DataFormatError(f"{dataset}: has both {INTERACTIONS_FILE} and {INTERACTIONS_DIR}/; a dataset has "
                              f"one of them: delete the stale one or {REMAKE}")
    # an explicit (empty) schema: discovery only lists files; a damaged one is named when opened below
    found = ds.dataset(folder, format="parquet", partitioning="hive", schema=pa.schema([])).files
    paths = sorted(Path(f) for f in found if f.endswith(".parquet"))  # (a README beside them is no part)
    if not paths:
        raise DataFormatError(f"{folder}: holds no Parquet files; {REMAKE}")
    return paths


class InteractionFiles:
    """The interactions files of the dataset at ``dataset``: ``paths``, ``schema`` (every file's),
    ``units`` (one per row group, files in order) and ``num_rows``."""

    def __init__(self, dataset: str | Path) -> None:
        self.dataset = Path(dataset)
        self.paths = interaction_paths(self.dataset)
        self.partitioned = (self.dataset / INTERACTIONS_DIR).is_dir()
        self.meta: list[pq.FileMetaData] = []
        self.units: list[Unit] = []
        for i, path in enumerate(self.paths):
            pf = open_parquet(path)
            try:
                self._check_schema(path, pf.schema_arrow)
                meta = pf.metadata
            finally:
                pf.close()
            self.meta.append(meta)
            first = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                self.units.append(Unit(i, g, rows, first))
                first += rows
        self.num_rows = sum(u.rows for u in self.units)

    def _check_schema(self, path: Path, schema: pa.Schema) -> None:
        validate_schema(path, schema)
        if path == self.paths[0]:
            self.schema = schema
            return
        same = f"every file of a dataset has the same columns: {REMAKE}"
        for f in self.schema:
            if f.name not in schema.names:
                raise DataFormatError(f"{path}: no column '{f.name}', which {self.paths[0]} has; {same}")
            if not schema.field(f.name).type.equals(f.type):
                raise DataFormatError(f"{path}: column '{f.name}' is {schema.field(f.name).type}, but "
                                      f"{f.type} in {self.paths[0]}; {same}")
        extra = [n for n in schema.names if n not in self.schema.names]
        if extra:
            raise DataFormatError(f"{path}: column '{extra[0]}' is not in {self.paths[0]}; {same}")

    def where(self, unit: Unit) -> str:
        return f"row group {unit.group}, rows {unit.first}-{unit.first + unit.rows - 1}"

    def read_unit(self, u: int, columns: Sequence[str]) -> pa.Table:
        """Unit ``u``'s rows; a damaged page names its file, row group and rows."""
        unit = self.units[u]
        path = self.paths[unit.file]
        pf = open_parquet(path, self.meta[unit.file])
        try:
            with arrow_errors(path, self.where(unit)):
                return pf.read_row_group(unit.group, columns=list(columns))
        finally:
            pf.close()

    def tables(self, columns: Sequence[str]) -> Iterator[tuple[Unit, pa.Table]]:
        """Every unit's rows, in order: one row group in memory at a time."""
        for u, unit in enumerate(self.units):
            yield unit, self.read_unit(u, columns)

    def read(self, columns: Sequence[str]) -> pa.Table:
        """``columns`` of every row, files in order, as one table."""
        parts = []
        for i, path in enumerate(self.paths):
            pf = open_parquet(path, self.meta[i])
            try:
                with arrow_errors(path, ", ".join(columns)):
                    parts.append(pf.read(columns=list(columns)))
            finally:
                pf.close()
        return pa.concat_tables(parts)


def read_interactions(dataset: str | Path, columns: Sequence[str]) -> pa.Table:
    """``columns`` of every user row of the dataset at ``dataset``, in file order."""
    return InteractionFiles(dataset).read(columns)
