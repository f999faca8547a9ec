"""The grouped expert GEMM as torch custom ops, so that ``torch.compile`` keeps an MoE block in
one graph.

Eagerly, the routed experts call ``mff.backend.ops.grouped_mm(x, w, counts)`` with the group
sizes as a Python list (one host sync per layer). Under ``torch.compile`` that list would be a
graph break, and ``torch._grouped_mm`` has no fake-tensor rule for fp32 on CPU (torch 2.13),
so the compiled path calls these ops instead: the group sizes stay a tensor, the output shape
is known from the input shapes alone (the fake rule), and the kernel inside is the same
``ops.grouped_mm`` the eager path runs (``torch._grouped_mm``, the per-expert loop, or
``npu_grouped_matmul``), opaque to the compiler. This is torchtitan's and Megatron's approach
for their grouped GEMMs (a registered op with a meta rule), written here against
``torch.library.custom_op`` (torch >= 2.4).

- ``mff::grouped_mm(x [N, D], w [E, D, F], counts [E] int64) -> [N, F]``: rows
  ``sum(counts[:e]) .. sum(counts[:e+1])`` of ``x`` times ``w[e]``;
- ``mff::grouped_mm_weight_grad(x [N, D], grad [N, F], counts [E] int64) -> [E, D, F]``: per
  expert ``x_e^T grad_e`` (zeros for an expert with no rows), its backward for ``w``.

``counts`` must hold E non-negative ints summing to N (ValueError otherwise). The backward of ``grouped_mm``
is ``grad_x = grouped_mm(grad, w^T, counts)`` and ``grad_w = grouped_mm_weight_grad(x, grad,
counts)``; both are ops too, so the compiled backward graph holds them whole and selective
activation checkpointing can save their outputs (:mod:`mff.nn.blocks`).
"""

from __future__ import annotations

import torch

from mff.backend import check_group_counts, is_transposed_stack, ops

__all__ = ["grouped_mm", "grouped_mm_weight_grad"]


@torch.library.custom_op("mff::grouped_mm", mutates_args=())
def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``[N, F]``: each group of rows of ``x_ND`` (sizes ``counts_E``) times its expert's ``w_EDF[e]``."""
    counts = counts_E.tolist()
    check_group_counts(counts, x_ND.shape[0], w_EDF.shape[0])
    return ops.grouped_mm(x_ND, w_EDF, counts)  # a new tensor (torch._grouped_mm, or torch.cat of the groups)


@grouped_mm.register_fake
def _(x_ND, w_EDF, counts_E):
    return x_ND.new_empty(x_ND.shape[0], w_EDF.shape[-1])


@torch.library.custom_op("mff::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x_ND: torch.Tensor, grad_NF: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``[E, D, F]``: ``x_e^T grad_e`` for each expert's rows (zeros where an expert has none)."""
    E = counts_E.shape[0]
    counts = counts_E.tolist()
    check_group_counts(counts, x_ND.shape[0], E)
    out = x_ND.new_zeros(E, x_ND.shape[1], grad_NF.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[e] = x_ND[start:start + n].t() @ grad_NF[start:start + n]
        start += n
    return out


@grouped_mm_weight_grad.register_fake
def _(x_ND, grad_NF, counts_E):
    return x_ND.new_empty(counts_E.shape[0], x_ND.shape[1], grad_NF.shape[1])


def _setup_context(ctx, inputs, output):
    x_ND, w_EDF, counts_E = inputs
    ctx.save_for_backward(x_ND, w_EDF, counts_E)


def _backward(ctx, grad_NF):
    x_ND, w_EDF, counts_E = ctx.saved_tensors
    grad_NF = grad_NF.contiguous()
    grad_x = grouped_mm(grad_NF, w_EDF.transpose(1, 2), counts_E) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        # in w's own layout: the experts pass transposed views of [E, out, in] stacks, whose
        # param grad should come out contiguous like the param (as the eager path's does)
        if is_transposed_stack(w_EDF):
            grad_w = grouped_mm_weight_grad(grad_NF, x_ND, counts_E).transpose(1, 2)  # [E, F, D] -> [E, D, F] view
        else:
            grad_w = grouped_mm_weight_grad(x_ND, grad_NF, counts_E)
        grad_w = grad_w.to(w_EDF.dtype)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
