"""The optimizer and lr-schedule configuration of a run (``--optim.*`` flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["OptimConfig"]

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "**.embed_tokens.weight",
    "**.shared_head.head.weight",
)
"""Path patterns of >= 2-D params that take AdamW under Muon: embeddings and output heads."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer (AdamW, or Muon for the hidden matrices with AdamW for the rest), grad
    clipping and the lr schedule (:mod:`mff.optim.schedule`)."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every param. muon: Muon for hidden 2-D matrices (stacked experts as a batch of matrices), AdamW for embeddings, output heads and 1-D params (--optim.muon-adamw-params)."""
    lr: float = 3e-3
    """Peak learning rate (Muon and AdamW params alike)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to 1-D params and no_decay paths), for Muon and AdamW."""
    no_decay: tuple[str, ...] = ("model.embed_tokens.weight",)
    """Path patterns exempt from weight decay (1-D params always are)."""
    max_grad_norm: float = 1.0
    """Clip the global grad norm to this (0 = no clipping)."""
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "cosine"
    """lr schedule after the warmup: constant; cosine or linear decay over all remaining steps; wsd = warmup-stable-decay (the last --optim.decay-ratio of the steps decay)."""
    warmup_steps: int = 20
    """Linear warmup steps (the first step has lr > 0; the peak is reached at the last warmup step). Left at its default, a pretraining run shorter than it warms up over half its steps; given, it must fit in --steps."""
    min_lr_ratio: float = 0.1
    """Decay floor as a fraction of lr."""
    decay_ratio: float = 0.2
    """wsd: share of the total steps in the decay phase (0..1)."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """wsd: shape of the decay (sqrt = 1 - sqrt(progress), MiniCPM)."""
    muon_momentum: float = 0.95
    """Muon momentum (buf = mu buf + (1 - mu) g)."""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Muon per-matrix lr scale: original = sqrt(max(1, out/in)); match_rms_adamw = 0.2 sqrt(max(out, in)), which gives updates of AdamW's RMS so one lr and weight decay serve both (Moonlight, arXiv 2502.16982)."""
    muon_adamw_params: tuple[str, ...] = DEFAULT_ADAMW_PATTERNS
    """Muon: path patterns of >= 2-D params that take AdamW instead (embeddings and output heads)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        checks = [
            (self.name in ("adamw", "muon"), f"--optim.name {self.name!r} must be adamw or muon"),
            (math.isfinite(self.lr) and self.lr >= 0, f"--optim.lr {self.lr} must be a finite number >= 0"),
            (0 <= self.beta1 < 1, f"--optim.beta1 {self.beta1} must be in [0, 1)"),
            (0 <= self.beta2 < 1, f"--optim.beta2 {self.beta2} must be in [0, 1)"),
            (self.eps > 0, f"--optim.eps {self.eps} must be > 0"),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"--optim.weight-decay {self.weight_decay} must be >= 0"),
            (self.max_grad_norm >= 0, f"--optim.max-grad-norm {self.max_grad_norm} must be >= 0 (0 = no clipping)"),
            (self.schedule in ("constant", "cosine", "linear", "wsd"), f"--optim.schedule {self.schedule!r} must be constant, cosine, linear or wsd"),
            (self.warmup_steps >= 0, f"--optim.warmup-steps {self.warmup_steps} must be >= 0"),
            (0 <= self.min_lr_ratio <= 1, f"--optim.min-lr-ratio {self.min_lr_ratio} must be in [0, 1]"),
            (0 <= self.decay_ratio <= 1, f"--optim.decay-ratio {self.decay_ratio} must be in [0, 1]"),
            (self.decay_type in ("linear", "cosine", "sqrt"), f"--optim.decay-type {self.decay_type!r} must be linear, cosine or sqrt"),
            (0 <= self.muon_momentum < 1, f"--optim.muon-momentum {self.muon_momentum} must be in [0, 1)"),
            (1 <= self.muon_ns_steps < 100, f"--optim.muon-ns-steps {self.muon_ns_steps} must be in [1, 100)"),
            (self.muon_adjust_lr in ("original", "match_rms_adamw"),
             f"--optim.muon-adjust-lr {self.muon_adjust_lr!r} must be original or match_rms_adamw"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
