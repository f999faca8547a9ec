"""Rotary position embeddings (RoPE, Su et al. 2021) with default and YaRN frequencies.

Numerics follow HF transformers (``modeling_rope_utils._compute_yarn_parameters``,
``_compute_llama3_parameters`` and the DeepSeek-V3 / GLM-4 rotary code): inverse frequencies in
fp32; angles ``position * inv_freq`` in fp32; cos/sin scaled by the YaRN attention factor and cast
to the activation dtype. Three pair layouts (``apply_rope(layout=...)``):

- ``"half"``: pairs ``(x_j, x_{j+R/2})`` (Llama, Qwen, GLM-4.5; HF ``rotate_half``);
- ``"interleave"``: DeepSeek's layout, adjacent pairs ``(x0, x1), (x2, x3), ...`` written back
  de-interleaved (evens then odds), as HF's ``apply_rotary_pos_emb_interleave`` does;
- ``"pairs"``: GLM-4-0414's layout, adjacent pairs rotated in place (HF ``models/glm4``).

Partial rotary (GLM-4): only the first ``rotary_dim = head_dim * partial_rotary_factor`` dims of
each head rotate; the rest pass through.

YaRN: Peng et al. 2023 (arXiv 2309.00071), sections 3.2-3.4; DeepSeek-V3's softmax-scale
correction ``mscale(factor, mscale_all_dim)^2`` (DeepSeek-V2 paper, appendix; HF
``yarn_apply_mscale``) is :func:`yarn_softmax_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from mff.backend import ops

__all__ = ["RopeParameters", "yarn_get_mscale", "rope_inv_freq", "rotary_dim", "yarn_softmax_scale", "rope_cos_sin", "apply_rope"]


@dataclass(frozen=True)
class RopeParameters:
    """HF v5 ``rope_parameters`` (v4: ``rope_theta`` + ``rope_scaling``)."""

    rope_type: Literal["default", "yarn", "llama3"] = "default"
    """Frequency scheme: default RoPE, YaRN, or Llama-3.1's band-wise scaling."""
    rope_theta: float = 10000.0
    """RoPE base."""
    factor: float = 1.0
    """YaRN context extension factor (s)."""
    beta_fast: float = 32.0
    """YaRN: rotations above which dims are extrapolated (alpha boundary)."""
    beta_slow: float = 1.0
    """YaRN: rotations below which dims are interpolated."""
    mscale: float = 1.0
    """YaRN: numerator mscale of the cos/sin attention factor; 0 = none (the factor is then
    ``mscale(factor)``, what HF computes for a config without ``mscale``)."""
    mscale_all_dim: float = 0.0
    """YaRN: denominator mscale of the cos/sin factor and the softmax-scale correction (0 = off)."""
    original_max_position_embeddings: int = 4096
    """YaRN: context length of pretraining."""
    attention_factor: float | None = None
    """YaRN: explicit cos/sin factor (None = derived from factor, mscale, mscale_all_dim)."""
    truncate: bool = True
    """YaRN: round the correction range to whole dims (HF default)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that rotate (GLM-4: 0.5); the rest pass through."""

    def validate(self) -> None:
        """Raise ValueError naming a bad field (theta, factor, betas, original length)."""
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"rope_parameters.rope_theta={self.rope_theta} must be a finite number > 1")
        if self.rope_type not in ("default", "yarn", "llama3"):
            raise ValueError(f"rope_parameters.rope_type={self.rope_type!r}; supported: 'default', 'yarn', 'llama3'")
        if not (0 < self.partial_rotary_factor <= 1):
            raise ValueError(f"rope_parameters.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.rope_type == "llama3":
            if not (math.isfinite(self.factor) and self.factor >= 1):
                raise ValueError(f"rope_parameters.factor={self.factor} must be >= 1 for llama3 RoPE")
            if not (0 < self.low_freq_factor < self.high_freq_factor):
                raise ValueError(f"rope_parameters.low_freq_factor={self.low_freq_factor} must be > 0 and below "
                                 f"high_freq_factor={self.high_freq_factor}")
        if self.rope_type == "yarn":
            if not (math.isfinite(self.factor) and self.factor >= 1):
                raise ValueError(f"rope_parameters.factor={self.factor} must be >= 1 for YaRN")
            if not (self.beta_fast > 0 and self.beta_slow > 0):
                raise ValueError(f"rope_parameters.beta_fast={self.beta_fast}, beta_slow={self.beta_slow} must be > 0")
            if self.original_max_position_embeddings < 1:
                raise ValueError(f"rope_parameters.original_max_position_embeddings={self.original_max_position_embeddings} must be >= 1")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` for scale > 1, else 1.0."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeParameters, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32, on CPU) and the cos/sin attention factor.

    Raises:
        ValueError: an odd ``dim``, or YaRN with factor < 1.
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    base = rope.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq), 1.0
    if rope.rope_type != "yarn":
        raise ValueError(f"rope_type {rope.rope_type!r}; expected 'default', 'yarn' or 'llama3'")
    factor = rope.factor
    if factor < 1:
        raise ValueError(f"YaRN factor {factor} must be >= 1")
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 = keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(rope: RopeParameters, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation between (Meta's reference; HF ``_compute_llama3_parameters``)."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_dim(rope: RopeParameters, head_dim: int) -> int:
    """Rotating dims per head: ``int(head_dim * partial_rotary_factor)`` (HF's rounding)."""
    return int(head_dim * rope.partial_rotary_factor)


def yarn_softmax_scale(rope: RopeParameters) -> float:
    """Multiplier of MLA's softmax scale ``qk_head_dim ** -0.5``: ``mscale(factor, mscale_all_dim)^2``
    under YaRN with ``mscale_all_dim`` set, else 1.0 (DeepSeek-V2/V3; HF ``yarn_apply_mscale``)."""
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


def rope_cos_sin(
    position_ids_BT: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, dim] (``cat(freqs, freqs)``), computed in fp32, scaled, cast to ``dtype``."""
    freqs = position_ids_BT[..., None].float() * inv_freq.to(position_ids_BT.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply_rope(
    x_BTHD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, interleave: bool = False, layout: str | None = None
) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by cos/sin [B, T, R] (broadcast over heads), R <= D.

    The first R dims of each head rotate and the remaining D - R pass through (partial rotary).
    ``layout``: ``"half"``, ``"interleave"`` or ``"pairs"`` (module docstring); the legacy
    ``interleave=True`` means ``"interleave"``. Raises ValueError for another layout or R > D.
    With an NPU op table, ``ops.rope`` (``torch_npu.npu_rotary_mul`` on the R rotating dims, this
    torch path where the kernel's limits are not met).
    """
    layout = layout or ("interleave" if interleave else "half")
    if ops.rope is not None:
        return ops.rope(x_BTHD, cos_BTR, sin_BTR, layout, _apply_rope_torch)
    return _apply_rope_torch(x_BTHD, cos_BTR, sin_BTR, layout)


def _apply_rope_torch(x_BTHD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, layout: str) -> torch.Tensor:
    R = cos_BTR.shape[-1]
    if R > x_BTHD.shape[-1]:
        raise ValueError(f"rotary dim {R} exceeds the head dim {x_BTHD.shape[-1]}")
    if R < x_BTHD.shape[-1]:
        x_rot, x_pass = x_BTHD[..., :R], x_BTHD[..., R:]
        return torch.cat((_apply_rope_torch(x_rot, cos_BTR, sin_BTR, layout), x_pass), dim=-1)
    x_BTHR = x_BTHD
    cos, sin = cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2)
    if layout == "pairs":
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    if layout == "interleave":
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if layout != "half":
        raise ValueError(f"rope layout {layout!r}; expected 'half', 'interleave' or 'pairs'")
    half = x_BTHR.shape[-1] // 2
    rotated = torch.cat((-x_BTHR[..., half:], x_BTHR[..., :half]), dim=-1)
    return x_BTHR * cos + rotated * sin
