"""Dropout with the keep mask drawn as ``uniform >= p``.

``nn.Dropout`` on CPU draws its mask with ``bernoulli_``, which samples element by element;
one vectorised ``uniform_`` and a comparison make the same mask in fewer passes (the default
HSTU training step has seven dropouts). The same distribution (each element kept with probability 1 - p, scaled by 1 / (1 - p));
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
