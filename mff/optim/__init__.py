"""Pure update rules over param pytrees: AdamW, Muon, learning-rate schedules, grad clipping."""

from mff.optim import adamw, muon
from mff.optim.clip import clip_grads_, global_grad_norm
from mff.optim.config import OptimConfig
from mff.optim.optimizer import apply_update, init_state
from mff.optim.schedule import lr_at, warmup_cosine, warmup_stable_decay

__all__ = ["OptimConfig", "adamw", "apply_update", "clip_grads_", "global_grad_norm", "init_state", "lr_at", "muon", "warmup_cosine",
           "warmup_stable_decay"]
