"""Ascend NPU fused ops (``torch_npu``), each behind a guard that takes its pure-torch twin where
the kernel's documented limits are not met.

Every entry is written against the signature and limits torch_npu documents (the Ascend
"torch_npu API" reference, versions 2.1-2.6) and has a twin in :mod:`mff.backend` it must
equal. The guard checks shape, dtype and layout before the call; when a limit is not met the
twin computes the result instead and the reason is printed once per op and reason on stderr
(``mff: <op> takes the torch twin on this NPU: <reason>``), never a wrong result.

``MFF_NPU_FUSED`` chooses which entries use the kernel: ``1`` (default) every one, ``0`` none
(bisecting a numerics difference), or a comma list of op names (``rms_norm,swiglu``).

None of this has run on an NPU in this project: the contracts are checked in CPU CI through a
stand-in module (``tests/npu_standin.py``) that raises where the documented kernel would and
computes with independent reference math. A checklist script that runs the parity tests on a real
device is still to be written (issue 16).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["NPU_OPS", "fused_ops_wanted", "Fallbacks", "fallbacks", "npu_kernels", "swiglu_torch"]

NPU_OPS = ("rms_norm", "grouped_mm", "swiglu")
"""The op-table entries that have a torch_npu kernel."""

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def swiglu_torch(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on gate-first halves: ``silu(x[..., :F]) * x[..., F:]`` for x [..., 2F]; returns
    [..., F] in x's dtype (Shazeer 2020, "GLU Variants Improve Transformer"; the fused
    ``gate_up`` layout of HF ``Glm4MLP`` and of mff's stacked experts)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_ops_wanted(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The entries of :data:`NPU_OPS` that should use their kernel, from ``MFF_NPU_FUSED``.

    Raises:
        ValueError: a value that is not ``0``, ``1`` or a comma list of :data:`NPU_OPS` names.
    """
    raw = (os.environ if env is None else env).get("MFF_NPU_FUSED", "1").strip()
    if raw in ("", "1", "all"):
        return frozenset(NPU_OPS)
    if raw in ("0", "none"):
        return frozenset()
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(NPU_OPS))
    if unknown:
        raise ValueError(f"MFF_NPU_FUSED={raw!r}: unknown op {', '.join(unknown)}; expected 0, 1 or a comma list of "
                         f"{', '.join(NPU_OPS)}")
    return frozenset(names)


class Fallbacks:
    """The (op, reason) pairs for which a guard took the twin; each is announced once on stderr."""

    def __init__(self):
        self.seen: dict[tuple[str, str], int] = {}

    def take(self, op: str, reason: str) -> None:
        key = (op, reason)
        if key not in self.seen:
            print(f"mff: {op} takes the torch twin on this NPU: {reason}", file=sys.stderr, flush=True)
            self.seen[key] = 0
        self.seen[key] += 1

    def clear(self) -> None:
        self.seen.clear()


fallbacks = Fallbacks()
"""Every fallback taken in this process (tests read ``fallbacks.seen``)."""


def _dtype_reason(*tensors: torch.Tensor) -> str | None:
    for t in tensors:
        if t.dtype not in _FLOAT:
            return f"dtype {t.dtype} (the kernel takes float16, bfloat16 or float32)"
    if len({t.dtype for t in tensors}) > 1:
        return f"mixed dtypes {', '.join(str(t.dtype) for t in tensors)} (the kernel takes one dtype)"
    return None


def npu_kernels(torch_npu: ModuleType, rms_norm_twin: Callable, grouped_mm_twin: Callable) -> dict[str, Callable]:
    """The guarded NPU entries over the module ``torch_npu`` (the real one, or a stand-in).

    Returns ``{"rms_norm": f, "grouped_mm": f, "swiglu": f}``, each with the signature of its
    twin in :class:`mff.backend.OpTable`.
    """

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: y = x / sqrt(mean(x^2) + eps) * gamma,
        statistics in fp32. Limits: float16/bfloat16/float32, gamma of x's dtype and of the
        shape of x's last dim, x not empty. The twin (HF ``LlamaRMSNorm``) rounds the normalised
        x to x's dtype before the scale; in float32 both are the same."""
        reason = _dtype_reason(x, weight)
        if reason is None and tuple(weight.shape) != tuple(x.shape[-1:]):
            reason = f"gamma shape {tuple(weight.shape)} is not x's last dim {tuple(x.shape[-1:])}"
        if reason is None and x.numel() == 0:
            reason = "an empty input"
        if reason is not None:
            fallbacks.take("rms_norm", reason)
            return rms_norm_twin(x, weight, eps)
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def grouped_mm(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``torch_npu.npu_grouped_matmul(x=[x], weight=[w], group_list, split_item=2, group_type=0,
        group_list_type=1)[0]``: rows of x split along M by ``group_list`` (type 1: a count per
        group, int64, length E, summing to M) each times its group's weight [K, N]; w is mff's
        [E, out, in] expert stack passed as the transposed view [E, in, out]. Limits: 2-D x,
        3-D w, one dtype of float16/bfloat16/float32, at least one row (the kernel rejects
        empty inputs: a rank whose experts got no token takes the twin)."""
        reason = _dtype_reason(x_ND, w_EDF)
        if reason is None and (x_ND.dim() != 2 or w_EDF.dim() != 3 or x_ND.shape[1] != w_EDF.shape[1]):
            reason = f"shapes x {tuple(x_ND.shape)}, w {tuple(w_EDF.shape)} (the kernel takes [M, K] and [E, K, N])"
        if reason is None and (len(counts) != w_EDF.shape[0] or sum(counts) != x_ND.shape[0]):
            reason = f"group counts {counts} do not split {x_ND.shape[0]} rows over {w_EDF.shape[0]} experts"
        if reason is None and x_ND.shape[0] == 0:
            reason = "no rows"
        if reason is not None:
            fallbacks.take("grouped_mm", reason)
            return grouped_mm_twin(x_ND, w_EDF, counts)
        group_list = torch.tensor(counts, device=x_ND.device, dtype=torch.int64)
        return torch_npu.npu_grouped_matmul([x_ND], [w_EDF], group_list=group_list, split_item=2, group_type=0,
                                            group_list_type=1)[0]

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        """``torch_npu.npu_swiglu(input, dim=-1)``: swish(A) * B with A, B the first and second halves
        of ``dim``. Limits: 1-8 dims, an even last dim (odd is an error on both paths), contiguous, not empty,
        float16/bfloat16/float32 (Atlas A2 and later)."""
        reason = _dtype_reason(x)
        if reason is None and not 1 <= x.dim() <= 8:
            reason = f"{x.dim()} dims (the kernel takes 1 to 8)"
        if reason is None and not x.is_contiguous():
            reason = "a non-contiguous input"
        if reason is None and x.numel() == 0:
            reason = "an empty input"
        if reason is not None:
            fallbacks.take("swiglu", reason)
            return swiglu_torch(x)
        return torch_npu.npu_swiglu(x, dim=-1)

    return {"rms_norm": rms_norm, "grouped_mm": grouped_mm, "swiglu": swiglu}
