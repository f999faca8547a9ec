"""Training precision: ``fp32``, ``bf16-mixed`` and ``bf16``.

- ``fp32``: params, grads, optimizer state and compute in fp32.
- ``bf16-mixed`` (torchtitan's and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, Megatron's ``--bf16`` with fp32 main params): the params stay fp32
  (the "master" copy the optimizer updates, with fp32 state); each forward computes with a
  bf16 cast of them, made inside autograd, so the gradients arrive in fp32 on the fp32 leaves.
- ``bf16``: params stored in bf16, optimizer state in fp32 (each update is computed in fp32
  and rounded into the bf16 param once).

``bf16-mixed`` training casts at use (:func:`forward_params`): each block's own params when
the block runs (:func:`mff.nn.cast.cast_params_at_use`), so under activation checkpointing a
block's bf16 weights live only during its forward and its backward, and the fp32 masters are
the only full-size copy of the weights besides the optimizer state. The embedding table and the
output head stay fp32 where gathering them moves no data (a plain tensor, or a DTensor split
over no mesh axis of size > 1): the embedding casts the rows it looks up and the loss casts the
head inside its chunked kernel (a bf16 copy that lives only for the loss's call), so their
gradients are summed in fp32, no bf16 copy of either [V, D] matrix is held from the forward
to the backward, and no bf16 gradient of either is cast back to fp32; sharded (FSDP, tp),
they are cast before the forward like the other params outside the blocks (final norm, MTP's
own projections), so the gathers move bf16.

In every mode the params a family keeps in fp32 (router weight, expert correction bias) stay
fp32, and the numerically sensitive parts compute in fp32 whatever the input dtype: RMSNorm
statistics (:func:`mff.backend.rms_norm_torch`), attention softmax (SDPA accumulates in fp32;
the small-T path casts), router scores and top-k (:mod:`mff.nn.moe`), and the loss
(:func:`mff.nn.loss.linear_cross_entropy_sum`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor

from mff.nn.cast import cast_params_at_use

__all__ = ["CAST_BY_USER", "PRECISIONS", "param_dtype", "compute_dtype", "compute_params", "forward_params"]

PRECISIONS = ("fp32", "bf16-mixed", "bf16")

# params outside the blocks whose users cast what they read, so forward_params may leave them
# fp32: the embedding lookup (:class:`mff.nn.layers.Embedding`, to the cast_params_at_use dtype)
# and the head's loss and logits (mff.nn.loss, mff.nn.head: to the dtype of the hidden states)
CAST_BY_USER = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def _unsharded(v: torch.Tensor) -> bool:
    """A plain tensor, or a DTensor split over no mesh axis of size > 1 (gathering it moves no data)."""
    if not isinstance(v, DTensor):
        return True
    return all(p.is_replicate() or v.device_mesh.size(i) == 1 for i, p in enumerate(v.placements))


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; expected one of {PRECISIONS}")


def param_dtype(precision: str) -> torch.dtype:
    """Dtype the params are stored in (fp32 except for ``bf16``). Raises ValueError for an
    unknown precision."""
    _check(precision)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """Dtype the matmuls run in. Raises ValueError for an unknown precision."""
    _check(precision)
    return torch.float32 if precision == "fp32" else torch.bfloat16


def compute_params(model, params: Mapping[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """The params the forward uses: ``params`` themselves, or for ``bf16-mixed`` a
    differentiable bf16 cast of each float param that the family does not keep in fp32
    (``model.is_fp32``). Works on DTensors (the cast is local to each shard, so FSDP gathers
    move bf16). Raises ValueError for an unknown precision."""
    _check(precision)
    if precision != "bf16-mixed":
        return dict(params)
    return {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dtype != torch.bfloat16 and not model.is_fp32(k) else v
            for k, v in params.items()}


@contextlib.contextmanager
def forward_params(model, params: Mapping[str, torch.Tensor], precision: str) -> Iterator[dict[str, torch.Tensor]]:
    """Context for one forward of ``model`` (a :class:`mff.model.Model`) in ``precision``:
    yields the params to pass to ``model.forward`` inside it. Like :func:`compute_params`, except
    that for ``bf16-mixed`` the params of the main decoder layers (``model.is_block_param``) stay
    fp32 in the yielded dict and are cast block by block when each block runs (the cast is part of
    the autograd graph, so the gradients arrive in fp32; a checkpointed block casts again in its
    backward, after the context has closed), and so do the embedding table and the output head
    when they are not sharded (:data:`CAST_BY_USER`: cast by the lookup and by the loss). The
    forward computes the same values as with :func:`compute_params`; the embedding and head
    gradients are summed in fp32 instead of bf16. Raises ValueError for an unknown precision."""
    _check(precision)
    if precision != "bf16-mixed":
        yield dict(params)
        return
    keep = frozenset(id(v) for k, v in params.items() if model.is_fp32(k))
    out = {k: v.to(torch.bfloat16) if (v.is_floating_point() and v.dtype != torch.bfloat16 and id(v) not in keep
                                        and not model.is_block_param(k) and not (k in CAST_BY_USER and _unsharded(v))) else v
           for k, v in params.items()}
    with cast_params_at_use(torch.bfloat16, keep):
        yield out
