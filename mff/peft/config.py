"""The LoRA options of a fine-tuning run (``--lora.*`` flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LoraConfig"]


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al. 2021): frozen base weights, trainable low-rank adapters ``W + s B A``."""

    r: int = 0
    """Adapter rank; 0 = no LoRA (full fine-tuning of every weight)."""
    alpha: float | None = None
    """Scale numerator: s = alpha / r (default alpha = 2 r, so s = 2)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 = none; stacked experts in PEFT format need 0)."""
    targets: tuple[str, ...] = ("all",)
    """Weights to adapt: "all" (every attention and MLP projection of the decoder layers, MLA's low-rank projections, shared and stacked routed experts included; not the embedding, head, routers or MTP layers), module names as PEFT takes them (q_proj, kv_b_proj, gate_up_proj, experts, ...) or param path patterns (**.self_attn.*.weight; * = one dotted part, ** = several); a|b takes whichever of a and b the model has."""
    rslora: bool = False
    """rsLoRA scale s = alpha / sqrt(r) instead of alpha / r."""
    init_from: str | None = None
    """Start from these adapters, a PEFT adapter folder or an mff LoRA run: r, alpha and targets then come from them (--lora.dropout may still be set)."""

    @property
    def enabled(self) -> bool:
        """True when the run trains adapters (r > 0 or --lora.init-from)."""
        return self.r != 0 or self.init_from is not None

    @property
    def alpha_value(self) -> float:
        """``alpha``, or 2 r when it is not set."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.r

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora.dropout {self.dropout} must be in [0, 1)")
        if self.init_from is not None:
            if self.r or self.alpha is not None or self.targets != ("all",) or self.rslora:
                raise ValueError("--lora.init-from takes r, alpha and targets from the adapters; drop --lora.r / --lora.alpha / "
                                 "--lora.targets / --lora.rslora")
            return
        if self.r < 0 or (self.r == 0 and self.alpha is not None):
            raise ValueError(f"--lora.r {self.r} must be >= 1 (0 = no LoRA{'; --lora.alpha needs --lora.r' if self.r == 0 else ''})")
        if self.r == 0 and (self.targets != ("all",) or self.dropout or self.rslora):
            raise ValueError("--lora.targets, --lora.dropout and --lora.rslora need --lora.r (the adapter rank; 0 = no LoRA)")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--lora.alpha {self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora.dropout {self.dropout} must be in [0, 1)")
        if not self.targets:
            raise ValueError("--lora.targets is empty; give at least one module name or path pattern (or 'all')")
