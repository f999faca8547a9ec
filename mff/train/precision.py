"""Training precision: ``fp32``, ``bf16-mixed`` and ``bf16``.

- ``fp32``: params, grads, optimizer state and compute in fp32.
- ``bf16-mixed`` (torchtitan's and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, Megatron's ``--bf16`` with fp32 main params): the params stay fp32
  (the "master" copy the optimizer updates, with fp32 state); each forward computes with a
  bf16 cast of them, made inside autograd, so the gradients arrive in fp32 on the fp32 leaves.
- ``bf16``: params stored in bf16, optimizer state in fp32 (each update is computed in fp32
  and rounded into the bf16 param once).

In every mode the params a family keeps in fp32 (router weight, expert correction bias) stay
fp32, and the numerically sensitive parts compute in fp32 whatever the input dtype: RMSNorm
statistics (:func:`mff.backend.rms_norm_torch`), attention softmax (SDPA accumulates in fp32;
the small-T path casts), router scores and top-k (:mod:`mff.nn.moe`), and the loss
(:func:`mff.nn.loss.linear_cross_entropy_sum`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["PRECISIONS", "param_dtype", "compute_dtype", "compute_params"]

PRECISIONS = ("fp32", "bf16-mixed", "bf16")


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
