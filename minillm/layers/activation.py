"""SwiGLU's activation (Shazeer, 2020): the MLP's fused gate_up projection, halved and gated.

    gate_up: [..., 2 * intermediate]  ->  silu(gate) * up: [..., intermediate]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [..., intermediate] each
        return F.silu(gate) * up
