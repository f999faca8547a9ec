"""AdamW (Loshchilov & Hutter 2019) as pure init/update over param pytrees.

Same numerics as ``torch.optim.AdamW`` (its fused kernel ``torch._fused_adamw_`` where the dtypes allow, else foreach ops): decoupled weight decay
``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - b1)``; ``v = b2 v + (1 - b2) g^2``;
``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. Updates are in place with
``torch._foreach_*`` and work on DTensor leaves (all on one mesh) as on plain tensors.

State: ``{"step": 0-d int64, "exp_avg": {path: T}, "exp_avg_sq": {path: T}}`` for the params
that are updated (those with ``requires_grad``); saved as ``optim.safetensors`` with keys
``exp_avg/<path>``, ``exp_avg_sq/<path>`` and ``step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from mff.optim.config import OptimConfig
from mff.tree import matches

__all__ = ["init", "update", "decays"]


def decays(path: str, t: torch.Tensor, no_decay: Sequence[str]) -> bool:
    """Whether weight decay applies: >= 2-D and no ``no_decay`` pattern matches ``path``."""
    return t.dim() >= 2 and not any(matches(p, path) for p in no_decay)


def init(params: Mapping[str, torch.Tensor]) -> dict:
    """Zero moments for every param with ``requires_grad`` (same placements and dtype as the
    param; fp32 when the param is lower precision), and ``step`` 0."""

    trained = {k: v for k, v in params.items() if v.requires_grad}
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "exp_avg": {k: _zeros_state(v) for k, v in trained.items()},
        "exp_avg_sq": {k: _zeros_state(v) for k, v in trained.items()},
    }


def _zeros_state(t: torch.Tensor) -> torch.Tensor:
    """Zeros with ``t``'s shape, device and DTensor placements; fp32 when ``t`` is bf16/fp16."""
    z = torch.zeros_like(t.detach())
    return z.float() if z.dtype in (torch.bfloat16, torch.float16) else z


@torch.no_grad()
def update(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: dict,
    lr: float,
    cfg: OptimConfig = OptimConfig(),
) -> tuple[Mapping[str, torch.Tensor], dict]:
    """One AdamW step, in place on ``params`` and ``state``; returns them.

    ``grads`` has a tensor for every path in ``state["exp_avg"]`` (same placements as the
    param). Raises KeyError naming a path whose grad is missing.
    """
    missing = [k for k in state["exp_avg"] if k not in grads]
    if missing:
        raise KeyError(f"no gradient for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state["step"] += 1
    _adamw_group(params, grads, state["exp_avg"], state["exp_avg_sq"], list(state["exp_avg"]), int(state["step"]), lr, cfg)
    return params, state


def _adamw_group(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    exp_avg: Mapping[str, torch.Tensor],
    exp_avg_sq: Mapping[str, torch.Tensor],
    keys: Sequence[str],
    t: int,
    lr: float,
    cfg: OptimConfig,
) -> None:
    """The AdamW math of :func:`update` for the params named by ``keys`` at step ``t`` (>= 1,
    already counted), in place; weight decay as :func:`decays` says. ``mff.optim.muon`` calls it
    for the params it does not orthogonalise."""
    bc1 = 1 - cfg.beta1**t
    bc2_sqrt = (1 - cfg.beta2**t) ** 0.5
    for decay in (True, False):
        group = [k for k in keys if decays(k, params[k], cfg.no_decay) == decay]
        if not group:
            continue
        if _fused_ok(params, grads, exp_avg, exp_avg_sq, group):
            # a grad laid out unlike its param (a transposed gradient of a stacked expert weight,
            # as a grouped GEMM's backward can give) is copied into the param's layout, as
            # AccumulateGrad does for ``.grad``, so that the group keeps the fused kernel: the
            # foreach path makes ~8 passes over every param of the group and a full-size temporary
            # (deepseek3_bench, 82M params, 2 CPU threads: fused 0.04 s, foreach 0.33 s, fused
            # after copying its 63M transposed expert gradients 0.20 s)
            laid = {k: _in_layout_of(params[k], grads[k]) for k in group}
            _fused_group(params, laid, exp_avg, exp_avg_sq, group, t, lr, cfg, decay)
            continue
        # bf16/fp16 params (``--precision bf16``) have fp32 moments: their update is computed on
        # an fp32 copy and rounded into the param once, at the end
        low = [params[k].dtype != exp_avg[k].dtype for k in group]
        p = [params[k].float() if lo else params[k] for k, lo in zip(group, low)]
        g = [grads[k].to(exp_avg[k].dtype) if grads[k].dtype != exp_avg[k].dtype else grads[k] for k in group]
        m = [exp_avg[k] for k in group]
        v = [exp_avg_sq[k] for k in group]
        if decay and cfg.weight_decay:
            torch._foreach_mul_(p, 1 - lr * cfg.weight_decay)
        torch._foreach_lerp_(m, g, 1 - cfg.beta1)
        torch._foreach_mul_(v, cfg.beta2)
        torch._foreach_addcmul_(v, g, g, 1 - cfg.beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, cfg.eps)
        torch._foreach_addcdiv_(p, m, denom, -lr / bc1)
        for k, lo, p32 in zip(group, low, p):
            if lo:
                params[k].copy_(p32)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _in_layout_of(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it with the strides of ``p`` (local strides for DTensors) when they differ."""
    if _local(g).stride() == _local(p).stride():
        return g
    return torch.empty_like(p, dtype=g.dtype).copy_(g)


def _fused_ok(params, grads, exp_avg, exp_avg_sq, keys) -> bool:
    """Whether ``torch._fused_adamw_`` can take the group: it exists, every tensor of a param
    (param, grad, moments) has one float dtype, the device is CPU or CUDA, and each param is
    contiguous with its moments in its layout (a grad in another layout is copied into it
    first, :func:`_in_layout_of`)."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    for k in keys:
        p = params[k]
        if p.device.type not in ("cpu", "cuda") or not p.dtype.is_floating_point:
            return False
        if not (grads[k].dtype == exp_avg[k].dtype == exp_avg_sq[k].dtype == p.dtype):
            return False
        if isinstance(p, DTensor) != isinstance(grads[k], DTensor):
            return False
        # the kernel walks every tensor of a param as one flat buffer (seen on torch 2.13 CPU: a
        # transposed grad of a contiguous param was applied to the wrong elements), so all four
        # must share one layout: the grad is copied into the param's when it differs
        layout = _local(p).stride()
        if not (_local(p).is_contiguous() and all(_local(t[k]).stride() == layout for t in (exp_avg, exp_avg_sq))):
            return False
    return True


def _fused_group(params, grads, exp_avg, exp_avg_sq, keys, t: int, lr: float, cfg: OptimConfig, decay: bool) -> None:
    """The same update as the foreach path in one fused kernel per dtype (``torch.optim.AdamW(fused=True)``'s
    kernel): one pass over each tensor instead of seven, 3-4x faster on CPU. Elementwise, so
    DTensor shards are updated through their local tensors."""
    p = [_local(params[k]) for k in keys]
    step = torch.tensor(float(t), dtype=torch.float32, device=p[0].device)
    torch._fused_adamw_(p, [_local(grads[k]) for k in keys], [_local(exp_avg[k]) for k in keys], [_local(exp_avg_sq[k]) for k in keys],
                        [], [step] * len(keys), lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                        weight_decay=cfg.weight_decay if decay else 0.0, eps=cfg.eps, amsgrad=False, maximize=False)
