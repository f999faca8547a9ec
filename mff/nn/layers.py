"""Parameter-holding leaf layers of the meta skeleton: Linear, Embedding, RMSNorm.

Each gathers its weights on use (:func:`mff.parallel.gather`), so the same layer runs on
DTensor params sharded on any mesh and on plain tensors. A weight split over the ``tp`` mesh
axis makes the layer tensor-parallel (Megatron-LM, :mod:`mff.parallel.tp`): a ``Linear``
whose weight rows (out features) are split is column-parallel, one whose columns (in
features) are split is row-parallel; an ``Embedding`` whose rows are split is vocab-parallel.
The weight's placement decides; model code does not change. The skeleton is built on the
meta device and holds no storage and no buffers; real tensors come in through
``torch.func.functional_call``.

Shape legend: B batch, T sequence, D input features, F output features, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import make_contiguous_strides_for

from mff.backend import ops
from mff.nn.cast import active_cast
from mff.nn.lora import add_low_rank, lora_input, slot_name
from mff.parallel.gather import gather
from mff.parallel.tp import TP_AXIS, chunk_range, copy_to_tp, reduce_from_tp, tp_shard

__all__ = ["Linear", "Embedding", "RMSNorm", "is_plain", "linear", "linears", "matvec_input", "threaded_matvec"]


def is_plain(t: torch.Tensor) -> bool:
    """True for an ordinary ``torch.Tensor`` or ``nn.Parameter``: not a DTensor or another tensor
    subclass, so its storage holds its data and views of it are plain strided views."""
    return type(t) in (torch.Tensor, nn.Parameter)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)``: ``x`` [..., D], ``weight`` [F, D] -> [..., F].

    Under ``torch.compile`` with at most 4 rows (decoding), written as a broadcast multiply and
    a sum over D, which the compiler fuses into one vectorised pass over the weight: a
    memory-bound mat-vec that streams the weight near the memory bandwidth, where the BLAS
    GEMM path for one row reaches about half of it on CPU; ``x`` goes through
    :func:`matvec_input` first. Eager code uses ``F.linear``, except
    for one fp32 row without grad on a CPU (no bias, or an fp32 [F] one), which runs as
    :func:`threaded_matvec` where that applies; not under ``torch.jit.trace`` or a Python
    dispatch mode (``make_fx``), which would record the weight's views with its strides fixed.
    """
    if torch.compiler.is_compiling():
        if x.numel() <= 4 * x.shape[-1]:
            y = (matvec_input(x).unsqueeze(-2) * weight).sum(-1)
            return y + bias if bias is not None else y
    elif (not torch.jit.is_tracing() and torch._C._len_torch_dispatch_stack() == 0  # tracers would fix the views' strides
          and not torch.is_grad_enabled() and x.device.type == "cpu" and x.numel() == x.shape[-1]
          and (bias is None or (is_plain(bias) and bias.dtype == x.dtype and bias.shape == weight.shape[:1]))):
        y = threaded_matvec(x, weight)
        if y is not None:
            return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


def matvec_input(x: torch.Tensor) -> torch.Tensor:
    """The input of a compiled mat-vec written as a broadcast multiply and a sum (``(x[..., None, :]
    * W).sum(-1)``), realised: under ``torch.compile`` without grad, a bf16 / fp16 ``x`` [..., D]
    goes through Inductor's ``prims.inductor_force_stride_order`` with row-major strides, which
    makes x a buffer that holds its values (an unrealised producer is written out once; a view
    of a buffer in row-major order, such as a column slice, is read in place; other views are
    copied). Otherwise Inductor inlines x's producer (an RMSNorm, SiLU * up) into the loop of
    each output row and recomputes it, dtype converts included, once per output: in bf16 that
    makes the mat-vec compute-bound.
    Used by :func:`linear` and the routed experts' decode path (:mod:`mff.nn.moe`). In-process
    A/B on 2 cores (2026-12-07, together with the C++ wrapper of :mod:`mff.generate`'s compiled
    step): compiled bf16 decode step -14% on qwen3_bench and -18% on deepseek3_bench, the same
    tokens. Returns ``x`` itself outside a trace, with grad, and in fp32 (whose producer has no
    converts and measured the same either way). Same shape, dtype and values as ``x``, for any
    strides; it may alias ``x`` (Inductor) or be a copy (the ``eager`` / ``aot_eager`` backends),
    so it is meant to be consumed at once, as :func:`linear` does, not written to.
    """
    if torch.compiler.is_compiling() and not torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.prims.inductor_force_stride_order(x, make_contiguous_strides_for(x.shape))
    return x


