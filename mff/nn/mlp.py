"""Gated MLP (SwiGLU, Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

Param names as HF (``gate_proj`` [F, D], ``up_proj`` [F, D], ``down_proj`` [D, F]); used for
dense layers and for MoE shared experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mff.nn.layers import Linear

__all__ = ["GatedMLP", "FusedGatedMLP"]


class GatedMLP(nn.Module):
    """``forward(x [..., D]) -> [..., D]`` with intermediate size F."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """SwiGLU with one fused ``gate_up_proj`` [2F, D] (gate rows first, then up rows; HF
    ``Glm4MLP``) and ``down_proj`` [D, F]. ``forward(x [..., D]) -> [..., D]``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
