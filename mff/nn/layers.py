"""Parameter-holding leaf layers of the meta skeleton: Linear, Embedding, RMSNorm.

Each gathers its weights on use (:func:`mff.parallel.gather`), so the same layer runs on
DTensor params sharded on any mesh and on plain tensors. The skeleton is built on the meta
device and holds no storage and no buffers; real tensors come in through
``torch.func.functional_call``.

Shape legend: B batch, T sequence, D input features, F output features, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mff.backend import ops
from mff.parallel.gather import gather

__all__ = ["Linear", "Embedding", "RMSNorm", "linear"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)``: ``x`` [..., D], ``weight`` [F, D] -> [..., F].

    Under ``torch.compile`` with at most 4 rows (decoding), written as a broadcast multiply and
    a sum over D, which the compiler fuses into one vectorised pass over the weight: a
    memory-bound mat-vec that streams the weight near the memory bandwidth, where the BLAS
    GEMM path for one row reaches about half of it on CPU. Eager code always uses ``F.linear``.
    """
    if torch.compiler.is_compiling() and x.numel() <= 4 * x.shape[-1]:
        y = (x.unsqueeze(-2) * weight).sum(-1)
        return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``weight`` [F, D] (the HF/PyTorch layout), optional ``bias`` [F]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        b = gather(self.bias) if self.bias is not None else None
        return linear(x_BTD, gather(self.weight), b)


class Embedding(nn.Module):
    """Token embedding lookup; ``weight`` [V, D]. ``ids`` int64 [B, T] -> [B, T, D]."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids_BT, gather(self.weight))


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with HF transformers' numerics: fp32 statistics, the
    normalised input cast back to the input dtype before the ``weight`` [D] scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, gather(self.weight), self.eps)
