"""Casting params at use (mixed precision): the context that says which dtype the forward
computes in, read by the code that uses each param (:func:`mff.nn.blocks.run_block` for the
decoder blocks' params, :class:`mff.nn.layers.Embedding` for the looked-up rows).

``bf16-mixed`` training (:func:`mff.train.precision.forward_params`) keeps the fp32 params and
activates :func:`cast_params_at_use`; each user casts what it reads (a differentiable ``.to``,
so the gradients reach the fp32 params in fp32), except the tensors listed in ``keep`` (params
a family keeps in fp32, e.g. the MoE router).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["active_cast", "cast_params_at_use"]

# (compute dtype, ids of the param tensors that keep their dtype) while cast_params_at_use is active
_CAST_AT_USE: contextvars.ContextVar[tuple[torch.dtype, frozenset[int]] | None] = contextvars.ContextVar("mff_cast_at_use", default=None)


@contextlib.contextmanager
def cast_params_at_use(dtype: torch.dtype, keep: frozenset[int] = frozenset()) -> Iterator[None]:
    """While active, :func:`mff.nn.blocks.run_block` runs each block with its float params cast
    to ``dtype`` (a differentiable ``.to``: the gradients reach the original params in their
    own dtype) and :class:`mff.nn.layers.Embedding` casts the rows it looks up, except for the
    tensors whose ``id`` is in ``keep`` (params a family keeps in fp32, e.g. the router). The
    cast of a checkpointed block is redone in its backward, so it need not be active then.
    Raises TypeError for a ``dtype`` that is not a floating torch dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"cast_params_at_use: dtype {dtype!r}; expected a floating torch.dtype")
    token = _CAST_AT_USE.set((dtype, frozenset(keep)))
    try:
        yield
    finally:
        _CAST_AT_USE.reset(token)


def active_cast() -> tuple[torch.dtype, frozenset[int]] | None:
    """The :func:`cast_params_at_use` state ``(dtype, keep)``, or None when inactive. Under a
    dynamo trace (the compiled decode step traces the whole model) it reads as inactive:
    ``ContextVar.get`` is a graph break, and no compiled whole-model graph trains (training
    compiles each block separately, called from eager code)."""
    return None if torch.compiler.is_compiling() else _CAST_AT_USE.get()
