"""Dense tower and heads -> smaller dense weights.

Schemes (the ``nn.Linear`` weights change; norms, biases and bias tables stay fp32):
* ``fp32``: unchanged.
* ``bf16``: every floating tensor stored in bf16; served in bf16 on GPU, upcast on CPU
  (where bf16 matmuls have no fast path on CPUs without AVX512-BF16/AMX).
* ``int8``: per-output-channel symmetric int8 weights + fp32 scales. On CPU the Linear
  becomes PyTorch's dynamically quantized Linear (int8 GEMM through fbgemm/onednn,
  activations quantized per batch); elsewhere weights are dequantized once at load.
* ``fp8``: per-channel scaled ``float8_e4m3fn`` weights, dequantized to the activation
  dtype inside the layer (weight-only fp8: half the bytes of bf16 on disk and in memory).

The semantic-ID decoder (``sid_head.*``, when the model has one) is stored as trained under
every scheme: its integer codebook (``book_*``) must never change, and its float weights stay
fp32 because its beam search makes a discrete choice at every level: a rounding error that
swaps two prefixes at level 1 drops a whole subtree of items, which no later level recovers
(a dense retrieval score's error only swaps near ties). The decoder is small beside the
tables, so keeping it exact costs little.

The ranking head's calibrator (``ranking.calibrator.*``: knots of a monotone map per task,
``models.calibration``) is also stored as trained: in bf16 neighbouring knots would round
onto each other, and the map is a few KB. An artifact written before the calibrator existed
loads with it unfitted (the identity), as the model was served then.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.ao.nn.quantized.dynamic as nnqd
from torch import nn

from genrec.models.calibration import is_calibration_key

Scheme = Literal["fp32", "bf16", "int8", "fp8"]
SPARSE_PREFIXES = ("sparse.ec.", "sparse.ebc.", "sparse.mc_ec.")
EXACT_PREFIXES = ("sid_head.", "ranking.calibrator.")  # stored and served as trained, whatever the scheme
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_linear_weight(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (codes [out, in] int8 or float8_e4m3fn, per-row fp32 scales [out])."""
    amax = w.detach().float().abs().amax(dim=1).clamp(min=1e-8)
    if scheme == "int8":
        scale = amax / 127.0
        return torch.clamp(torch.round(w.float() / scale[:, None]), -127, 127).to(torch.int8), scale
    scale = amax / FP8_MAX
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def dequantize_linear_weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale[:, None]


class Fp8WeightLinear(nn.Module):
    """Linear layer with fp8 weights, dequantized per call to the input's dtype."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.codes.to(x.dtype) * self.scale[:, None].to(x.dtype))
        return nn.functional.linear(x, w, self.bias.to(x.dtype) if self.bias is not None else None)


def int8_dynamic_linear(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """PyTorch's dynamically quantized Linear holding exactly these int8 codes and scales."""
    out_f, in_f = codes.shape
    layer = nnqd.Linear(in_f, out_f, bias_=bias is not None, dtype=torch.qint8)
    qweight = torch._make_per_channel_quantized_tensor(
        codes, scale.double(), torch.zeros(out_f, dtype=torch.long), 0)
    layer.set_weight_bias(qweight, bias.float() if bias is not None else None)
    return layer


def _linear_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def dense_tensors(model: nn.Module, scheme: Scheme) -> dict[str, torch.Tensor]:
    """Artifact tensors of everything but the embedding tables."""
    linears = _linear_names(model)
    out: dict[str, torch.Tensor] = {}
    for key, v in model.state_dict().items():
        if key.startswith(SPARSE_PREFIXES):
            continue
        owner, _, leaf = key.rpartition(".")
        if key.startswith(EXACT_PREFIXES):
            out[key] = v.detach()
        elif scheme in ("int8", "fp8") and owner in linears and leaf == "weight":
            codes, scale = quantize_linear_weight(v, scheme)
            out[f"{key}.codes"], out[f"{key}.scale"] = codes, scale
        elif scheme == "bf16" and v.is_floating_point():
            out[key] = v.detach().to(torch.bfloat16)
        else:
            out[key] = v.detach()
    return out


def load_dense(model: nn.Module, tensors: dict[str, torch.Tensor], scheme: Scheme, device: torch.device) -> None:
    """Fills ``model``'s dense part from artifact tensors, swapping quantized Linears in."""
    compute = torch.bfloat16 if scheme == "bf16" and device.type == "cuda" else torch.float32
    plain = {k: (v.to(compute) if v.is_floating_point() and not k.startswith(EXACT_PREFIXES) else v)
             for k, v in tensors.items() if not k.endswith((".codes", ".scale"))}
    owners = [k[: -len(".weight.codes")] for k in tensors if k.endswith(".weight.codes")]
    missing, unexpected = model.load_state_dict(plain, strict=False)
    allowed = SPARSE_PREFIXES + tuple(f"{o}.weight" for o in owners)
    missing = [k for k in missing if not k.startswith(allowed) and not is_calibration_key(k)]
    if unexpected or missing:
        raise ValueError(f"dense tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for owner in owners:
        layer = model.get_submodule(owner)
        bias = tensors.get(f"{owner}.bias")
        codes, scale = tensors[f"{owner}.weight.codes"], tensors[f"{owner}.weight.scale"]
        if scheme == "int8" and device.type == "cpu":
            new: nn.Module = int8_dynamic_linear(codes, scale, bias)
        elif scheme == "fp8":
            new = Fp8WeightLinear(codes, scale, bias)
        else:
            new = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None)
            new.weight.data = dequantize_linear_weight(codes, scale).to(compute)
            if bias is not None:
                new.bias.data = bias.to(compute)
        parent, _, name = owner.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)


def dense_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
