"""Gated MLP (SwiGLU, Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

Param names as HF (``gate_proj`` [F, D], ``up_proj`` [F, D], ``down_proj`` [D, F]); used for
dense layers and for MoE shared experts. Tensor-parallel (Megatron-LM) when the weights are
split over ``tp``: gate/up column-parallel, down row-parallel (see :class:`mff.nn.layers.Linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mff.backend import ops
from mff.nn.layers import Linear, linear, linears
from mff.nn.lora import add_low_rank, lora_input, slot_name
from mff.parallel.gather import gather
from mff.parallel.tp import TP_AXIS, chunk_range, copy_to_tp, tp_shard

__all__ = ["GatedMLP", "FusedGatedMLP"]


class GatedMLP(nn.Module):
    """``forward(x [..., D]) -> [..., D]`` with intermediate size F."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, [self.gate_proj, self.up_proj])
        return self.down_proj(F.silu(gate) * up)


class FusedGatedMLP(nn.Module):
    """SwiGLU with one fused ``gate_up_proj`` [2F, D] (gate rows first, then up rows; HF
    ``Glm4MLP``) and ``down_proj`` [D, F]. ``forward(x [..., D]) -> [..., D]``.

    Tensor parallelism, when ``gate_up_proj``'s rows are split over ``tp``: a plain row split
    would give rank 0 the gate rows and the last rank the up rows, so the weight is stored
    split (memory / tp) but gathered whole over tp on use, and each rank computes with its
    ``torch.chunk`` block of the gate rows and the same block of the up rows (the features
    ``down_proj``, row-parallel, holds). Cost beyond the split gate/up layers of the other
    families: per layer and micro-batch an all-gather of the [2F, D / dp] weight over tp in
    the forward and a reduce-scatter of its gradient in the backward ((tp - 1) / tp of
    2 F D / dp elements each way: the traffic of one all-reduce of the weight), no extra
    activation traffic. A LoRA slot on ``gate_up_proj`` follows the same rule: its ``B`` [2F, r]
    is gathered over tp and cut into the same gate and up rows.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = tp_shard(self.gate_up_proj.weight)
        if split is None:
            return self.down_proj(ops.swiglu(self.gate_up_proj(x)))  # npu_swiglu on an NPU
        w_gate, w_up = gather(self.gate_up_proj.weight, partial=(TP_AXIS,)).chunk(2, dim=0)
        start, stop = chunk_range(w_gate.shape[0], split.rank, split.size)
        x_tp = copy_to_tp(x, split.group)
        gate, up = linear(x_tp, w_gate[start:stop]), linear(x_tp, w_up[start:stop])
        lora = self.gate_up_proj.__dict__["_modules"].get(slot_name("weight"))
        if lora is not None:  # B gathered and cut like the weight; the rank-r activations' gradient summed over tp
            z = copy_to_tp(F.linear(lora_input(x, lora), gather(lora.A)), split.group)
            b_gate, b_up = gather(lora.B, partial=(TP_AXIS,)).chunk(2, dim=0)
            gate = add_low_rank(gate, z, b_gate[start:stop], lora.scale)
            up = add_low_rank(up, z, b_up[start:stop], lora.scale)
        return self.down_proj(F.silu(gate) * up)
