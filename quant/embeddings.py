"""Embedding tables -> fbgemm row-wise quantized tables, through TorchRec's quant modules.

int8 / int4 rows are fbgemm's fused format: n-bit codes plus a per-row fp16 scale and bias
(``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``); fp16 rows are plain halves. The
artifact stores codes and scale/bias unpadded; serving builds TorchRec's quantized
``EmbeddingCollection`` / ``EmbeddingBagCollection`` from them, so lookups run fbgemm's
quantized kernels (CPU or GPU) and the model code stays the same (KJT in, rows out).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEC
from torchrec.types import DataType

from genrec.embedding.collection import SparseArch, pooled_table_configs, sequence_table_configs
from genrec.embedding.spec import EmbeddingConfig
from genrec.quant.pages import on_huge_pages

Scheme = Literal["fp32", "fp16", "int8", "int4"]
DATA_TYPE = {"fp32": DataType.FP32, "fp16": DataType.FP16, "int8": DataType.INT8, "int4": DataType.INT4}
BITS = {"int8": 8, "int4": 4}


# fbgemm packs a row's codes and its 4-byte scale / bias into whole 2-byte words: an int8 row needs
# an even number of columns, an int4 row a multiple of 4
DIM_MULTIPLE = {"int8": 2, "int4": 4}


def check_dims(dims: dict[str, int], scheme: Scheme) -> None:
    """Refuses, naming them, tables of ``dims`` (name -> columns) that ``scheme`` cannot pack."""
    m = DIM_MULTIPLE.get(scheme, 1)
    bad = {name: d for name, d in dims.items() if d % m}
    if bad:
        raise ValueError(f"embeddings {scheme}: rows are packed in multiples of {m} columns, and table(s) "
                         + ", ".join(f"'{n}' (dim {d})" for n, d in bad.items())
                         + " are not; quantize them as fp16, or train with such a dim")


def quantize_weight(weight: torch.Tensor, scheme: Scheme) -> dict[str, torch.Tensor]:
    """[N, D] float rows -> {'codes': [N, D * bits / 8] uint8, 'scale_bias': [N, 4] uint8}
    for int8 / int4, {'weight': [N, D]} in fp16 / fp32 otherwise."""
    w = weight.detach().float().cpu().contiguous()
    if scheme in BITS:
        packed = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, BITS[scheme])
        return {"codes": packed[:, :-4].contiguous(), "scale_bias": packed[:, -4:].contiguous()}
    return {"weight": w.half() if scheme == "fp16" else w}


def dequantize(parts: dict[str, torch.Tensor], scheme: Scheme, dim: int) -> torch.Tensor:
    """The float rows a quantized table serves (for error bounds and tests): [N, D]."""
    if scheme not in BITS:
        return parts["weight"].float()
    packed = torch.cat([parts["codes"], parts["scale_bias"]], dim=1)
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(packed, BITS[scheme])[:, :dim]


def table_tensors(arch: SparseArch, scheme: Scheme) -> dict[str, torch.Tensor]:
    """Artifact tensors of every table: ``<table>.<part>``; a managed-collision table also
    gets its raw-id map (``<table>.mch_ids``, ``<table>.mch_rows``: :func:`mch_maps`)."""
    out: dict[str, torch.Tensor] = {}
    weights = {}
    for module in (arch.ec, arch.ebc):
        if module is not None:
            weights.update(module.state_dict())
    if arch.mc_ec is not None:
        mc_state = arch.mc_ec.state_dict()
        weights.update({k: v for k, v in mc_state.items() if k.startswith(_MC_EMBEDDINGS)})
        for table, (ids, rows) in mch_maps(mc_state).items():
            out[f"{table}.mch_ids"], out[f"{table}.mch_rows"] = ids, rows
    for key, weight in weights.items():
        table = key.split(".")[-2]
        for part, t in quantize_weight(weight, scheme).items():
            out[f"{table}.{part}"] = t
    return out


_MC_EMBEDDINGS = "_embedding_module.embeddings."
_MC_MODULES = "_managed_collision_collection._managed_collision_modules."


def mch_maps(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """table -> (raw ids [K] int64 ascending, their rows [K] int32) of every managed-collision
    table in ``state`` (a ManagedCollisionEmbeddingCollection's state dict): the ids its
    TorchRec module holds a row for at the checkpoint (free slots left out). Every other raw
    id reads the table's last row, the module's shared miss row."""
    free = torch.iinfo(torch.int64).max
    out = {}
    for key, ids in state.items():
        if not (key.startswith(_MC_MODULES) and key.endswith("._mch_sorted_raw_ids")):
            continue
        prefix = key[: -len("_mch_sorted_raw_ids")]
        rows = state[prefix + "_mch_remapped_ids_mapping"]
        keep = ids != free
        ids, order = torch.sort(ids[keep])
        out[prefix[len(_MC_MODULES) : -1]] = (ids.contiguous(), rows[keep][order].to(torch.int32).contiguous())
    return out


def _weights(configs: list[BaseEmbeddingConfig], tensors: dict[str, torch.Tensor], scheme: Scheme):  # noqa: ANN202
    weights = {}
    for t in configs:
        if scheme in BITS:
            weights[t.name] = (tensors[f"{t.name}.codes"], tensors[f"{t.name}.scale_bias"])
        else:
            weights[t.name] = (tensors[f"{t.name}.weight"].contiguous().view(torch.uint8), None)
    return weights


def quantized_modules(
    cfg: EmbeddingConfig, tensors: dict[str, torch.Tensor], scheme: Scheme, row_alignment: int = 16,
    sequence: bool = True,
) -> tuple[QuantEC | None, QuantEBC | None]:
    """TorchRec quantized EC (and EBC for pooled tables) holding the artifact's rows; each holds
    its own padded copy of them (``row_alignment``). ``sequence`` False: no EC (None), for a
    model whose sequence lookups are all :class:`ServedRows` (quant.load.load_model)."""
    dtype = DATA_TYPE[scheme]
    ec = None
    if sequence:
        seq = [replace(t, data_type=dtype) for t in sequence_table_configs(cfg)]
        ec = QuantEC(seq, device=torch.device("cpu"), output_dtype=torch.float32,
                     table_name_to_quantized_weights=_weights(seq, tensors, scheme), row_alignment=row_alignment)
    ebc = None
    pooled = [replace(t, data_type=dtype) for t in pooled_table_configs(cfg)]
    if pooled:
        ebc = QuantEBC(pooled, is_weighted=False, device=torch.device("cpu"), output_dtype=torch.float32,
                       table_name_to_quantized_weights=_weights(pooled, tensors, scheme), row_alignment=row_alignment)
    return ec, ebc


class ServedRows(nn.Module):
    """Rows of one quantized sequence table for row ids, by fbgemm's row-wise dequantize op:
    what the quantized EmbeddingCollection returns for those ids (same codes, same fp16
    scale and bias), without its KJT split, TBE call and jagged re-assembly, which cost
    more than the lookup itself for a serving batch of a few hundred ids.

    A managed-collision table (``mch_ids`` / ``mch_rows`` in ``parts``, :func:`mch_maps`)
    takes raw ids: each is looked up in the map, as TorchRec's module remaps it in eval
    mode, and an id without a row reads the last row (the shared miss row)."""

    def __init__(self, parts: dict[str, torch.Tensor], scheme: Scheme, dim: int) -> None:
        super().__init__()
        self.bits, self.dim = BITS.get(scheme), dim
        packed = torch.cat([parts["codes"], parts["scale_bias"]], dim=1) if self.bits else parts["weight"]
        # random row reads: on huge pages a gather misses the TLB far less (quant/pages.py)
        self.register_buffer("packed", on_huge_pages(packed.contiguous()), persistent=False)
        self.remap = "mch_ids" in parts
        if self.remap:
            self.register_buffer("mch_ids", parts["mch_ids"], persistent=False)
            self.register_buffer("mch_rows", parts["mch_rows"].long(), persistent=False)
            self.miss_row = packed.shape[0] - 1

    def row_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Table rows of ``ids`` (raw ids of a managed-collision table -> their rows)."""
        ids = ids.reshape(-1)
        if not self.remap:
            return ids
        if self.mch_ids.numel() == 0:  # the module kept no id: every id misses
            return torch.full_like(ids, self.miss_row)
        pos = torch.searchsorted(self.mch_ids, ids).clamp_(max=self.mch_ids.numel() - 1)
        return torch.where(self.mch_ids[pos] == ids, self.mch_rows[pos], self.miss_row)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.index_select(0, self.row_ids(ids))
        if self.bits:
            return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(rows, self.bits)[:, : self.dim]
        return rows.float()


def served_rows(cfg: EmbeddingConfig, tensors: dict[str, torch.Tensor], scheme: Scheme,
                pooled: bool = False) -> dict[str, ServedRows]:
    """feature -> its table's :class:`ServedRows`, for every sequence feature (``pooled``: every
    pooled feature, whose rows a serving path may pool itself instead of through the EBC)."""
    out = {}
    for t in cfg.pooled_tables if pooled else cfg.sequence_tables:
        parts = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == t.name}
        rows = ServedRows(parts, scheme, t.dim)
        out.update({f: rows for f in t.features})
    return out


def install(arch: SparseArch, ec: QuantEC | None, ebc: QuantEBC | None, rows: dict[str, ServedRows] | None = None,
            pooled_rows: dict[str, ServedRows] | None = None) -> None:
    """Swaps the float TorchRec modules of ``arch`` for their quantized counterparts (and
    gives it ``rows``, the direct lookups inference uses for sequence features, and
    ``pooled_rows``, the pooled tables' rows for serving paths that pool them natively). A
    managed-collision collection goes: its tables are in ``ec`` (or, ``ec`` None, only in
    ``rows``, which must then cover every sequence feature) and its raw-id maps in ``rows``."""
    if ec is None and not all(f in (rows or {}) for f in arch.sequence_features):
        raise ValueError("install: without a quantized EmbeddingCollection every sequence feature needs served rows")
    arch.ec = ec
    arch.mc_ec = None
    if ebc is not None:
        arch.ebc = ebc
    if rows:
        arch.rows = nn.ModuleDict(rows)
    if pooled_rows:
        arch.pooled_rows = nn.ModuleDict(pooled_rows)


def table_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