MATVEC_SPLIT_MIN = 1 << 17  # weight elements from which splitting a mat-vec over threads pays (measured on 2 cores)


def threaded_matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x W^T`` for one row ``x`` [..., D] (all leading dims 1) as ``P`` mat-vecs of ``F / P``
    outputs each, one per intra-op thread (``P = torch.get_num_threads()``), in one batched
    ``torch.bmm`` over views of ``weight`` [F, D] (no copy). The CPU BLAS runs a single mat-vec
    on one thread, at about half of the memory bandwidth two cores reach; the batch of P runs on
    P threads (measured on 2 cores, fp32: a 512 -> 1536 projection from 19.5 to 25.5 GB/s laid
    out as ``W^T``, a 1536 -> 512 one from 15.5 to 27.5 GB/s laid out as ``W``).

    Returns [..., F] (x's dtype), or None where the split does not apply: more than one row,
    not fp32, one thread, fewer than :data:`MATVEC_SPLIT_MIN` weight elements (or none), F not
    divisible by P, D not x's width, a tensor subclass or a sparse weight, or a weight whose rows or columns are not unit-stride (row-major
    ``W`` or the transposed view of a row-major ``W^T``, as :func:`mff.generate.decode_layout`
    lays them out). Each output is the same dot product as ``F.linear``'s, up to the BLAS's
    summation order. The device and grad mode are the caller's to check (:func:`linear` calls
    it on a CPU without grad; under grad the result is differentiable like ``F.linear``'s).
    """
    P = torch.get_num_threads()
    if (P < 2 or x.numel() != x.shape[-1] or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2
            or not is_plain(weight) or weight.layout != torch.strided
            or weight.numel() < max(MATVEC_SPLIT_MIN, 1) or weight.shape[1] != x.shape[-1]):
        return None
    F_out, D = weight.shape
    if F_out % P:
        return None
    n = F_out // P
    rows, cols = weight.stride()
    if rows == 1 and cols >= F_out:  # W^T row-major (leading dim cols): split its columns
        parts = weight.as_strided((P, D, n), (n, cols, 1), weight.storage_offset())
    elif cols == 1 and rows >= D:  # W row-major: split its rows, each block read transposed
        parts = weight.as_strided((P, D, n), (n * rows, 1, rows), weight.storage_offset())
    else:
        return None
    y = torch.bmm(x.reshape(1, 1, D).expand(P, 1, D), parts)  # [P, 1, F/P]: thread p's outputs
    return y.view(*x.shape[:-1], F_out)


def _side_by_side(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One view over ``tensors`` joined along dim 0 (the [F_i, D] weights, or the [F_i]
    biases) when they already lie side by side in one storage, as
    :func:`mff.generate.decode_layout` lays them out: same storage, plain tensors that need no
    grad, consecutive offsets, equal strides. None otherwise (the caller runs them one by one)."""
    if any(t is None or not is_plain(t) or t.requires_grad for t in tensors):
        return None
    first = tensors[0]
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.stride() != first.stride() or t.shape[1:] != first.shape[1:] or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != ptr):
            return None
        offset += t.shape[0] * first.stride(0)
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride(), first.storage_offset())


