"""Ascend NPU fused ops (``torch_npu``), each behind a guard that takes its pure-torch twin where
the kernel's documented limits are not met.

Every entry is written against the signature and limits torch_npu documents (the Ascend
Extension for PyTorch 6.0/7.0 API reference, torch_npu 2.1 to 2.6; later releases are assumed to
keep them, unverified: the guards also read the installed signature where it changed, as
``npu_rotary_mul``'s ``rotary_mode``) and has a twin in :mod:`mff.backend` it must equal. The guard checks shape, dtype and layout before the call; when a limit is not met the
twin computes the result instead and the reason is printed once per op and reason on stderr
(``mff: <op> takes the torch twin on this NPU: <reason>``), never a wrong result.

``MFF_NPU_FUSED`` chooses which entries use the kernel: ``1`` or ``all`` (default) every one,
``0`` or ``none`` none (bisecting a numerics difference), or a comma list of op names
(``rms_norm,swiglu``).

None of this has run on an NPU in this project: the contracts are checked in CPU CI through a
stand-in module (``tests/npu_standin.py``) that raises where the documented kernel would and
computes with independent reference math. On a machine with an NPU, ``python scripts/npu_check.py``
runs the same parity tests against the real kernels first.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import weakref
from collections.abc import Callable, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["NPU_OPS", "fused_ops_wanted", "Fallbacks", "fallbacks", "npu_kernels", "swiglu_torch", "moe_permute_torch",
           "moe_unpermute_torch", "rotary_modes", "TensorMemo"]

NPU_OPS = ("rms_norm", "grouped_mm", "swiglu", "attention", "rope", "moe_permute")
"""The op-table entries that have a torch_npu kernel (``moe_permute`` covers the permute and the
unpermute of the token slots)."""

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def swiglu_torch(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on gate-first halves: ``silu(x[..., :F]) * x[..., F:]`` for x [..., 2F]; returns
    [..., F] in x's dtype (Shazeer 2020, "GLU Variants Improve Transformer"; the fused
    ``gate_up`` layout of HF ``Glm4MLP`` and of mff's stacked experts)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def moe_permute_torch(x_ND: torch.Tensor, idx_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token slots sorted by expert: slot ``n*K + k`` (token n's k-th choice) goes to row
    ``sorted_indices[n*K + k]`` of the result, rows ordered by expert id and, within an expert,
    by slot (a stable sort). Returns ``(x [N*K, D] in x's dtype, sorted_indices int64 [N*K])``:
    the contract of ``torch_npu.npu_moe_token_permute`` (its ``argsort(argsort(flatten(indices)))``)."""
    K = idx_NK.shape[1] if idx_NK.dim() == 2 else 1
    order = torch.argsort(idx_NK.reshape(-1), stable=True)
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(order.numel(), device=order.device)
    return x_ND[order // K], sorted_indices


def moe_unpermute_torch(y_SD: torch.Tensor, sorted_indices: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`moe_permute_torch` with the gate weights: ``out[n] = sum_k w[n, k] *
    y[sorted_indices[n*K + k]]``. y [N*K, D], w [N, K]; returns [N, D] in the promoted dtype of
    y and w (fp32 for mff's fp32 gate weights)."""
    N, K = w_NK.shape
    return (y_SD[sorted_indices].view(N, K, -1) * w_NK[..., None]).sum(1)


class TensorMemo:
    """One remembered value per tensor object, for host-side facts about a tensor that every layer of a
    forward receives (the attention mask, the cos table): computed once (one host sync), reused while
    that very tensor is alive and unchanged (a weak reference and its version counter; a new
    tensor at the same address is not mistaken for the old)."""

    def __init__(self):
        self._ref: weakref.ref | None = None
        self._version = -1
        self._value = None

    def get(self, t: torch.Tensor, compute: Callable[[torch.Tensor], object]):
        if t.is_inference():  # no version counter to tell an in-place change: computed each time
            return compute(t)
        if self._ref is not None and self._ref() is t and self._version == t._version:
            return self._value
        value = compute(t)
        self._ref, self._version, self._value = weakref.ref(t), t._version, value
        return value


def rotary_modes(torch_npu: ModuleType) -> bool:
    """Whether the installed ``torch_npu.npu_rotary_mul`` takes ``rotary_mode`` (half and interleave;
    any even D below 896), read from its Python signature or its registered schema. Without it
    (torch_npu of the Ascend Extension 6.0 line and older) the kernel rotates half only and D must
    be 128."""
    fn = getattr(torch_npu, "npu_rotary_mul", None)
    if fn is None:
        return False
    try:
        return "rotary_mode" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        pass
    try:
        return any(a.name == "rotary_mode" for a in torch.ops.npu.npu_rotary_mul.default._schema.arguments)
    except Exception:
        return False


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
        raise ValueError(f"MFF_NPU_FUSED={raw!r}: unknown op {', '.join(unknown)}; expected 1 (or all), 0 (or none) "
                         f"or a comma list of {', '.join(NPU_OPS)}")
    return frozenset(names)


class Fallbacks:
    """The (op, reason) pairs for which a guard took the twin, with how often.

    Each kind of reason is announced once on stderr: reasons that differ only in their numbers
    (a mask over 137 keys, then over 138 as decoding goes on) are one kind, announced with the
    first numbers seen; ``seen`` keeps every exact reason and its count.
    """

    def __init__(self):
        self.seen: dict[tuple[str, str], int] = {}
        self._announced: set[tuple[str, str]] = set()

    def take(self, op: str, reason: str) -> None:
        kind = (op, re.sub(r"\d+", "#", reason))
        if kind not in self._announced:
            print(f"mff: {op} takes the torch twin on this NPU: {reason}", file=sys.stderr, flush=True)
            self._announced.add(kind)
        self.seen[(op, reason)] = self.seen.get((op, reason), 0) + 1

    def clear(self) -> None:
        self.seen.clear()
        self._announced.clear()


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

    Returns ``{"rms_norm", "grouped_mm", "swiglu", "attention", "rope", "moe_permute",
    "moe_unpermute"}`` entries, each with the signature of its slot in :class:`mff.backend.OpTable`
    (``attention`` and ``rope`` also take the torch twin of :mod:`mff.nn` as their last argument).
    """
    from mff.backend.npu_attention import make_attention

    has_modes = rotary_modes(torch_npu)
    cos_in_range, sin_in_range = TensorMemo(), TensorMemo()

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

    @torch.compiler.disable  # host-side checks (the cos range, once per table); runs eagerly under torch.compile
    def rope(x_BTHD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, layout: str, twin: Callable) -> torch.Tensor:
        """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode="half"|"interleave")``: ``r1 * x +
        r2 * rotate(x)``, rotate = ``cat(-x2, x1)`` of the halves (half) or ``(-x_odd, x_even)``
        written back in pairs (interleave). x [B, S, N, D] (BSND), r1/r2 [B or 1, S, 1, D].

        Limits (Ascend Extension for PyTorch 7.0 reference): 4-D; float16/bfloat16/float32; D even
        and below 896; B and N below 1000 (half), B * N below 1000 (interleave); r1/r2 within
        [-1, 1] (a YaRN attention factor above 1 scales cos/sin past it: the twin then). Older
        torch_npu (no ``rotary_mode``, 6.0 line): half only, D = 128, r1/r2 with batch 1.

        mff's layouts: ``half`` is the half mode; DeepSeek's ``interleave`` (pairs in, halves out)
        is the half mode on the input de-interleaved (evens then odds, HF's
        ``apply_rotary_pos_emb_interleave``); ``pairs`` (GLM-4-0414, pairs in and out) is the
        interleave mode with each frequency's cos/sin repeated for its pair. Partial rotary:
        only the first R = cos.shape[-1] dims go to the kernel; dims R..D are copied through."""
        if layout not in ("half", "interleave", "pairs"):
            return twin(x_BTHD, cos_BTR, sin_BTR, layout)
        R, D = cos_BTR.shape[-1], x_BTHD.shape[-1]
        reason = _dtype_reason(x_BTHD, cos_BTR, sin_BTR)
        if reason is None and (x_BTHD.dim() != 4 or cos_BTR.dim() != 3 or tuple(cos_BTR.shape) != tuple(sin_BTR.shape)
                               or cos_BTR.shape[0] not in (1, x_BTHD.shape[0]) or cos_BTR.shape[1] != x_BTHD.shape[1]):
            reason = f"shapes x {tuple(x_BTHD.shape)}, cos {tuple(cos_BTR.shape)} (the kernel takes x [B, S, N, D], cos/sin [B or 1, S, D])"
        if reason is None and (R > D or R % 2 or R == 0):
            reason = f"rotary dim {R} of head dim {D}"
        if reason is None and x_BTHD.numel() == 0:
            reason = "an empty input"
        if reason is None:
            B, N = x_BTHD.shape[0], x_BTHD.shape[2]
            if has_modes:
                if R >= 896:
                    reason = f"rotary dim {R} (the kernel takes an even rotary dim below 896)"
                elif layout == "pairs" and B * N >= 1000:
                    reason = f"batch x heads {B} x {N} (interleave mode takes B * N below 1000)"
                elif B >= 1000 or N >= 1000:
                    reason = f"batch {B}, heads {N} (half mode takes each below 1000)"
            elif layout == "pairs":
                reason = "layout 'pairs' (this torch_npu's npu_rotary_mul has no rotary_mode, so no interleave mode)"
            elif R != 128:
                reason = f"rotary dim {R} (this torch_npu's npu_rotary_mul, without rotary_mode, takes 128 only)"
            elif cos_BTR.shape[0] != 1 and B != 1:
                reason = "per-row positions (this torch_npu's npu_rotary_mul takes cos/sin of batch 1 only)"
            elif B > 1000 or N > 1000:
                reason = f"batch {B}, heads {N} (the kernel takes each up to 1000)"
        if reason is None and not (cos_in_range.get(cos_BTR, _within_one) and sin_in_range.get(sin_BTR, _within_one)):
            reason = "cos/sin outside [-1, 1] (a YaRN attention factor above 1; the kernel takes [-1, 1])"
        if reason is not None:
            fallbacks.take("rope", reason)
            return twin(x_BTHD, cos_BTR, sin_BTR, layout)
        x_rot = x_BTHD[..., :R]
        if layout == "interleave":
            x_rot = x_rot.unflatten(-1, (R // 2, 2)).transpose(-1, -2).flatten(-2)
        x_rot = x_rot.contiguous()
        r1, r2 = cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2)
        if layout == "interleave":  # the twin rotates both halves by the first R/2 angles
            r1, r2 = r1[..., : R // 2].repeat(1, 1, 1, 2), r2[..., : R // 2].repeat(1, 1, 1, 2)
        if layout == "pairs":
            r1 = r1[..., : R // 2].repeat_interleave(2, dim=-1)
            r2 = r2[..., : R // 2].repeat_interleave(2, dim=-1)
            out = torch_npu.npu_rotary_mul(x_rot, r1, r2, rotary_mode="interleave")
        elif has_modes:
            out = torch_npu.npu_rotary_mul(x_rot, r1, r2, rotary_mode="half")
        else:
            out = torch_npu.npu_rotary_mul(x_rot, r1, r2)
        return out if R == D else torch.cat((out, x_BTHD[..., R:]), dim=-1)

    def moe_permute(x_ND: torch.Tensor, idx_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
        -> (permuted_tokens [N*K, D], sorted_indices int32 [N*K])``, the contract of
        :func:`moe_permute_torch` (a stable sort of the flattened expert ids). Limits (CANN
        ``aclnnMoeTokenPermute``): tokens float16/bfloat16/float32 2-D, indices int32/int64
        [N, K] with K at most 512, not empty."""
        reason = _dtype_reason(x_ND)
        if reason is None and (x_ND.dim() != 2 or idx_NK.dim() != 2 or idx_NK.shape[0] != x_ND.shape[0]):
            reason = f"shapes tokens {tuple(x_ND.shape)}, indices {tuple(idx_NK.shape)} (the kernel takes [N, D] and [N, K])"
        if reason is None and idx_NK.dtype not in (torch.int32, torch.int64):
            reason = f"indices dtype {idx_NK.dtype} (the kernel takes int32 or int64)"
        if reason is None and idx_NK.shape[1] > 512:
            reason = f"top-k {idx_NK.shape[1]} (the kernel takes at most 512)"
        if reason is None and x_ND.shape[0] == 0:
            reason = "no tokens"
        if reason is not None:
            fallbacks.take("moe_permute", reason)
            return moe_permute_torch(x_ND, idx_NK)
        return torch_npu.npu_moe_token_permute(x_ND, idx_NK)

    def moe_unpermute(y_SD: torch.Tensor, sorted_indices: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """``torch_npu.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode=False)
        -> [N, D]``: ``sum_k probs[n, k] * permuted_tokens[sorted_indices[n*K + k]]`` (the contract
        of :func:`moe_unpermute_torch`). The expert outputs are cast to the gate weights' dtype
        first (fp32 for mff: the combine stays in fp32, as on the twin path). Limits: one float
        dtype, sorted_indices int32 with N*K entries, at least one token."""
        y = y_SD.to(w_NK.dtype)
        reason = _dtype_reason(y, w_NK)
        if reason is None and (y.dim() != 2 or w_NK.dim() != 2 or y.shape[0] != w_NK.numel() or sorted_indices.numel() != y.shape[0]):
            reason = f"shapes tokens {tuple(y.shape)}, sorted indices {tuple(sorted_indices.shape)}, probs {tuple(w_NK.shape)}"
        if reason is None and y.shape[0] == 0:
            reason = "no tokens"
        if reason is not None:
            fallbacks.take("moe_permute", reason)
            return moe_unpermute_torch(y, sorted_indices.long(), w_NK)
        return torch_npu.npu_moe_token_unpermute(y, sorted_indices.to(torch.int32), probs=w_NK)

    return {"rms_norm": rms_norm, "grouped_mm": grouped_mm, "swiglu": swiglu, "attention": make_attention(torch_npu),
            "rope": rope, "moe_permute": moe_permute, "moe_unpermute": moe_unpermute}


def _within_one(t: torch.Tensor) -> bool:
    return t.numel() == 0 or bool(t.detach().abs().amax() <= 1)  # one host sync per distinct table
