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

from embedding.collection import SparseArch, pooled_table_configs, sequence_table_configs
from embedding.spec import EmbeddingConfig

Scheme = Literal["fp32", "fp16", "int8", "int4"]
DATA_TYPE = {"fp32": DataType.FP32, "fp16": DataType.FP16, "int8": DataType.INT8, "int4": DataType.INT4}
BITS = {"int8": 8, "int4": 4}


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
    """Artifact tensors of every table: ``<table>.<part>``."""
    if arch.mc_ec is not None:
        raise ValueError(
            "managed-collision (oov = \"mch\") tables cannot be exported yet: the artifact would need the "
            "raw-id -> row map; train the serving model with oov = \"hash\" or \"error\"")
    out: dict[str, torch.Tensor] = {}
    modules = [m for m in (arch.ec, arch.ebc) if m is not None]
    for module in modules:
        for key, weight in module.state_dict().items():
            table = key.split(".")[-2]
            for part, t in quantize_weight(weight, scheme).items():
                out[f"{table}.{part}"] = t
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
    cfg: EmbeddingConfig, tensors: dict[str, torch.Tensor], scheme: Scheme, row_alignment: int = 16
) -> tuple[QuantEC, QuantEBC | None]:
    """TorchRec quantized EC (and EBC for pooled tables) holding the artifact's rows."""
    dtype = DATA_TYPE[scheme]
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
    more than the lookup itself for a serving batch of a few hundred ids."""

    def __init__(self, parts: dict[str, torch.Tensor], scheme: Scheme, dim: int) -> None:
        super().__init__()
        self.bits, self.dim = BITS.get(scheme), dim
        packed = torch.cat([parts["codes"], parts["scale_bias"]], dim=1) if self.bits else parts["weight"]
        self.register_buffer("packed", packed.contiguous(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.index_select(0, ids.reshape(-1))
        if self.bits:
            return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(rows, self.bits)[:, : self.dim]
        return rows.float()


def served_rows(cfg: EmbeddingConfig, tensors: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, ServedRows]:
    """feature -> its table's :class:`ServedRows`, for every sequence feature."""
    out = {}
    for t in cfg.sequence_tables:
        parts = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == t.name}
        rows = ServedRows(parts, scheme, t.dim)
        out.update({f: rows for f in t.features})
    return out


def install(arch: SparseArch, ec: QuantEC, ebc: QuantEBC | None, rows: dict[str, ServedRows] | None = None) -> None:
    """Swaps the float TorchRec modules of ``arch`` for their quantized counterparts (and
    gives it ``rows``, the direct lookups inference uses for sequence features)."""
    arch.ec = ec
    if ebc is not None:
        arch.ebc = ebc
    if rows:
        arch.rows = nn.ModuleDict(rows)


def table_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
