"""Checkpoint save/load/resume in mff's layout (and, later, HF and MindSpore import/export)."""

from mff.ckpt.checkpoint import CheckpointError, latest_step_dir, list_steps, load, lock_dir, read_meta, save, step_dir_name

__all__ = ["CheckpointError", "latest_step_dir", "list_steps", "load", "lock_dir", "read_meta", "save", "step_dir_name"]
