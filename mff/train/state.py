"""What a checkpoint's metadata records about a run, and the checks on resuming it: configs as
plain data, the RNG states, and the model config a checkpoint was made for."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mff.ckpt import CheckpointError

__all__ = ["config_to_dict", "check_resume_config", "check_resume_recipe", "run_recipe", "rng_state", "restore_rng"]


def config_to_dict(cfg: Any, skip: Sequence[str] = ()) -> dict:
    """A dataclass as plain msgpack/JSON types (nested dicts, lists), without fields ``skip``."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    return {k: v for k, v in plain(cfg).items() if k not in skip}


def check_resume_config(meta: dict, family: str, config: Any) -> None:
    """Raise CheckpointError when a checkpoint was made for another family or model config
    (the message lists each differing field with both values)."""
    if meta.get("family") != family:
        raise CheckpointError(f"the checkpoint holds a {meta.get('family')!r} model, this run builds {family!r}; use another --ckpt-dir")
    saved, now = meta.get("config", {}), config_to_dict(config)
    diffs = []
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, this run {now.get(key)!r}")
    if diffs:
        raise CheckpointError("the checkpoint's model config differs from this run's: " + "; ".join(diffs) + " (use another --ckpt-dir)")


def run_recipe(meta: dict) -> str:
    """The recipe that wrote a checkpoint: its ``recipe`` field, or, for checkpoints written
    before that field existed, ``"finetune"`` when it records a ``source`` or ``lora`` entry
    (fine-tuning always does), else ``"pretrain"``."""
    recipe = meta.get("recipe")
    if isinstance(recipe, str):
        return recipe
    return "finetune" if "source" in meta or "lora" in meta else "pretrain"


def check_resume_recipe(meta: dict, recipe: str, folder: Path | str) -> None:
    """Raise CheckpointError when the checkpoint at ``folder`` was written by another recipe
    (a pretraining run's folder given to ``finetune``, or the reverse): a run only continues
    its own kind of run."""
    saved = run_recipe(meta)
    if saved != recipe:
        raise CheckpointError(f"{folder} is a checkpoint of a {saved} run; a {recipe} run cannot continue it "
                              f"(give this run its own --ckpt-dir)")


def _kind(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def rng_state() -> dict:
    """The torch RNG states (CPU, and CUDA when used) as bytes, for checkpoint metadata."""
    state = {"torch_cpu": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def restore_rng(state: dict, where: str = "the checkpoint") -> None:
    """Inverse of :func:`rng_state`.

    Raises:
        CheckpointError: ``state`` lacks the CPU state or holds one of the wrong size (``where`` named).
    """
    cpu = state.get("torch_cpu")
    want = torch.get_rng_state().numel()
    if not isinstance(cpu, bytes) or len(cpu) != want:
        got = f"{len(cpu)} bytes" if isinstance(cpu, bytes) else _kind(cpu)
        raise CheckpointError(f"{where} is corrupt: rng.torch_cpu is {got}, expected torch's {want}-byte CPU generator state")
    torch.set_rng_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["torch_cuda"]), dtype=torch.uint8))
