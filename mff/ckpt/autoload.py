"""``mff.load``: one entry point for every checkpoint a user brings.

- an HF model folder (``config.json`` + ``model.safetensors`` or a sharded index),
- an mff checkpoint (a run folder with ``latest``, or one ``step_XXXXXXXX`` folder),
- a ``.gguf`` file (llama.cpp; dequantised, names mapped to HF's),
- a MindFormers checkpoint (a MindSpore ``.ckpt`` file or MindFormers safetensors, Mcore or
  legacy names; :mod:`mff.ckpt.mindformers`) with the model's HF ``config.json`` beside it (in
  the same folder), as ``python -m mff.recipes.convert --to mindspore`` writes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mff.ckpt.checkpoint import CheckpointError, latest_step_dir, open_tensors, read_meta
from mff.ckpt.hf import config_from_hf_dict, load_hf, load_hf_tensors
from mff.ckpt.mindformers_source import mindformers_kind
from mff.model import Model
from mff.models import get_family
from mff.models.common import config_from_dict

__all__ = ["load", "check_finite_weights", "load_mff", "load_gguf", "load_mindspore", "resolve_mff_step_dir", "checkpoint_kind", "tokenizer_folder"]


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"gguf"``, ``"hf"``, ``"mff"`` or ``"mindspore"`` (a MindSpore ``.ckpt`` file or
    MindFormers safetensors, file or folder) for ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of these (the message says what each needs).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        if mindformers_kind(p) is not None:
            return "mindspore"
        raise ValueError(f"{p} is a file but not a GGUF file, a MindSpore .ckpt or MindFormers safetensors file; pass an HF "
                         "model folder, an mff checkpoint folder, a .gguf file or a MindSpore/MindFormers checkpoint")
    has_hf_weights = (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    if (p / "config.json").is_file() and has_hf_weights:
        return "hf"
    if (p / "latest").is_file() or (p / "meta.msgpack").is_file():
        return "mff"
    if mindformers_kind(p) is not None:
        return "mindspore"
    if (p / "config.json").is_file():
        return "hf"
    raise ValueError(f"{p} has no config.json (HF model folder), no latest or meta.msgpack (mff checkpoint), "
                     "no .ckpt or ms-model-*.safetensors (MindSpore/MindFormers), and is not a .gguf file; cannot tell what it holds")


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
    if "lora" in meta:
        raise CheckpointError(f"{path} is a LoRA run: it holds adapters only (its base: {(meta.get('base') or {}).get('path')}); "
                              "load it with mff.load (mff.peft.load.load_model), which applies them to the base")
    family = get_family(meta["family"])
    cfg = config_from_dict(family.config_cls, meta["config"])
    return load_hf_tensors(open_tensors(step, meta, "model"), family, cfg, None, device, dtype, where=str(step))


def check_finite_weights(params: dict[str, torch.Tensor], where: str) -> None:
    """Refuse weights that hold NaN or inf: one sum per floating-point tensor (in fp32, so a
    non-finite value makes it non-finite; bf16/fp16 are summed in fp32, so legitimate values do
    not overflow it) and one host sync for all of them; about 0.04 s per GB on 2 CPU cores.

    Raises:
        ValueError: naming the first such tensor and how many of its values are NaN or inf.
    """
    names = [k for k, t in params.items() if t.is_floating_point() and t.numel()]
    if not names:
        return
    sums = torch.stack([params[k].sum(dtype=torch.float32) for k in names])
    bad = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    for i in bad:
        t = params[names[i]]
        n = int((~torch.isfinite(t)).sum())
        if not n:  # only the fp32 sum overflowed: values near 1e38, finite
            continue
        if t.dtype == torch.float16 and not bool(torch.isnan(t).any()):
            raise ValueError(f"{where}: tensor {names[i]} holds inf in float16 ({n:,} of {t.numel():,} values): values past 65504, "
                             "float16's largest, overflow when cast to it (or the checkpoint holds inf); load it in float32 or bfloat16")
        raise ValueError(f"{where}: tensor {names[i]} holds NaN or inf ({n:,} of {t.numel():,} values); the checkpoint is "
                         "corrupt (mff.load(..., allow_non_finite=True) loads it anyway)")


def load(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
         allow_non_finite: bool = False) -> tuple[Model, dict[str, torch.Tensor]]:
    """Load any supported checkpoint: ``model, params = mff.load(path)``.

    Args:
        path: an HF model folder, an mff checkpoint folder (run or step folder), a .gguf file, or a
            MindSpore ``.ckpt`` / MindFormers safetensors checkpoint with the HF config.json beside it.
        device: where the params go.
        dtype: the params' dtype (the family's fp32 params, router weights and expert bias,
            stay fp32); None keeps the stored dtypes (FP8 weights become bf16).
        allow_non_finite: load weights that hold NaN or inf (refused by default:
            :func:`check_finite_weights`).
    Returns:
        ``(model, params)``: a :class:`mff.model.Model` whose ``config`` is the family config,
        and its param pytree (plain tensors, no grad).
    Raises:
        FileNotFoundError: ``path`` missing, or a folder without config.json / weights.
        ValueError: unknown ``model_type`` or an unsupported config (named), a missing,
            mis-shaped (both shapes named) or unexpected tensor, a truncated file, a tensor
            holding NaN or inf (named).
        CheckpointError: an incomplete mff checkpoint.
    """
    kind = checkpoint_kind(path)
    if kind == "hf":
        model, params = load_hf(path, device, dtype)
    elif kind == "mff":
        model, params = load_mff(path, device, dtype)
    elif kind == "mindspore":
        model, params = load_mindspore(path, device=device, dtype=dtype)
    else:
        model, params, _ = load_gguf(path, device, dtype, with_tokenizer=False, allow_non_finite=True)
    if not allow_non_finite:
        check_finite_weights(params, str(path))
    return model, params


def load_gguf(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
              with_tokenizer: bool = True, allow_non_finite: bool = False):
    """``(model, params, gguf)`` from a .gguf file in one read: ``gguf`` is the
    :class:`mff.ckpt.gguf.GGUFCheckpoint` (config, tokenizer, chat template) for callers that
    also need the tokenizer. Errors as :func:`load`."""
    from mff.ckpt.gguf import read_gguf

    g = read_gguf(path, with_tokenizer=with_tokenizer)
    family, cfg = config_from_hf_dict(g.config)
    model, params = load_hf_tensors(g.tensors, family, cfg, g.config, device, dtype, where=str(path))
    g.tensors = {}  # the params hold the weights now
    if not allow_non_finite:
        check_finite_weights(params, str(path))
    return model, params, g


def load_mindspore(path: str | os.PathLike, family: str | None = None, config: str | os.PathLike | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32):
    """``(model, params)`` from a MindSpore ``.ckpt`` or MindFormers safetensors checkpoint.

    The model config is ``config`` (an HF config.json, a MindFormers config JSON or YAML) or else
    the ``config.json`` in the checkpoint's folder; ``family`` (e.g. ``qwen3``) is needed when the
    config has no ``model_type``. Errors as :func:`mff.ckpt.mindformers.load_mindformers`, and
    ValueError when there is no config.
    """
    from mff.ckpt.mindformers import load_mindformers

    p = Path(path)
    if config is None:
        beside = (p if p.is_dir() else p.parent) / "config.json"
        if not beside.is_file():
            raise ValueError(f"{p} is a MindSpore/MindFormers checkpoint, which does not name its model: put the model's HF "
                             f"config.json beside it ({beside}), or convert it with python -m mff.recipes.convert --src {p} "
                             "--model FAMILY --config CONFIG")
        config = beside
    ck = load_mindformers(p, family, config_path=config, device=device, dtype=dtype)
    return ck.model, ck.params


def tokenizer_folder(path: str | os.PathLike) -> Path:
    """The folder holding a checkpoint's tokenizer files: an HF folder itself; for an mff
    checkpoint the step folder when it has a tokenizer.json, else the run folder (where
    pretraining keeps it); for a MindSpore/MindFormers checkpoint file its folder."""
    p = Path(path)
    kind = checkpoint_kind(p)
    if kind == "mindspore" and p.is_file():
        return p.parent
    if kind != "mff":
        return p
    step = resolve_mff_step_dir(p)
    return step if (step / "tokenizer.json").is_file() else step.parent
