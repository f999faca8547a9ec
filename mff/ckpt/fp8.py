"""Dequantise block-scaled FP8 checkpoints (DeepSeek-V3's released weights) to bf16/fp32.

DeepSeek-V3 stores most linear weights as ``float8_e4m3fn`` with one fp32 scale per
``b0 x b1`` block of the weight, saved next to it as ``<name>.weight_scale_inv``::

    X.weight            float8_e4m3fn  [R, C]
    X.weight_scale_inv  float32        [ceil(R / b0), ceil(C / b1)]

    real X.weight[i, j] = float(X.weight[i, j]) * X.weight_scale_inv[i // b0, j // b1]

The block size comes from config.json, e.g.
``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``. Edge blocks are partial: a 576-row weight with 128-row
blocks has 5 scale rows and rows 512..575 use scale row 4. Despite its name, ``scale_inv`` is
*multiplied* in (it is the inverse of the quantisation scale that divided the weight).

Sources: the ``weight_dequant`` kernel in DeepSeek-V3's inference code (``inference/kernel.py``,
which computes ``x.float() * s`` per 128x128 tile and casts to the default dtype), the Hugging Face
transformers "FP8" / ``FineGrainedFP8Config`` quantizer docs (the ``quantization_config`` keys), and
the DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3, "fine-grained quantization":
1x128 tiles for activations, 128x128 blocks for weights).

Checkpoints are sharded, and a weight and its scale may sit in different shards, so the
streaming helper :class:`Fp8Dequantizer` holds whichever half arrives first until its partner
does; :func:`dequantize_tensors` is the one-mapping convenience built on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "SCALE_SUFFIX",
    "Fp8Dequantizer",
    "block_size_from_config",
    "decode_e4m3",
    "decode_e4m3_closed_form",
    "dequantize_block_fp8",
    "dequantize_tensors",
]

SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` + SCALE_SUFFIX names the block-scale tensor of ``X.weight``."""

_FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)
)


def decode_e4m3(raw: torch.Tensor) -> torch.Tensor:
    """Decode float8 e4m3fn bytes to float32 (exact: every e4m3fn value is an fp32 value).

    Args:
        raw: uint8 tensor of any shape holding e4m3fn bit patterns (or an already
            ``float8_e4m3fn`` tensor).

    Returns:
        float32 tensor of the same shape. 0x7F / 0xFF decode to NaN (e4m3fn has no infinities).

    Raises:
        ValueError: ``raw`` is neither uint8 nor float8_e4m3fn.
    """
    if raw.dtype == torch.uint8:
        raw = raw.view(torch.float8_e4m3fn)
    elif raw.dtype != torch.float8_e4m3fn:
        raise ValueError(f"decode_e4m3 expects uint8 bytes or float8_e4m3fn, got {raw.dtype}")
    return raw.to(torch.float32)


def decode_e4m3_closed_form(raw: torch.Tensor) -> torch.Tensor:
    """The same decoding as :func:`decode_e4m3`, from the bit layout, without torch's float8 type.

    e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (``m/8 * 2**-6``), ``S.1111.111`` is NaN, there is no infinity, so the largest value is
    ``0x7E = 1.75 * 2**8 = 448``. Used to check :func:`decode_e4m3`.

    Args:
        raw: uint8 tensor of any shape.

    Returns:
        float32 tensor of the same shape.
    """
    if raw.dtype != torch.uint8:
        raise ValueError(f"decode_e4m3_closed_form expects uint8 bytes, got {raw.dtype}")
    r = raw.to(torch.int32)
    sign = torch.where((r >> 7) & 1 == 1, -1.0, 1.0).to(torch.float64)
    exp = (r >> 3) & 0xF
    man = (r & 0x7).to(torch.float64)
    normal = (1.0 + man / 8.0) * torch.exp2((exp - 7).to(torch.float64))
    subnormal = (man / 8.0) * 2.0**-6
    val = sign * torch.where(exp == 0, subnormal, normal)
    val = torch.where((exp == 15) & (r & 0x7 == 7), torch.full_like(val, float("nan")), val)
    return val.to(torch.float32)


