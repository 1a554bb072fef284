"""SwiGLU's activation (Shazeer, 2020): the MLP's fused gate_up projection, halved and gated.

    gate_up: [..., 2 * intermediate]  ->  silu(gate) * up: [..., intermediate]

On a GPU one Triton kernel reads gate_up once and writes the product (`minillm.kernels.activation`);
PyTorch would launch three kernels and write two intermediates.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import activation as _kernel
from .backend import use_triton


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if use_triton(gate_up):
            return _kernel.silu_and_mul(gate_up)  # [..., 2I] -> [..., I]
        return _kernel.silu_and_mul_ref(gate_up)
