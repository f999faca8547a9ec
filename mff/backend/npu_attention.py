"""Attention through ``torch_npu.npu_fusion_attention`` (the Ascend flash-attention kernel), behind a
guard that takes mff's torch attention where the kernel's documented limits are not met.

Which call a mask becomes (masks are mff's: bool [B, 1, T, S], True = may attend; see
:mod:`mff.nn.attention`):

- no mask (plain causal, T == S): layout ``BSND``, ``sparse_mode=3`` (causal, aligned bottom-right)
  with the compressed 2048 x 2048 upper-triangle mask (True = masked) the kernel requires there;
- a packed-document mask (block-diagonal causal, every query row sees keys from its document's
  first token to itself): layout ``TND`` over the B*T tokens, ``sparse_mode=3`` and
  ``actual_seq_qlen = actual_seq_kvlen`` = the cumulative end offset of each document, the B
  rows one after another (so the last is B*T). Read from the mask once per mask tensor (one
  host sync per forward, remembered across layers);
- any other mask (left padding, the KV-cache decode, a mask from research code): ``BSND``,
  ``sparse_mode=0`` and the mask itself, inverted (True = masked), of shape [B or 1, 1, T, S].
  Query rows that see no key (padding positions) are given all keys for the kernel and set to 0
  after, as on the torch path.

GQA / MQA: K/V keep their N2 heads (no repeat); the kernel needs N2 to divide N1. MLA: value heads
narrower than the query/key heads are zero-padded to the query width (the kernel takes one head
dim for Q, K and V) and cut back after, as mff does for SDPA.

Limits (Ascend Extension for PyTorch 6.0/7.0 reference and MindSpore's ``speed_fusion_attention``):
float16/bfloat16/float32, one dtype; head dim a multiple of 16 and at most 512; N1 at most 256 and
a multiple of N2; batch at most 2048. Not met: the torch attention, announced once per reason.
Not run on an NPU in this project (CPU CI checks the contract with ``tests/npu_standin.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from mff.backend.npu import TensorMemo, _dtype_reason, fallbacks

__all__ = ["make_attention", "packed_document_ends", "compressed_causal_mask"]

_COMPRESSED = 2048
_causal_masks: dict[torch.device, torch.Tensor] = {}


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048 x 2048 bool upper triangle (True above the diagonal = masked) that
    ``npu_fusion_attention`` takes for ``sparse_mode`` 2, 3 and 4, made once per device."""
    m = _causal_masks.get(device)
    if m is None:
        m = _causal_masks[device] = torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device).triu(1)
    return m


def packed_document_ends(mask_B1TT: torch.Tensor) -> list[int] | None:
    """The cumulative end offsets of the documents of a packed-document causal mask, the B rows
    concatenated (``[3, 8, 10, 16]`` for rows of 8 tokens holding documents of 3+5 and 2+6), or
    None when the mask is not one: every query row t must see exactly the keys
    ``start(t) .. t`` of one contiguous document (``start(t)`` is ``start(t-1)`` or t itself).
    One host sync.

    Shapes: bool [B, 1, T, T] (True = may attend). Returns a list of B*T-bounded ints or None."""
    if mask_B1TT.dim() != 4 or mask_B1TT.shape[1] != 1 or mask_B1TT.shape[2] != mask_B1TT.shape[3]:
        return None
    m = mask_B1TT[:, 0]
    B, T, _ = m.shape
    t = torch.arange(T, device=m.device)
    first = m.to(torch.uint8).argmax(-1)  # [B, T]: first visible key of each query row
    prev = torch.cat((first[:, :1], first[:, :-1]), dim=1)
    expected = (t[None, None, :] >= first[:, :, None]) & (t[None, None, :] <= t[None, :, None])
    ok = m.any(-1).all() & ((first == t) | (first == prev)).all() & (m == expected).all()
    if not bool(ok):
        return None
    starts = first == t  # [B, T]: a document begins here
    is_end = torch.cat((starts[:, 1:], torch.ones(B, 1, dtype=torch.bool, device=m.device)), dim=1)
    return (torch.nonzero(is_end.reshape(-1)).squeeze(1) + 1).tolist()


