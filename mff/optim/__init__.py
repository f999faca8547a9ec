"""Pure update rules over param pytrees: AdamW, learning-rate schedules, grad clipping."""

from mff.optim import adamw
from mff.optim.adamw import AdamWConfig
from mff.optim.clip import clip_grads_, global_grad_norm
from mff.optim.schedule import warmup_cosine

__all__ = ["AdamWConfig", "adamw", "clip_grads_", "global_grad_norm", "warmup_cosine"]
