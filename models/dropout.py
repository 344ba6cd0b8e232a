"""Dropout with the keep mask drawn as ``uniform >= p``.

``nn.Dropout`` on CPU draws its mask with ``bernoulli_``, which samples element by element:
on a [16k tokens, 64] activation, forward and backward, 8.6-10.5 ms against 5.4-6.5 ms here
(one thread, AMD EPYC with AVX-512). The default ML-1M HSTU training step has seven of them:
0.510 s/step with ``nn.Dropout`` against 0.466 s with this one (1.09x; median of six rounds
of ten steps on the same batches, the order alternating; 2026-12-02).
The same distribution (each element kept with probability 1 - p, scaled by 1 / (1 - p));
a different random stream.
"""

from __future__ import annotations

import torch
from torch import nn


class Dropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        scale = torch.rand_like(x).ge_(self.p).mul_(1.0 / (1.0 - self.p))  # 0 or 1 / (1 - p), in place
        return x.mul_(scale) if self.inplace else x * scale
