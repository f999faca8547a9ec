"""Checkpoints: mff's own layout (save/load/resume), HF safetensors folders, FP8 and GGUF import,
MindSpore ``.ckpt`` files and MindSpore/MindFormers safetensors (``mff.ckpt.mindspore``)."""

from mff.ckpt.checkpoint import (
    CheckpointError,
    agree,
    latest_step_dir,
    list_steps,
    load,
    lock_dir,
    place_like,
    read_meta,
    save,
    save_weights,
    step_dir_name,
)

__all__ = [
    "CheckpointError", "agree", "latest_step_dir", "list_steps", "load", "lock_dir", "place_like", "read_meta", "save", "save_weights", "step_dir_name",
]
