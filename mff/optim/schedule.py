"""Learning-rate schedules as pure functions of the 1-based optimizer step."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``peak_lr * min_lr_ratio``.

    Step 1 has ``peak / warmup`` (> 0); step ``warmup_steps`` has the peak; after it the decay
    progress is ``(step - warmup - 1) / (total - warmup)``, so the step after warmup still has
    the peak and the last step stays above the floor (no step is wasted at the end).

    Raises:
        ValueError: step < 1, total_steps < 1, warmup_steps < 0 or > total_steps.
    """
    if total_steps < 1 or step < 1:
        raise ValueError(f"steps are 1-based: step={step}, total_steps={total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]")
    if step <= warmup_steps:
        return peak_lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps - 1) / max(1, total_steps - warmup_steps))
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