def _check_block_size(block_size: Any) -> tuple[int, int]:
    ok = (
        isinstance(block_size, (list, tuple))
        and len(block_size) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)
    )
    if not ok:
        raise ValueError(f"weight_block_size must be two positive integers like [128, 128], got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def block_size_from_config(hf_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The FP8 weight block size ``(b0, b1)`` of a Hugging Face config.json dict.

    Returns:
        ``None`` when the config has no ``quantization_config`` (or it is null): the checkpoint
        is not quantised. Otherwise ``tuple(quantization_config["weight_block_size"])``.

    Raises:
        ValueError: naming the offending value, when ``quant_method`` is not ``"fp8"`` (another
            quantisation this module cannot undo), ``fmt`` is present and not ``"e4m3"``, or
            ``weight_block_size`` is missing or not two positive integers (per-tensor FP8 without
            blocks is not supported).
    """
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization_config.quant_method {method!r}: only 'fp8' (block-scaled e4m3) is supported")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"unsupported quantization_config.fmt {fmt!r}: only 'e4m3' is supported")
    if "weight_block_size" not in qc:
        raise ValueError("quantization_config has quant_method 'fp8' but no weight_block_size (per-tensor FP8 is not supported)")
    return _check_block_size(qc["weight_block_size"])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_block_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    name: str | None = None,
) -> torch.Tensor:
    """Dequantise one block-scaled FP8 weight: ``out[i, j] = float(w[i, j]) * scale_inv[i // b0, j // b1]``.

    Computed in fp32 (as DeepSeek-V3's ``weight_dequant`` does) and cast to ``dtype`` once at the
    end. Memory: the fp32 product plus a ``[ceil(R/b0), C]`` column-expanded scale
    (``repeat_interleave`` along columns, sliced to C); rows are broadcast over a
    ``[R // b0, b0, C]`` view plus the partial tail block, so no ``[R, C]`` index or scale tensor
    is built.

    Args:
        weight: ``[R, C]`` float8_e4m3fn, or uint8 holding e4m3fn bytes.
        scale_inv: ``[ceil(R/b0), ceil(C/b1)]`` scales (fp32; other float dtypes are upcast).
        block_size: ``(b0, b1)``, rows and columns per block.
        dtype: output floating dtype.
        name: the weight's name, used in error messages.

    Returns:
        ``[R, C]`` tensor of ``dtype`` on ``weight``'s device.

    Raises:
        ValueError: a weight that is not 2-D or not e4m3fn/uint8, a non-float scale, a bad
            block size, or ``scale_inv.shape`` != ``(ceil(R/b0), ceil(C/b1))`` (the message
            names both shapes and ``name``).
    """
    b0, b1 = _check_block_size(block_size)
    what = f" for {name}" if name else ""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight{what} must be float8_e4m3fn (or uint8 bytes), got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"FP8 weight{what} must be 2-D, got shape {tuple(weight.shape)}")
    if not scale_inv.is_floating_point() or scale_inv.dtype in _FP8_DTYPES:
        raise ValueError(f"weight_scale_inv{what} must be a float32 tensor, got {scale_inv.dtype}")
    rows, cols = weight.shape
    want = (_ceil_div(rows, b0), _ceil_div(cols, b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv{what} has shape {tuple(scale_inv.shape)}, expected {want} "
            f"for a weight of shape {(rows, cols)} with block size {(b0, b1)}"
        )
    out = weight.to(dtype=torch.float32, memory_format=torch.contiguous_format)
    scale = scale_inv.to(device=out.device, dtype=torch.float32)
    scale_cols = scale.repeat_interleave(b1, dim=1)[:, :cols]  # [ceil(R/b0), C]
    full = rows // b0
    if full:
        out[: full * b0].view(full, b0, cols).mul_(scale_cols[:full, None, :])
    if rows % b0:
        out[full * b0 :].mul_(scale_cols[full])
    return out.to(dtype)


class Fp8Dequantizer:
    """Streaming pairer of FP8 weights and their block scales, one checkpoint shard at a time.

    Feed every tensor of every shard through :meth:`add`, in any order; it returns the tensors
    that are ready. ``X.weight`` (float8_e4m3fn, or uint8 bytes) is held until
    ``X.weight_scale_inv`` arrives (or vice versa), then the dequantised ``X.weight`` is returned
    and the scale is dropped. Every other tensor is returned at once: floating tensors cast to
    ``dtype``, non-floating ones (ints, bools) unchanged. Call :meth:`finish` after the last
    shard; it raises if anything is still waiting for a partner.

    Example::

        deq = Fp8Dequantizer(block_size_from_config(cfg), torch.bfloat16)
        for shard in shards:
            for name, t in load_file(shard).items():
                for out_name, out in deq.add(name, t):
                    params[out_name] = out
        deq.finish()

    Note that ``dtype`` also applies to non-quantised float tensors (e.g. DeepSeek-V3's fp32
    ``e_score_correction_bias``); pass ``torch.float32`` to keep them exact.
    """

    def __init__(self, block_size: tuple[int, int] | list[int], dtype: torch.dtype = torch.bfloat16):
        self.block_size = _check_block_size(block_size)
        self.dtype = dtype
        self._weights: dict[str, torch.Tensor] = {}  # fp8 weights waiting for their scale
        self._scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, keyed by weight name
        self._passed: dict[str, torch.dtype] = {}  # weights passed through unquantised (name -> dtype)
        self._seen: set[str] = set()

    @property
    def pending(self) -> list[str]:
        """Names (as added) of the tensors still waiting for a partner."""
        return sorted(self._weights) + sorted(n + SCALE_SUFFIX for n in self._scales)

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Take one tensor; return the ``(name, tensor)`` pairs now ready (zero, one, or the passed-through tensor).

        Raises:
            ValueError: a name added twice, a scale whose weight already passed through as a
                non-FP8 tensor, or a scale shape that does not fit its weight.
        """
        if name in self._seen:
            raise ValueError(f"tensor {name!r} was added twice")
        self._seen.add(name)
        if name.endswith(".weight" + SCALE_SUFFIX):
            wname = name[: -len(SCALE_SUFFIX)]
            if wname in self._passed:
                raise ValueError(f"{name} scales {wname}, which is not FP8 (dtype {self._passed[wname]})")
            if wname in self._weights:
                return [(wname, self._dequant(wname, self._weights.pop(wname), tensor))]
            self._scales[wname] = tensor
            return []
        if tensor.dtype in _FP8_DTYPES or (tensor.dtype == torch.uint8 and name.endswith(".weight")):
            if name in self._scales:
                return [(name, self._dequant(name, tensor, self._scales.pop(name)))]
            self._weights[name] = tensor
            return []
        if name.endswith(".weight"):
            self._passed[name] = tensor.dtype
        return [(name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)]

    def finish(self) -> None:
        """Check nothing is left unpaired.

        Raises:
            ValueError: listing FP8 weights that never got a scale and scales that never got
                their weight.
        """
        problems = []
        if self._weights:
            problems.append(f"FP8 weights without a {SCALE_SUFFIX} scale: {sorted(self._weights)}")
        if self._scales:
            problems.append(f"scales without their weight: {sorted(n + SCALE_SUFFIX for n in self._scales)}")
        if problems:
            raise ValueError("; ".join(problems))

    def _dequant(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        return dequantize_block_fp8(weight, scale_inv, self.block_size, self.dtype, name=name)


def dequantize_tensors(
    tensors: Mapping[str, torch.Tensor],
    block_size: tuple[int, int] | list[int],
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Dequantise one mapping of tensors (a whole checkpoint, or a shard known to be self-contained).

    Every ``X.weight`` with a sibling ``X.weight_scale_inv`` becomes the dequantised ``[R, C]``
    ``dtype`` weight and the scale is dropped; other floating tensors are cast to ``dtype``,
    non-floating ones are kept. Keys keep the input order. For shards whose weights and scales
    may be split across files, use :class:`Fp8Dequantizer` directly.

    Raises:
        ValueError: FP8 weights without a scale or scales without their weight (all named),
            or a scale of the wrong shape (see :func:`dequantize_block_fp8`).
    """
    deq = Fp8Dequantizer(block_size, dtype)
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        ready.update(deq.add(name, tensor))
    deq.finish()
    return {name: ready[name] for name in tensors if name in ready}
