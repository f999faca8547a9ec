"""How a decoder block runs: eagerly, under activation checkpointing, compiled, or both.

A skeleton's forward calls every block through :func:`run_block` with the model's
:class:`BlockExecution`:

- ``ac="full"``: the block's activations are dropped after the forward and recomputed in the
  backward (``torch.utils.checkpoint``, non-reentrant), one block at a time, as torchtitan's
  and Megatron's full recomputation;
- ``ac="selective"``: the recomputation keeps the outputs of the matmuls and attention
  (``mm``, ``addmm``, ``bmm``, ``_grouped_mm`` and mff's ``mff::grouped_mm`` expert GEMMs,
  scaled-dot-product attention: the expensive ops) and recomputes only the cheap elementwise ops and norms (torchtitan's op-level
  selective AC, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``);
- ``compile=True``: each block runs through ``torch.compile`` (one compiled graph serves all
  blocks of the same shape, as torchtitan's per-block compilation). MoE blocks compile whole:
  their grouped expert GEMMs are custom ops with a fake rule (:mod:`mff.nn.grouped_gemm`), not
  a graph break, so ``selective`` runs inside the compiled block for them too; under expert
  parallelism the all-to-all dispatch still runs eagerly, and ``selective`` with ``compile``
  is refused there. ``full`` checkpoints around the compiled block.

The block's params are passed to the checkpointed function explicitly: the skeleton holds meta
tensors and gets its real params from ``torch.func.functional_call`` only for the duration of
the forward, while the recomputation runs later, inside the backward. Outputs that are
statistics (MoE expert loads) are produced by the forward only; the recomputation's copies are
discarded, so loads are counted once.

Mixed precision casts at use (:func:`mff.nn.cast.cast_params_at_use`, what ``bf16-mixed`` training runs
under): each block's float params are cast to the compute dtype when the block runs, not all at
once before the forward. Under activation checkpointing the cast is inside the checkpointed
region, so a block's bf16 weights are dropped after its forward like its other activations and
made again for its backward (torchtitan's and FSDP2's ``MixedPrecisionPolicy`` casts per module
the same way); without checkpointing autograd keeps the copies the block's backward needs and
frees them once that backward has run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mff.nn import block_attention, grouped_gemm  # noqa: F401  (register torch.ops.mff.* before _SAVE_OPS names them)
from mff.nn.cast import active_cast, cast_params_at_use

__all__ = ["AC_MODES", "BlockExecution", "cast_params_at_use", "run_block"]

AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class BlockExecution:
    """``ac``: activation checkpointing per block, one of :data:`AC_MODES`; ``compile``: run
    each block through ``torch.compile``."""

    ac: str = "none"
    compile: bool = False

    def __post_init__(self):
        if self.ac not in AC_MODES:
            raise ValueError(f"ac={self.ac!r}; expected one of {AC_MODES}")
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile={self.compile!r}; expected True or False")


_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)
_SAVE_OPS.update({torch.ops.mff.grouped_mm.default, torch.ops.mff.grouped_mm_weight_grad.default,
                  torch.ops.mff.causal_attention.default})


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(block: nn.Module, *args):
    return checkpoint(block, *args, use_reentrant=False, context_fn=_selective_context)


def _has_graph_break(block: nn.Module) -> bool:
    """A block with MoE experts split over an ``ep`` axis: their all-to-all dispatch runs
    eagerly under torch.compile (a graph break)."""
    from mff.nn.moe import Experts
    from mff.parallel.ep import expert_group

    return any(isinstance(m, Experts) and expert_group(m.gate_up_proj) is not None for m in block.modules())


def _compiled(block: nn.Module, selective: bool):
    """``torch.compile`` of the block, cached on it. With ``selective`` the selective
    checkpointing is inside the compiled region, so its recomputation is part of the compiled
    backward graph (whose inputs hold the params: the skeleton's meta params are never read)."""
    cache = block.__dict__.setdefault("_mff_compiled", {})  # in __dict__: not a registered submodule
    if selective not in cache:
        cache[selective] = torch.compile(functools.partial(_checkpointed, block) if selective else block)
    return cache[selective]


def _call_with(block: nn.Module, target, names: list[str], cast: tuple[torch.dtype, frozenset[str]] | None, *flat):
    """``target(*flat[n:])`` with the block's params ``names`` set to ``flat[:n]``, the names in
    ``cast[1]`` cast to ``cast[0]`` first."""
    n = len(names)
    tensors = dict(zip(names, flat[:n]))
    if cast is not None:
        dtype, which = cast
        tensors = {k: v.to(dtype) if k in which else v for k, v in tensors.items()}
    with _reparametrize_module(block, tensors, strict=True):
        return target(*flat[n:])


def _cast_plan(named: list[tuple[str, torch.Tensor]], active: tuple[torch.dtype, frozenset[int]] | None
               ) -> tuple[torch.dtype, frozenset[str]] | None:
    """``active`` (the cast_params_at_use state) as ``(dtype, names of the block's params to
    cast)``, or None when it is inactive or casts none of them."""
    if active is None:
        return None
    dtype, keep = active
    which = frozenset(k for k, p in named if p.is_floating_point() and p.dtype != dtype and id(p) not in keep)
    return (dtype, which) if which else None


def run_block(block: nn.Module, execution: BlockExecution | None, *args):
    """``block(*args)`` as ``execution`` says (None: eagerly, no checkpointing), its params cast
    at use while :func:`cast_params_at_use` is active.

    Must be called inside the model's ``functional_call`` (the block's params are the real
    tensors then). Checkpointing applies only when grad is enabled; generation and evaluation
    run the block without it.

    Raises:
        ValueError: ``ac="selective"`` with ``compile`` on a block whose MoE experts are split
            over ``ep`` (the all-to-all dispatch is a graph break, across which torch 2.13 cannot
            recompute selectively).
    """
    active = active_cast()
    ac = execution.ac if execution is not None and torch.is_grad_enabled() else "none"
    compiled = execution is not None and execution.compile
    if active is None and ac == "none":
        return (_compiled(block, False) if compiled else block)(*args)  # the decoding path: nothing else to do
    named = list(block.named_parameters())
    names, tensors = [k for k, _ in named], [p for _, p in named]
    cast = _cast_plan(named, active)
    if compiled and ac == "selective":
        if _has_graph_break(block):
            raise ValueError("--ac selective with --compile is not supported with expert parallelism (--parallel.ep > 1: the "
                             "all-to-all expert dispatch runs eagerly, a graph break that selective recomputation cannot "
                             "cross); use --ac full with --compile, or --ac selective without --compile")
        target = _compiled(block, True)
        return _call_with(block, target, names, cast, *tensors, *args) if cast else target(*args)
    target = _compiled(block, False) if compiled else block
    if ac == "none":
        return _call_with(block, target, names, cast, *tensors, *args) if cast else target(*args)
    # the recomputation runs inside the backward, after functional_call has put the skeleton's
    # meta params back: the block's params go in as explicit inputs and are swapped in again
    # (and cast again: the bf16 copies are not kept between forward and backward)
    body = functools.partial(_call_with, block, target, names, cast)
    context = {"context_fn": _selective_context} if ac == "selective" else {}
    return checkpoint(body, *tensors, *args, use_reentrant=False, **context)
