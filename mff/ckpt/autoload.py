"""``mff.load``: one entry point for every checkpoint a user brings.

- an HF model folder (``config.json`` + ``model.safetensors`` or a sharded index),
- an mff checkpoint (a run folder with ``latest``, or one ``step_XXXXXXXX`` folder),
- a ``.gguf`` file (llama.cpp; dequantised, names mapped to HF's).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mff.ckpt.checkpoint import CheckpointError, latest_step_dir, open_tensors, read_meta
from mff.ckpt.hf import config_from_hf_dict, load_hf, load_hf_tensors
from mff.model import Model
from mff.models import get_family
from mff.models.common import config_from_dict

__all__ = ["load", "load_mff", "load_gguf", "resolve_mff_step_dir", "checkpoint_kind", "tokenizer_folder"]


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"gguf"``, ``"hf"`` or ``"mff"`` for ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of the three (the message says what each needs).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ValueError(f"{p} is a file but not a GGUF file; pass an HF model folder, an mff checkpoint folder or a .gguf file")
    if (p / "config.json").is_file():
        return "hf"
    if (p / "latest").is_file() or (p / "meta.msgpack").is_file():
        return "mff"
    raise ValueError(f"{p} has no config.json (HF model folder), no latest or meta.msgpack (mff checkpoint), "
                     "and is not a .gguf file; cannot tell what it holds")


def resolve_mff_step_dir(path: str | os.PathLike) -> Path:
    """The step folder of an mff checkpoint path (a run folder's ``latest``, or the step folder)."""
    p = Path(path)
    if (p / "meta.msgpack").is_file():
        return p
    step = latest_step_dir(p)
    if step is None:
        raise CheckpointError(f"{p} has no complete checkpoint (latest names no step folder)")
    return step


def load_mff(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32):
    """``(model, params)`` from an mff checkpoint (family and config from its metadata)."""
    step = resolve_mff_step_dir(path)
    meta = read_meta(step, required=("family", "config"))
    family = get_family(meta["family"])
    cfg = config_from_dict(family.config_cls, meta["config"])
    return load_hf_tensors(open_tensors(step, meta, "model"), family, cfg, None, device, dtype, where=str(step))


def load(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32) -> tuple[Model, dict[str, torch.Tensor]]:
    """Load any supported checkpoint: ``model, params = mff.load(path)``.

    Args:
        path: an HF model folder, an mff checkpoint folder (run or step folder) or a .gguf file.
        device: where the params go.
        dtype: the params' dtype (the family's fp32 params, router weights and expert bias,
            stay fp32); None keeps the stored dtypes (FP8 weights become bf16).
    Returns:
        ``(model, params)``: a :class:`mff.model.Model` whose ``config`` is the family config,
        and its param pytree (plain tensors, no grad).
    Raises:
        FileNotFoundError: ``path`` missing, or a folder without config.json / weights.
        ValueError: unknown ``model_type`` or an unsupported config (named), a missing,
            mis-shaped (both shapes named) or unexpected tensor, a truncated file.
        CheckpointError: an incomplete mff checkpoint.
    """
    kind = checkpoint_kind(path)
    if kind == "hf":
        return load_hf(path, device, dtype)
    if kind == "mff":
        return load_mff(path, device, dtype)
    model, params, _ = load_gguf(path, device, dtype, with_tokenizer=False)
    return model, params


def load_gguf(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
              with_tokenizer: bool = True):
    """``(model, params, gguf)`` from a .gguf file in one read: ``gguf`` is the
    :class:`mff.ckpt.gguf.GGUFCheckpoint` (config, tokenizer, chat template) for callers that
    also need the tokenizer. Errors as :func:`load`."""
    from mff.ckpt.gguf import read_gguf

    g = read_gguf(path, with_tokenizer=with_tokenizer)
    family, cfg = config_from_hf_dict(g.config)
    model, params = load_hf_tensors(g.tensors, family, cfg, g.config, device, dtype, where=str(path))
    g.tensors = {}  # the params hold the weights now
    return model, params, g


def tokenizer_folder(path: str | os.PathLike) -> Path:
    """The folder holding a checkpoint's tokenizer files: an HF folder itself; for an mff
    checkpoint the step folder when it has a tokenizer.json, else the run folder (where
    pretraining keeps it)."""
    p = Path(path)
    if checkpoint_kind(p) != "mff":
        return p
    step = resolve_mff_step_dir(p)
    return step if (step / "tokenizer.json").is_file() else step.parent