def make_attention(torch_npu: ModuleType) -> Callable:
    """The guarded attention entry over ``torch_npu`` (the real module or a stand-in):
    ``attention(q [B, T, H, D], k [B, S, K, D], v [B, S, K, E], scale, mask [B, 1, T, S] | None,
    twin) -> [B, T, H, E]``, ``twin`` being mff's torch attention with the same arguments but the last."""
    documents = TensorMemo()

    @torch.compiler.disable  # host-side mask analysis (one sync per mask); runs eagerly under torch.compile
    def attention(q_BTHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKE: torch.Tensor, scale: float,
                  mask_B1TS: torch.Tensor | None, twin: Callable) -> torch.Tensor:
        B, T, H, D = q_BTHD.shape
        S, K, E = k_BSKD.shape[1], k_BSKD.shape[2], v_BSKE.shape[-1]
        reason = _dtype_reason(q_BTHD, k_BSKD, v_BSKE)
        if reason is None and (D % 16 or D > 512):
            reason = f"head dim {D} (the kernel takes a multiple of 16 up to 512)"
        if reason is None and E > D:
            reason = f"value head dim {E} above the query/key head dim {D}"
        if reason is None and (H > 256 or H % K):
            reason = f"{H} query heads over {K} KV heads (the kernel takes at most 256, a multiple of the KV heads)"
        if reason is None and q_BTHD.numel() * k_BSKD.numel() == 0:
            reason = "an empty input"
        if reason is None and B > 2048:
            reason = f"batch {B} (the kernel takes at most 2048)"
        if reason is None and mask_B1TS is None and T != S:
            reason = f"a causal call of {T} queries over {S} keys without a mask"
        if reason is None and mask_B1TS is not None and (
                mask_B1TS.dtype != torch.bool or mask_B1TS.dim() != 4 or mask_B1TS.shape[0] not in (1, B)
                or mask_B1TS.shape[1] != 1 or tuple(mask_B1TS.shape[2:]) != (T, S)):
            reason = (f"mask {mask_B1TS.dtype} {tuple(mask_B1TS.shape)} (the kernel takes a bool mask "
                      f"[{B} or 1, 1, {T}, {S}] here)")
        if reason is not None:
            fallbacks.take("attention", reason)
            return twin(q_BTHD, k_BSKD, v_BSKE, scale, mask_B1TS)
        v = F.pad(v_BSKE, (0, D - E)) if E < D else v_BSKE
        if mask_B1TS is None:
            o = torch_npu.npu_fusion_attention(q_BTHD, k_BSKD, v, H, "BSND", atten_mask=compressed_causal_mask(q_BTHD.device),
                                               scale=scale, sparse_mode=3)[0]
            return o[..., :E]
        ends = documents.get(mask_B1TS, packed_document_ends) if T == S and mask_B1TS.shape[0] == B else None
        if ends is not None:
            o = torch_npu.npu_fusion_attention(
                q_BTHD.reshape(B * T, H, D), k_BSKD.reshape(B * S, K, D), v.reshape(B * S, K, D), H, "TND",
                atten_mask=compressed_causal_mask(q_BTHD.device), scale=scale, sparse_mode=3,
                actual_seq_qlen=ends, actual_seq_kvlen=ends)[0]
            return o.view(B, T, H, D)[..., :E]
        empty = ~mask_B1TS.any(-1, keepdim=True)  # [B, 1, T, 1]: query rows that see no key
        o = torch_npu.npu_fusion_attention(q_BTHD, k_BSKD, v, H, "BSND", atten_mask=~(mask_B1TS | empty), scale=scale,
                                           sparse_mode=0)[0]
        return o[..., :E].masked_fill(empty[:, 0, :, :, None], 0.0)

    return attention