def linears(x_BTD: torch.Tensor, layers: list[Linear]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` for layers that read the same input (attention's
    q/k/v, the MLP's gate/up), as one matmul when their weights (and biases, if any) lie side by
    side in one storage: :func:`mff.generate.decode_layout` stores them so for eager decoding,
    where one wider mat-vec replaces several narrow ones (fewer BLAS calls and op dispatches per
    token). Each output is a [..., F_i] view of the joint [..., sum F_i] result, equal to the
    layer's own output. Layers with split (DTensor) weights, LoRA slots or weights laid out any
    other way, and any call under a dynamo trace (the compiler fuses on its own), run one by one.
    """
    if torch.compiler.is_compiling() or any(slot_name("weight") in m.__dict__["_modules"] for m in layers):
        return [m(x_BTD) for m in layers]
    w = _side_by_side([m.weight for m in layers])
    if w is None:
        return [m(x_BTD) for m in layers]
    b = None
    if any(m.bias is not None for m in layers):
        b = _side_by_side([m.bias for m in layers])  # None also when only some have a bias
        if b is None:
            return [m(x_BTD) for m in layers]
    return list(linear(x_BTD, w, b).split([m.weight.shape[0] for m in layers], dim=-1))


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``weight`` [F, D] (the HF/PyTorch layout), optional ``bias`` [F].

    Tensor parallelism, from the weight's placement on the ``tp`` axis:

    - ``Shard(0)`` (column-parallel): ``x`` [..., D] is the same on every tp rank; the output
      [..., F / tp] holds this rank's features; the bias must be split like them.
    - ``Shard(1)`` (row-parallel): ``x`` [..., D / tp] holds this rank's features; the partial
      products are all-reduced over tp into the full [..., F]; the bias (replicated over tp)
      is added once, after the sum.

    LoRA (:mod:`mff.nn.lora`), when the skeleton gave the weight a ``lora_weight`` slot: ``+ s
    (x A^T) B^T``. Column-parallel: ``A`` whole, ``B`` split by rows like the weight, the rank-r
    activations' gradient summed over tp. Row-parallel: ``A`` split by columns like the weight,
    its rank-r partial products all-reduced (r numbers per token), ``B`` whole.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        split = tp_shard(self.weight)
        lora = self.__dict__["_modules"].get(slot_name("weight"))
        if split is None:
            b = gather(self.bias) if self.bias is not None else None
            y = linear(x_BTD, gather(self.weight), b)
            if lora is not None:
                y = add_low_rank(y, F.linear(lora_input(x_BTD, lora), gather(lora.A)), gather(lora.B), lora.scale)
            return y
        w = gather(self.weight, keep=(TP_AXIS,))
        if split.dim == 0:
            b = gather(self.bias, keep=(TP_AXIS,)) if self.bias is not None else None
            y = linear(copy_to_tp(x_BTD, split.group), w, b)
            if lora is not None:  # A whole on every rank, B split like the weight's rows
                z = copy_to_tp(F.linear(lora_input(x_BTD, lora), gather(lora.A)), split.group)
                y = add_low_rank(y, z, gather(lora.B, keep=(TP_AXIS,)), lora.scale)
            return y
        y = linear(x_BTD, w)
        if lora is not None:  # A split like the weight's columns, B whole: the rank-r partial sums are all-reduced
            z = reduce_from_tp(F.linear(lora_input(x_BTD, lora), gather(lora.A, keep=(TP_AXIS,))), split.group)
        y = reduce_from_tp(y, split.group)
        if lora is not None:
            y = add_low_rank(y, z, gather(lora.B), lora.scale)
        return y + gather(self.bias) if self.bias is not None else y


class Embedding(nn.Module):
    """Token embedding lookup; ``weight`` [V, D]. ``ids`` int64 [B, T] -> [B, T, D], in the
    weight's dtype, or in the compute dtype while :func:`mff.nn.cast.cast_params_at_use` is
    active (the looked-up rows are cast, not the table: ``bf16-mixed`` training passes the fp32
    table when gathering it moves no data, :func:`mff.train.precision.forward_params`).

    Vocab-parallel when the rows are split over ``tp`` (Megatron's ``VocabParallelEmbedding``):
    each rank looks up the ids in its row range (:func:`mff.parallel.tp.chunk_range`), writes
    zeros for the others, and the partial results are all-reduced over tp.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        cast = active_cast()
        dtype = cast[0] if cast is not None and self.weight.is_floating_point() and id(self.weight) not in cast[1] else None
        split = tp_shard(self.weight)
        if split is None or split.dim != 0:
            h = F.embedding(ids_BT, gather(self.weight))
            return h if dtype is None else h.to(dtype)
        w = gather(self.weight, keep=(TP_AXIS,))
        start, stop = chunk_range(self.weight.shape[0], split.rank, split.size)
        mine = (ids_BT >= start) & (ids_BT < stop)
        local = torch.where(mine, ids_BT - start, 0)
        h = F.embedding(local, w) * mine.unsqueeze(-1).to(w.dtype)
        return reduce_from_tp(h if dtype is None else h.to(dtype), split.group)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with HF transformers' numerics: fp32 statistics, the
    normalised input cast back to the input dtype before the ``weight`` [D] scale.

    ``forward(x, tp_group=None)``: ``tp_group`` names the tensor-parallel group when ``x`` holds
    only this rank's part of the normalised units (the per-head q/k norms of a tensor-parallel
    attention: each rank scales its own heads by the same replicated weight), so the weight's
    gradient is summed over the group (Megatron all-reduces these layernorm grads over tp).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, tp_group=None) -> torch.Tensor:
        return ops.rms_norm(x, copy_to_tp(gather(self.weight), tp_group), self.eps)
