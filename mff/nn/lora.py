"""LoRA (Hu et al. 2021, arXiv 2106.09685): the low-rank update ``W + s B A`` computed as
``x -> A -> B`` beside a frozen weight, never as a full-size delta.

A skeleton gets one :class:`LoRAFactors` slot per adapted weight (:func:`attach_lora`): a child
module ``lora_<param>`` of the module owning the weight (``q_proj.lora_weight``,
``experts.lora_gate_up_proj``) holding ``A`` and ``B``. The layers that own the weights
(:class:`mff.nn.layers.Linear`, :class:`mff.nn.mlp.FusedGatedMLP`, :class:`mff.nn.moe.Experts`,
MLA's absorbed decode path) add the low-rank path when their slot is there. The factors come in
through ``torch.func.functional_call`` like every other param; outside the skeleton an adapter
is addressed by its weight's path plus ``.lora_A`` / ``.lora_B``
(``model.layers.0.self_attn.q_proj.weight.lora_A``, see :func:`adapter_path`).

Shapes (PEFT's ``lora.Linear`` orientation, per expert for stacked experts):

- a linear weight ``[F, D]`` (``y = x W^T``): ``A`` [r, D], ``B`` [F, r];
- stacked experts ``[E, F, D]`` (HF v5 ``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]):
  ``A`` [E, r, D], ``B`` [E, F, r], one pair per expert.

``y = x W^T + s (dropout(x) A^T) B^T`` with ``s = alpha / r`` (or ``alpha / sqrt(r)``,
rsLoRA, Kalajdzievski 2023). Dropout acts only while gradients are being computed (training);
evaluation and generation run without grad (``torch.no_grad``, ``torch.inference_mode``) and see no dropout. With ``B = 0`` the
output equals the base model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRAFactors", "attach_lora", "slot_name", "adapter_path", "skeleton_path", "lora_input", "low_rank", "add_low_rank", "delta_weight"]

SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"


class LoRAFactors(nn.Module):
    """``A`` and ``B`` of one adapted weight (meta tensors in the skeleton), the scale ``s`` and
    the dropout probability (constants of the run)."""

    def __init__(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...], scale: float, dropout: float = 0.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(a_shape))
        self.B = nn.Parameter(torch.empty(b_shape))
        self.scale = float(scale)
        self.dropout = float(dropout)


def slot_name(param: str) -> str:
    """The child module holding the factors of the owning module's param ``param``."""
    return f"lora_{param}"


def adapter_path(weight_path: str, which: str) -> str:
    """``<weight path>.lora_A`` (``which="A"``) or ``.lora_B``: the adapter's path in the adapter
    pytree and in mff checkpoints."""
    return weight_path + (SUFFIX_A if which == "A" else SUFFIX_B)


def skeleton_path(adapter: str) -> str:
    """The skeleton's param name of an adapter path: ``m.q_proj.weight.lora_A`` -> ``m.q_proj.lora_weight.A``."""
    for suffix, which in ((SUFFIX_A, "A"), (SUFFIX_B, "B")):
        if adapter.endswith(suffix):
            module, _, param = adapter[: -len(suffix)].rpartition(".")
            return f"{module}.{slot_name(param)}.{which}" if module else f"{slot_name(param)}.{which}"
    raise ValueError(f"{adapter!r} is not an adapter path (it must end in {SUFFIX_A} or {SUFFIX_B})")


def attach_lora(skeleton: nn.Module, targets: dict[str, tuple[tuple[int, ...], tuple[int, ...], float]], dropout: float) -> None:
    """Give each target weight of ``skeleton`` its :class:`LoRAFactors` slot, in place.

    Args:
        targets: weight path -> (A shape, B shape, scale ``s`` of its low-rank path).
        dropout: dropout probability on the low-rank path's input.
    Raises:
        ValueError: a target that is not a param of the skeleton.
    """
    modules = dict(skeleton.named_modules())
    for path, (a_shape, b_shape, scale) in targets.items():
        owner_path, _, param = path.rpartition(".")
        owner = modules.get(owner_path)
        if owner is None or param not in owner._parameters:
            raise ValueError(f"LoRA target {path!r} is not a param of the model")
        with torch.device("meta"):
            setattr(owner, slot_name(param), LoRAFactors(a_shape, b_shape, scale, dropout))


def lora_input(x: torch.Tensor, f: LoRAFactors) -> torch.Tensor:
    """``x`` with the slot's dropout applied (only while gradients are computed)."""
    if f.dropout > 0 and torch.is_grad_enabled():
        return F.dropout(x, f.dropout, training=True)
    return x


def low_rank(x: torch.Tensor, a_RD: torch.Tensor, b_FR: torch.Tensor, scale: float) -> torch.Tensor:
    """``s (x A^T) B^T``: ``x`` [..., D], ``A`` [r, D], ``B`` [F, r] -> [..., F]."""
    return F.linear(F.linear(x, a_RD), b_FR) * scale


def add_low_rank(y: torch.Tensor, z: torch.Tensor, b_FR: torch.Tensor, scale: float) -> torch.Tensor:
    """``y + s z B^T`` as one ``addmm`` (one new [..., F] tensor, where ``y + (z B^T) * s``
    makes three): ``y`` [..., F], ``z`` [..., r] (the input's rank-r activations ``x A^T``),
    ``B`` [F, r]."""
    f, r = y.shape[-1], z.shape[-1]
    return torch.addmm(y.reshape(-1, f), z.reshape(-1, r), b_FR.t(), alpha=scale).view(y.shape)


def delta_weight(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The full-size update ``s B A``: [F, D] from ``A`` [r, D], ``B`` [F, r], or [E, F, D]
    from stacked ``A`` [E, r, D], ``B`` [E, F, r]. For merging and the absorbed MLA decode path
    only; training never builds it."""
    return torch.matmul(b, a) * scale
