"""Model pieces shared by the benchmarks."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LN MLP block, [B, T, d] -> [B, T, d]: x + fc2(gelu(fc1(ln(x)))), hidden width 4d. Compute grows
    with T, parameters do not."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))
