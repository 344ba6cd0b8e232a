"""Feature spec: which sparse features exist, which table each reads, and how ids map to rows.

The spec is the one contract between data, training, quantization and serving: the reader
and the request decoder both call :func:`prepare_ids` with it, so an id is checked (or
hashed) the same way everywhere before it reaches a table.

Sequence features (``pooling = "none"``) go to a TorchRec ``EmbeddingCollection`` and come
out jagged, one vector per event; pooled features (``"sum"`` / ``"mean"``) go to an
``EmbeddingBagCollection`` and come out as one vector per user.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Pooling = Literal["none", "sum", "mean"]
Sharding = Literal["auto", "table_wise", "row_wise", "column_wise", "data_parallel"]


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    ``num_embeddings`` may be left out for the item table: it is then sized from the
    dataset (largest item id + 1). Ids outside ``[0, num_embeddings)``:

    * ``oov = "error"`` refuses them;
    * ``"hash"`` folds them into the table with a fixed multiplicative hash (collisions share
      a row; documented, deterministic, no state);
    * ``"mch"``: TorchRec's managed-collision module maps raw ids in ``[0, raw_id_space)``
      to rows, keeps the most useful ids (``mch_eviction``) and evicts the rest every
      ``mch_eviction_interval`` training steps; ids it has not kept share one miss row.
    """

    name: str
    features: tuple[str, ...]
    dim: int = 64
    num_embeddings: int | None = None
    pooling: Pooling = "none"
    oov: Literal["error", "hash", "mch"] = "error"
    raw_id_space: int | None = None  # oov = "mch": raw ids lie in [0, raw_id_space)
    mch_eviction: Literal["distance_lfu", "lfu", "lru"] = "distance_lfu"
    mch_eviction_interval: int = 100
    mch_buckets: int = 4  # sharded MCH needs a multiple of the world size
    data_type: Literal["fp32", "fp16"] = "fp32"
    sharding: Sharding = "auto"
    init_std: float | None = None
    qat: Literal["none", "int8", "int4"] = "none"  # train against the serving row quantization

    def __post_init__(self) -> None:
        if not self.features:
            raise ValueError(f"table '{self.name}': list at least one feature in 'features'")
        if self.num_embeddings is not None and self.num_embeddings <= 0:
            raise ValueError(f"table '{self.name}': num_embeddings must be positive")
        if self.dim <= 0:
            raise ValueError(f"table '{self.name}': dim must be positive")
        if self.oov == "mch" and (self.raw_id_space is None or self.num_embeddings is None or self.pooling != "none"):
            raise ValueError(f"table '{self.name}': oov = \"mch\" needs raw_id_space (the raw id range), "
                             "num_embeddings (the rows it manages) and a sequence table (pooling = \"none\")")


def _default_tables() -> tuple[TableConfig, ...]:
    return (TableConfig(name="item", features=("item",)),)


@dataclass(frozen=True)
class EmbeddingConfig:
    """All tables of a model. ``item_feature`` names the sequence feature that is predicted."""

    tables: tuple[TableConfig, ...] = field(default_factory=_default_tables)
    item_feature: str = "item"

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for t in self.tables:
            for f in t.features:
                if f in seen:
                    raise ValueError(f"feature '{f}' is read by tables '{seen[f]}' and '{t.name}'")
                seen[f] = t.name
        if self.item_feature not in seen:
            raise ValueError(
                f"item_feature '{self.item_feature}' is not read by any table; "
                f"features: {sorted(seen)}"
            )
        dims = {t.dim for t in self.sequence_tables}
        if len(dims) > 1:
            # TorchRec's EmbeddingCollection (and its sharders) need one dim for all tables.
            raise ValueError(f"sequence tables must share one dim, got {sorted(dims)}")

    @property
    def sequence_tables(self) -> tuple[TableConfig, ...]:
        return tuple(t for t in self.tables if t.pooling == "none")

    @property
    def pooled_tables(self) -> tuple[TableConfig, ...]:
        return tuple(t for t in self.tables if t.pooling != "none")

    @property
    def sequence_features(self) -> tuple[str, ...]:
        return tuple(f for t in self.sequence_tables for f in t.features)

    @property
    def pooled_features(self) -> tuple[str, ...]:
        return tuple(f for t in self.pooled_tables for f in t.features)

    def table_of(self, feature: str) -> TableConfig:
        for t in self.tables:
            if feature in t.features:
                return t
        raise KeyError(f"no table reads feature '{feature}'; features: {self.all_features}")

    @property
    def all_features(self) -> tuple[str, ...]:
        return tuple(f for t in self.tables for f in t.features)

    @property
    def item_table(self) -> TableConfig:
        return self.table_of(self.item_feature)

    @property
    def dim(self) -> int:
        return self.item_table.dim

    def resolved(self, sizes: dict[str, int]) -> EmbeddingConfig:
        """A copy where tables without ``num_embeddings`` take it from ``sizes[feature]``."""
        tables = []
        for t in self.tables:
            if t.num_embeddings is None:
                size = next((sizes[f] for f in t.features if f in sizes), None)
                if size is None:
                    raise ValueError(
                        f"table '{t.name}': set num_embeddings (the dataset gives no size for "
                        f"features {list(t.features)})"
                    )
                t = TableConfig(**{**t.__dict__, "num_embeddings": int(size)})
            tables.append(t)
        return EmbeddingConfig(tables=tuple(tables), item_feature=self.item_feature)


class IdOutOfRange(ValueError):
    """An id does not fit its table and the feature does not allow hashing."""

    def __init__(self, feature: str, value: int, size: int, where: str = "") -> None:
        self.feature, self.value, self.size = feature, value, size
        at = f" ({where})" if where else ""
        super().__init__(
            f"feature '{feature}': id {value} is outside the table's range [0, {size}){at}; "
            f"enlarge num_embeddings or set oov = \"hash\" on the table"
        )


# A 64-bit odd multiplier (from the golden ratio): spreads consecutive out-of-range ids
# over the table instead of stacking them on neighbouring rows.
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


def hash_ids(ids: np.ndarray, size: int) -> np.ndarray:
    """Deterministic fold of arbitrary int64 ids into ``[0, size)``."""
    x = ids.astype(np.uint64) * _HASH_MULT
    x ^= x >> np.uint64(29)
    return (x % np.uint64(size)).astype(np.int64)


def prepare_ids(table: TableConfig, feature: str, ids: np.ndarray, where: str = "") -> np.ndarray:
    """Checks (``oov="error"``) or folds (``oov="hash"``) ids for ``table``; returns int64 ids."""
    ids = np.asarray(ids, dtype=np.int64)
    size = table.raw_id_space if table.oov == "mch" else table.num_embeddings
    if size is None:
        raise ValueError(f"table '{table.name}' has no num_embeddings; resolve the spec first")
    if ids.size == 0:
        return ids
    bad = (ids < 0) | (ids >= size)
    if not bad.any():
        return ids
    if table.oov in ("error", "mch"):  # mch remaps inside the model, within raw_id_space
        raise IdOutOfRange(feature, int(ids[bad][0]), size, where)
    out = ids.copy()
    out[bad] = hash_ids(ids[bad], size)
    return out
