"""``[serve.scoring]``: the precision candidates are scored in (serve.engine.TorchEngine, and the
SGLang engine's model, which scores through one).

A module of its own, importing nothing heavy, so that the server's config (serve.server), the
engine processes' settings (serve.worker) and the engine factory can name it without loading
the model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Precision = Literal["fp32", "bf16", "auto"]


def check_precision(precision: str) -> None:
    """Refuses a candidate precision other than fp32, bf16 or auto (the config and both engines)."""
    if precision not in get_args(Precision):
        raise ValueError(f"serve.scoring.candidate_precision = {precision!r}; choose fp32, bf16 or auto")


@dataclass(frozen=True)
class ScoringConfig:
    """``[serve.scoring]``: ``candidate_precision`` is the precision of the GEMMs that score a
    call's candidates (the packed path): their attention against the user's cached keys and
    values (``kernels.hstu_candidates``), the tower's linear layers and the ranking head's MLP
    (``kernels.bf16_ops``): "fp32" (the model's own), "bf16" (inputs rounded to bf16, fp32
    accumulation, SiLU good to bf16's rounding: about twice fp32's rate on CPUs with
    AVX512-BF16 or AMX, which is what ranking thousands of candidates against 10^3-10^4 cached events is bound by), or "auto"
    (bf16 where the CPU has either, for the calls large enough to gain: candidates x history
    events past ``serve.packed.BF16_FROM_PAIRS``; smaller calls run faster on the fp32 native
    kernel). The default is fp32: bf16 moves probabilities by about 1e-3 at most (the ranking
    benchmark's model: ``bf16_vs_fp32`` in benchmarks/results/ranking_serving.json), which an
    ads pipeline that prices on the probability should choose knowingly. The SGLang engine's
    model scores through a TorchEngine in SGLang's scheduler, set the same way."""

    candidate_precision: Precision = "fp32"

    def __post_init__(self) -> None:
        check_precision(self.candidate_precision)
