"""AdamW (Loshchilov & Hutter 2019) as pure init/update over param pytrees.

Same numerics as ``torch.optim.AdamW`` (foreach implementation): decoupled weight decay
``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - b1)``; ``v = b2 v + (1 - b2) g^2``;
``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. Updates are in place with
``torch._foreach_*`` and work on DTensor leaves (all on one mesh) as on plain tensors.

State: ``{"step": 0-d int64, "exp_avg": {path: T}, "exp_avg_sq": {path: T}}`` for the params
that are updated (those with ``requires_grad``); saved as ``optim.safetensors`` with keys
``exp_avg/<path>``, ``exp_avg_sq/<path>`` and ``step``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mff.tree import matches

__all__ = ["AdamWConfig", "init", "update", "decays"]


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyperparameters (``--optim.*``)."""

    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to 1-D params and no_decay paths)."""
    no_decay: tuple[str, ...] = ("model.embed_tokens.weight",)
    """Path patterns exempt from weight decay (1-D params always are)."""
    max_grad_norm: float = 1.0
    """Clip the global grad norm to this (0 = no clipping)."""
    warmup_steps: int = 20
    """Linear warmup steps (the first step has lr > 0; the peak is reached at the last warmup step)."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of lr."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        checks = [
            (math.isfinite(self.lr) and self.lr >= 0, f"--optim.lr {self.lr} must be a finite number >= 0"),
            (0 <= self.beta1 < 1, f"--optim.beta1 {self.beta1} must be in [0, 1)"),
            (0 <= self.beta2 < 1, f"--optim.beta2 {self.beta2} must be in [0, 1)"),
            (self.eps > 0, f"--optim.eps {self.eps} must be > 0"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"--optim.weight-decay {self.weight_decay} must be >= 0"),
            (self.max_grad_norm >= 0, f"--optim.max-grad-norm {self.max_grad_norm} must be >= 0 (0 = no clipping)"),
            (self.warmup_steps >= 0, f"--optim.warmup-steps {self.warmup_steps} must be >= 0"),
            (0 <= self.min_lr_ratio <= 1, f"--optim.min-lr-ratio {self.min_lr_ratio} must be in [0, 1]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def decays(path: str, t: torch.Tensor, no_decay: Sequence[str]) -> bool:
    """Whether weight decay applies: >= 2-D and no ``no_decay`` pattern matches ``path``."""
    return t.dim() >= 2 and not any(matches(p, path) for p in no_decay)


def init(params: Mapping[str, torch.Tensor]) -> dict:
    """Zero moments for every param with ``requires_grad`` (same placements and dtype as the
    param; fp32 when the param is lower precision), and ``step`` 0."""

    def zeros(t: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(t.detach())
        return z.float() if z.dtype in (torch.bfloat16, torch.float16) else z

    trained = {k: v for k, v in params.items() if v.requires_grad}
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "exp_avg": {k: zeros(v) for k, v in trained.items()},
        "exp_avg_sq": {k: zeros(v) for k, v in trained.items()},
    }


@torch.no_grad()
def update(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: dict,
    lr: float,
    cfg: AdamWConfig = AdamWConfig(),
) -> tuple[Mapping[str, torch.Tensor], dict]:
    """One AdamW step, in place on ``params`` and ``state``; returns them.

    ``grads`` has a tensor for every path in ``state["exp_avg"]`` (same placements as the
    param). Raises KeyError naming a path whose grad is missing.
    """
    missing = [k for k in state["exp_avg"] if k not in grads]
    if missing:
        raise KeyError(f"no gradient for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state["step"] += 1
    t = int(state["step"])
    bc1 = 1 - cfg.beta1**t
    bc2_sqrt = (1 - cfg.beta2**t) ** 0.5
    for decay in (True, False):
        keys = [k for k in state["exp_avg"] if decays(k, params[k], cfg.no_decay) == decay]
        if not keys:
            continue
        p = [params[k] for k in keys]
        g = [grads[k] for k in keys]
        m = [state["exp_avg"][k] for k in keys]
        v = [state["exp_avg_sq"][k] for k in keys]
        if decay and cfg.weight_decay:
            torch._foreach_mul_(p, 1 - lr * cfg.weight_decay)
        torch._foreach_lerp_(m, g, 1 - cfg.beta1)
        torch._foreach_mul_(v, cfg.beta2)
        torch._foreach_addcmul_(v, g, g, 1 - cfg.beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, cfg.eps)
        torch._foreach_addcdiv_(p, m, denom, -lr / bc1)
    return params, state
