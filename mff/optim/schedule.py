"""Learning-rate schedules as pure functions of the 1-based optimizer step.

Every schedule is linear warmup, then a stable phase at the peak, then a decay phase:

- ``constant``: warmup, then the peak to the end (no decay);
- ``cosine`` / ``linear``: warmup, then decay over all remaining steps;
- ``wsd`` (warmup-stable-decay, MiniCPM arXiv 2404.06395 section 4; the "WSD" of torchtitan
  and Megatron's ``--lr-wsd-decay-*``): the last ``decay_ratio`` of the run decays, with a
  ``linear``, ``cosine`` or ``sqrt`` (``1 - sqrt(progress)``) shape.

Conventions (so no step is wasted): step 1 has ``peak / warmup`` (> 0); step ``warmup`` has
the peak; decay progress at step s is ``(s - decay_start - 1) / decay_steps``, so the first
decay step still has the peak and the last step stays above the floor ``peak * min_lr_ratio``.
Being pure functions of the step, a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "DECAY_TYPES", "decay_steps_of", "lr_at", "warmup_cosine", "warmup_stable_decay"]

SCHEDULES = ("constant", "cosine", "linear", "wsd")
DECAY_TYPES = ("linear", "cosine", "sqrt")


def _decay_factor(progress: float, decay_type: str) -> float:
    if decay_type == "linear":
        return 1.0 - progress
    if decay_type == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay_type == "sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay_type {decay_type!r}; expected one of {DECAY_TYPES}")


def warmup_stable_decay(step: int, peak_lr: float, warmup_steps: int, total_steps: int, decay_steps: int,
                        decay_type: str = "linear", min_lr_ratio: float = 0.0) -> float:
    """The lr at ``step``: linear warmup over ``warmup_steps``, the peak until the last
    ``decay_steps`` steps, then a ``decay_type`` decay towards ``peak_lr * min_lr_ratio``.

    Args:
        step: 1-based optimizer step (may exceed ``total_steps``: the lr then stays at the
            last decay value's limit, the floor).
        decay_steps: length of the decay phase, in [0, total_steps - warmup_steps].
    Returns:
        The lr (float, same units as ``peak_lr``).
    Raises:
        ValueError: step < 1, total_steps < 1, warmup_steps outside [0, total_steps],
            decay_steps outside [0, total_steps - warmup_steps], an unknown ``decay_type``, or
            ``min_lr_ratio`` outside [0, 1].
    """
    if total_steps < 1 or step < 1:
        raise ValueError(f"steps are 1-based: step={step}, total_steps={total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]")
    if not 0 <= decay_steps <= total_steps - warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be in [0, total_steps - warmup_steps = {total_steps - warmup_steps}] "
                         "(the decay may not start before the warmup ends)")
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type {decay_type!r}; expected one of {DECAY_TYPES}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if step <= warmup_steps:
        return peak_lr * step / warmup_steps
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step <= decay_start:
        return peak_lr
    progress = min(1.0, (step - decay_start - 1) / decay_steps)
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * _decay_factor(progress, decay_type)


def warmup_cosine(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay over all remaining steps to ``peak_lr * min_lr_ratio``
    (:func:`warmup_stable_decay` with ``decay_steps = total_steps - warmup_steps``)."""
    return warmup_stable_decay(step, peak_lr, warmup_steps, total_steps, max(0, total_steps - warmup_steps), "cosine", min_lr_ratio)


def decay_steps_of(schedule: str, warmup_steps: int, total_steps: int, decay_ratio: float) -> int:
    """Decay-phase length of ``schedule``: 0 for constant, all post-warmup steps for cosine and
    linear, ``round(decay_ratio * total_steps)`` for wsd.

    Raises:
        ValueError: an unknown schedule; a wsd ``decay_ratio`` outside [0, 1] or whose decay
            phase would overlap the warmup.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule == "constant":
        return 0
    if schedule in ("cosine", "linear"):
        return max(0, total_steps - warmup_steps)
    if not 0 <= decay_ratio <= 1:
        raise ValueError(f"decay_ratio={decay_ratio} must be in [0, 1]")
    n = round(decay_ratio * total_steps)
    if n > total_steps - warmup_steps:
        raise ValueError(f"wsd: the decay phase ({decay_ratio} x {total_steps} = {n} steps) overlaps the {warmup_steps} warmup steps "
                         f"of a {total_steps}-step run; lower the decay ratio or the warmup")
    return n


def lr_at(step: int, cfg, total_steps: int) -> float:
    """The lr of ``step`` under an optimizer config with ``lr``, ``schedule``, ``warmup_steps``,
    ``decay_ratio``, ``decay_type`` and ``min_lr_ratio`` (:class:`mff.optim.OptimConfig`).
    ``cosine`` always decays with a cosine, ``linear`` linearly; ``wsd`` uses ``decay_type``."""
    n = decay_steps_of(cfg.schedule, cfg.warmup_steps, total_steps, cfg.decay_ratio)
    kind = {"cosine": "cosine", "linear": "linear"}.get(cfg.schedule, cfg.decay_type)
    return warmup_stable_decay(step, cfg.lr, cfg.warmup_steps, total_steps, n, kind, cfg.min_lr_ratio)
