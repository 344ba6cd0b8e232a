"""TorchRec modules built from the feature spec.

:class:`SparseArch` owns one ``EmbeddingCollection`` (sequence features, jagged output)
and, when pooled features exist, one ``EmbeddingBagCollection`` (one vector per user).
Both are plain TorchRec modules, so ``DistributedModelParallel`` can shard them and
``torchrec.quant`` can convert them; the rest of the model only sees their outputs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    PoolingType,
)
from torchrec.modules.embedding_configs import (
    EmbeddingConfig as TRECEmbeddingConfig,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor
from torchrec.types import DataType

from genrec.embedding.qat import fake_quantize_rows
from genrec.embedding.spec import EmbeddingConfig, TableConfig

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
_DTYPE = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def _init_fn(table: TableConfig):  # noqa: ANN202 - a TorchRec init callable
    if table.init_std is None:
        return None
    return functools.partial(nn.init.normal_, mean=0.0, std=table.init_std)


def _sized(table: TableConfig) -> int:
    if table.num_embeddings is None:
        raise ValueError(f"table '{table.name}': num_embeddings is unresolved (see EmbeddingConfig.resolved)")
    return table.num_embeddings


def sequence_table_configs(cfg: EmbeddingConfig, mch: bool | None = None) -> list[TRECEmbeddingConfig]:
    """TorchRec configs of the sequence tables (``mch``: only managed-collision ones, or only
    the others; None: all)."""
    return [
        TRECEmbeddingConfig(
            name=t.name,
            num_embeddings=_sized(t),
            embedding_dim=t.dim,
            feature_names=list(t.features),
            data_type=_DTYPE[t.data_type],
            init_fn=_init_fn(t),
        )
        for t in cfg.sequence_tables
        if mch is None or (t.oov == "mch") == mch
    ]


_EVICTION = {"distance_lfu": "DistanceLFU_EvictionPolicy", "lfu": "LFU_EvictionPolicy", "lru": "LRU_EvictionPolicy"}


def managed_collision_collection(cfg: EmbeddingConfig, device: torch.device | None):  # noqa: ANN201
    """A ManagedCollisionEmbeddingCollection over the ``oov = "mch"`` tables (or None)."""
    from torchrec.modules import mc_modules
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    tables = sequence_table_configs(cfg, mch=True)
    if not tables:
        return None
    spec = {t.name: t for t in cfg.sequence_tables}
    dev = device if device is not None and device.type != "meta" else torch.device("cpu")
    modules = {}
    for t in tables:
        s = spec[t.name]
        policy_cls = getattr(mc_modules, _EVICTION[s.mch_eviction])
        policy = policy_cls() if s.mch_eviction == "lfu" else policy_cls(decay_exponent=1.0)
        modules[t.name] = mc_modules.MCHManagedCollisionModule(
            zch_size=t.num_embeddings, device=dev, eviction_policy=policy, eviction_interval=s.mch_eviction_interval,
            input_hash_size=s.raw_id_space, buckets=s.mch_buckets)
    mcc = mc_modules.ManagedCollisionCollection(managed_collision_modules=modules, embedding_configs=tables)
    # in place: eviction re-initialises rows through .data. A training step looks the table up
    # more than once (the sequence, then target and negative items); when the second lookup
    # evicts, a tracked write would invalidate the first lookup's saved weights, and a sharded
    # (TBE) backward then fails at the first eviction.
    return ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables=tables, device=device), mcc,
                                               return_remapped_features=False,
                                               allow_in_place_embed_weight_update=True)


def pooled_table_configs(cfg: EmbeddingConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=_sized(t),
            embedding_dim=t.dim,
            feature_names=list(t.features),
            pooling=_POOLING[t.pooling],
            data_type=_DTYPE[t.data_type],
            init_fn=_init_fn(t),
        )
        for t in cfg.pooled_tables
    ]


class SparseArch(nn.Module):
    """Sparse features in, embeddings out.

    Example (``F`` = 1 sequence feature, ``B`` = 2 users, lengths ``L`` = [3, 1], ``D`` = 8)::

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["item"], values=torch.tensor([5, 9, 2, 7]), lengths=torch.tensor([3, 1]))
        out = arch(kjt)            # {"item": JaggedTensor}, values [4, 8], lengths [3, 1]
        arch.lookup(torch.tensor([5, 7]))   # [2, 8]: rows for arbitrary item ids
    """

    def __init__(self, cfg: EmbeddingConfig, device: torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.sequence_features = list(cfg.sequence_features)
        self.mch_features = [f for t in cfg.sequence_tables if t.oov == "mch" for f in t.features]
        self.plain_features = [f for f in self.sequence_features if f not in self.mch_features]
        plain = sequence_table_configs(cfg, mch=False)
        self.ec = EmbeddingCollection(tables=plain, device=device) if plain else None
        self.mc_ec = managed_collision_collection(cfg, device)
        pooled = pooled_table_configs(cfg)
        self.ebc = EmbeddingBagCollection(tables=pooled, device=device) if pooled else None

        # feature -> direct row lookup, used at inference when every sequence feature has one
        # (a served artifact's quantized tables: quant.embeddings.ServedRows)
        self.rows = nn.ModuleDict()
        self.pooled_rows = nn.ModuleDict()  # the same for pooled features (serve.native pools them)
        # feature -> bits of fake quantization in training (TableConfig.qat)
        self.qat_bits = {f: {"int8": 8, "int4": 4}[t.qat] for t in cfg.sequence_tables if t.qat != "none"
                         for f in t.features}

    def _qat(self, feature: str, rows: torch.Tensor) -> torch.Tensor:
        bits = self.qat_bits.get(feature)
        return fake_quantize_rows(rows, bits) if bits and self.training else rows

    def _lookup(self, kjt: KeyedJaggedTensor, features: list[str], mch: bool) -> dict[str, JaggedTensor]:
        module = self.mc_ec if mch else self.ec
        if module is None:  # a served model (quant.load): its tables are only the served rows
            raise RuntimeError("this model's sequence tables are served rows only (an artifact loaded for "
                               "inference): call it in eval mode, or train from the checkpoint instead")
        lazy = module(kjt)[0] if mch else module(kjt)
        # a sharded collection returns a lazy awaitable; indexing by feature waits for it
        return {f: lazy[f] for f in features}

    def _subset(self, kjt: KeyedJaggedTensor, features: list[str]) -> KeyedJaggedTensor:
        if list(kjt.keys()) == features:
            return kjt
        return KeyedJaggedTensor.from_jt_dict({f: kjt[f] for f in features})

    def _direct(self) -> bool:
        return bool(self.rows) and not self.training and all(f in self.rows for f in self.sequence_features)

    def forward(self, seq: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if self._direct():
            values, lengths, b = seq.values(), seq.lengths(), seq.stride()
            out, start = {}, 0
            for i, (f, n) in enumerate(zip(seq.keys(), seq.length_per_key())):
                if f in self.rows:
                    out[f] = JaggedTensor(values=self.rows[f](values[start : start + n]),
                                          lengths=lengths[i * b : (i + 1) * b])
                start += n
            return out
        out = {}
        if self.plain_features:
            out.update(self._lookup(self._subset(seq, self.plain_features), self.plain_features, False))
        if self.mch_features:
            out.update(self._lookup(self._subset(seq, self.mch_features), self.mch_features, True))
        if self.qat_bits and self.training:
            out = {f: JaggedTensor(values=self._qat(f, jt.values()), lengths=jt.lengths(), offsets=jt.offsets())
                   for f, jt in out.items()}
        return out

    def pooled(self, ctx: KeyedJaggedTensor) -> KeyedTensor:
        if self.ebc is None:
            raise ValueError("this model has no pooled (context) tables")
        return self.ebc(ctx)

    def lookup(self, ids: torch.Tensor, feature: str | None = None) -> torch.Tensor:
        """Rows for ``ids`` [N] of ``feature`` (default: the item feature) -> [N, D].

        Goes through the same EmbeddingCollection as the sequence, so it works unchanged
        when the collection is sharded (the ids travel as a one-sample KJT).
        """
        feature = feature or self.cfg.item_feature
        if self._direct():
            return self.rows[feature](ids)
        n = ids.numel()
        mch = feature in self.mch_features
        keys = self.mch_features if mch else self.plain_features
        lengths = torch.tensor([n if f == feature else 0 for f in keys], dtype=torch.int64)
        kjt = KeyedJaggedTensor(keys=keys, values=ids.reshape(-1).long(), lengths=lengths.to(ids.device))
        return self._qat(feature, self._lookup(kjt, [feature], mch)[feature].values())
