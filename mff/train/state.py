"""What a checkpoint's metadata records about a run, and the checks on resuming it: configs as
plain data, the RNG states, and the model config a checkpoint was made for."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mff.ckpt import CheckpointError
from mff.data.loader import MAX_POSITION
from mff.train.precision import PRECISIONS

__all__ = ["config_to_dict", "check_resume_config", "check_run_meta", "check_resume_recipe", "run_recipe", "rng_state", "restore_rng"]


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


_RUN_TYPES = (("seq_len", int, "a sequence length"), ("steps", int, "a step count"), ("batch_size", int, "a batch size"),
              ("precision", str, "a precision name"), ("optim", dict, "the optimizer options (a map)"))


_KIND_NAMES = {bool: "a bool", int: "a number", float: "a number", str: "a string", list: "a list", tuple: "a list", dict: "a map"}


def check_run_meta(meta: dict, where: Path, config: Any) -> None:
    """Raise CheckpointError naming ``where`` (the ``meta.msgpack``) when the run options or the
    model config it records have the wrong type (a corrupt or hand-edited file): each of
    ``run.seq_len``/``steps``/``batch_size`` an int, ``run.precision`` a string, ``run.optim`` a
    map with a string ``name``, ``data.position`` an int in ``[0, 2**62)``, and each ``config`` field of the type this run's config has
    (an int where it has an int or a float, a list where it has a list, ...; None is allowed),
    every number in ``config`` finite and every int within +-2**53."""
    run = meta["run"]
    for key, kind, what in _RUN_TYPES:
        value = run.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise CheckpointError(f"{where} is corrupt: run.{key} is {value!r:.60}, expected {what}")
    name = (run.get("optim") or {}).get("name", "adamw")
    if not isinstance(name, str):
        raise CheckpointError(f"{where} is corrupt: run.optim.name is {name!r:.60}, expected an optimizer name")
    precision = run.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise CheckpointError(f"{where} is corrupt: run.precision is {precision!r:.60}, expected one of {PRECISIONS}")
    position = meta["data"].get("position")
    if position is not None and (not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < MAX_POSITION):
        raise CheckpointError(f"{where} is corrupt: data.position is {position!r:.60}, expected a sample count in [0, 2**62)")
    kinds = {bool: (bool,), int: (int, float), float: (int, float), str: (str,), list: (list, tuple), tuple: (list, tuple), dict: (dict,)}
    for key, now in config_to_dict(config).items():
        saved = meta["config"].get(key)
        expected = kinds.get(type(now))
        if saved is None or now is None or expected is None:
            continue
        if not isinstance(saved, expected) or (isinstance(saved, bool) and type(now) is not bool):
            raise CheckpointError(f"{where} is corrupt: config.{key} is {saved!r:.60} ({type(saved).__name__}), "
                                       f"expected {_KIND_NAMES[type(now)]} like this run's {now!r:.60}")
    for key, value in _numbers(meta["config"], "config"):
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"{where} is corrupt: {key} is {value}, expected a finite number")
        if isinstance(value, int) and not -(2**53) < value < 2**53:
            raise CheckpointError(f"{where} is corrupt: {key} is {value}, past any model size")


def _numbers(tree, path: str):
    """``(dotted path, number)`` for every int or float (not bool) in a nested map/list."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


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
