"""Throughput, MFU and memory figures printed by the recipes.

MFU = achieved model FLOP/s per device over the device's peak. Model FLOPs per token come from
the family (6 x activated params + attention, see ``train_flops_per_token``). Peaks: a table
of dense bf16 figures from vendor data sheets for accelerators (not measured here), and on CPU
a fp32 matmul measured at start (so CPU MFU is relative to what this machine's BLAS reaches).
"""

from __future__ import annotations

import time

import torch

from mff.plan.devices import DEVICES

__all__ = ["PEAK_FLOPS", "measure_matmul_flops", "device_peak_flops", "mfu", "memory_estimate_gib"]

_PLANNED = {key: d.peak_flops for key, d in DEVICES.items()}  # the planner's device table (one source for both)

PEAK_FLOPS = {
    # device-name substring -> dense bf16 FLOP/s (vendor data sheets; mff.plan.devices for the parts the planner models)
    "H200": _PLANNED["h200"],
    "H100": _PLANNED["h100"],
    "H800": _PLANNED["h800"],
    "B200": _PLANNED["b200"],
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    # Ascend, by the SoC name torch.npu.get_device_name reports: dense fp16/bf16 figures as publicly
    # cited for these parts (approximate; not measured in this project, which has had no NPU)
    "Ascend910B4": 280e12,  # Atlas 800I A2 class
    "Ascend910B": _PLANNED["910b"],  # Atlas 800T A2 (910B1-B3): 2.5 PFLOPS fp16 per 8-NPU server
    "Ascend910_93": _PLANNED["910c"],  # Atlas 900 A3 SuperPoD: one 910C die (torch_npu sees each die as a device)
    "910B": _PLANNED["910b"],
    "910C": _PLANNED["910c"],
}


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul on ``device``, best of repeated timings over about
    ``seconds`` (2 n^3 FLOPs per product)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


def device_peak_flops(device: torch.device, measure_cpu: bool = True, dtype: torch.dtype | None = None) -> tuple[float, str]:
    """``(peak FLOP/s, source)`` for ``device``: the table for known accelerators (dense bf16),
    a measured matmul on CPU (or for unknown accelerators) in ``dtype``: the run's compute dtype
    (:func:`mff.train.precision.compute_dtype`; default fp32 on CPU, bf16 elsewhere), so that a
    bf16 run's MFU is against the bf16 matmul peak."""
    name = "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu":
        try:
            name = torch.npu.get_device_name(device)
        except Exception:
            name = "npu"
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak, f"{name} bf16 {'cited figure, unverified' if device.type == 'npu' else 'data sheet'}"
    if not measure_cpu:
        return float("nan"), name
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return measure_matmul_flops(device, dtype), f"{name} measured {str(dtype).replace('torch.', '')} matmul"


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float, world_size: int = 1) -> float:
    """Model FLOPs utilisation in [0, 1]: ``flops_per_token * tokens/s / (peak * devices)``."""
    return flops_per_token * tokens_per_s / (peak_flops * world_size)


def memory_estimate_gib(
    n_params_local: int,
    param_bytes: int,
    n_trainable_local: int,
    tokens_per_micro_batch: int,
    hidden: int,
    layers: int,
    heads: int,
    seq_len: int,
    act_bytes: int,
    attention_scores: bool = False,
) -> dict[str, float]:
    """Rough per-device memory in GiB: params, grads, AdamW moments (2 x fp32) and activations
    (Korthikanti et al. 2022, eq. 2: ``s b h (34 + 5 a s / h)`` bytes per layer at 2-byte
    activations, scaled to ``act_bytes``). ``attention_scores`` False (mff's attention, which
    runs ``F.scaled_dot_product_attention`` and keeps no ``[a, s, s]`` scores) drops the
    ``5 a s / h`` term of the softmax scores and their dropout mask, as that paper does for
    selective recomputation (section 4.1)."""
    gib = 1024**3
    per_token = 34 + (5 * heads * seq_len / hidden if attention_scores else 0)
    act = tokens_per_micro_batch * hidden * per_token * layers * act_bytes / 2
    out = {
        "params": n_params_local * param_bytes / gib,
        "grads": n_trainable_local * param_bytes / gib,
        "optimizer": n_trainable_local * 8 / gib,
        "activations": act / gib,
    }
    out["total"] = sum(out.values())
    return out
