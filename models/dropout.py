"""Dropout whose training pass is ``kernels.dropout``: on CPU the mask drawn by a native
counter-based hash and redrawn for the backward pass instead of PyTorch's generator (the HSTU
training step has seven dropouts); the same distribution (each element kept with probability
1 - p, scaled by 1 / (1 - p)), a different random stream.
"""

from __future__ import annotations

import torch
from torch import nn

from genrec.kernels.dropout import dropout


class Dropout(nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        return dropout(x, self.p, self.inplace)
