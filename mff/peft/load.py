"""Loading a model with LoRA adapters: a PEFT adapter folder or an mff LoRA run beside any base
checkpoint mff loads, merged into the weights or kept apart.

An mff LoRA run (``python -m mff.recipes.finetune --lora.r ...``) saves only the adapters and
their optimizer state; its metadata names the base checkpoint (``base.path``) and a fingerprint
of its weights (:func:`base_fingerprint`), so ``mff.load(run)`` finds the base again and refuses
a base that changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mff.ckpt.autoload import checkpoint_kind, resolve_mff_step_dir
from mff.ckpt.autoload import load as load_base
from mff.ckpt.checkpoint import CheckpointError, open_tensors, read_meta
from mff.model import LoRASpec, Model
from mff.nn.lora import adapter_path
from mff.peft.adapters import merge
from mff.peft.peft_format import is_peft_folder, read_peft

__all__ = ["lora_meta", "spec_from_meta", "base_fingerprint", "is_lora_run", "read_adapter", "merge_adapter", "load_model"]


def lora_meta(spec: LoRASpec) -> dict:
    """The ``lora`` entry of a LoRA run's checkpoint metadata."""
    return {"r": spec.r, "alpha": spec.alpha, "dropout": spec.dropout, "rslora": spec.rslora, "targets": list(spec.targets),
            "overrides": [list(o) for o in spec.overrides]}


def spec_from_meta(d: Mapping) -> LoRASpec:
    """Inverse of :func:`lora_meta`."""
    return LoRASpec(targets=tuple(d["targets"]), r=int(d["r"]), alpha=float(d["alpha"]), dropout=float(d.get("dropout", 0.0)),
                    rslora=bool(d.get("rslora", False)), overrides=tuple((str(p), int(r), float(a)) for p, r, a in d.get("overrides", ())))


def base_fingerprint(params: Mapping[str, torch.Tensor], spec: LoRASpec) -> str:
    """sha256 (hex, 16 digits) of the first 4096 values (fp32) of the embedding and of each of
    the first two target weights: enough to tell one base checkpoint from another."""
    h = hashlib.sha256()
    for name in ("model.embed_tokens.weight", *spec.targets[:2]):
        t = params.get(name)
        if t is None:
            continue
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().reshape(-1)[:4096].to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def is_lora_run(path: str | os.PathLike) -> bool:
    """True for an mff checkpoint (run or step folder) that holds LoRA adapters."""
    try:
        if checkpoint_kind(path) != "mff":
            return False
        return "lora" in read_meta(resolve_mff_step_dir(path))
    except (FileNotFoundError, ValueError, CheckpointError):
        return False


def _run_adapters(path: str | os.PathLike, model: Model) -> tuple[LoRASpec, dict[str, torch.Tensor], dict]:
    step = resolve_mff_step_dir(path)
    meta = read_meta(step, required=("lora", "family", "config"))
    if meta["family"] != model.family.name:
        raise CheckpointError(f"{path} holds adapters for a {meta['family']} model, the base is {model.family.name}")
    spec = spec_from_meta(meta["lora"])
    lm = model.with_lora(spec)
    src = open_tensors(step, meta, "model")
    shapes = lm.adapter_shapes()
    adapters = {}
    for name, shape in shapes.items():
        if name not in src.entries:
            raise CheckpointError(f"{step} has no tensor {name!r}")
        if src.shape(name) != tuple(shape):
            raise CheckpointError(f"{step}: {name!r} has shape {src.shape(name)}; this base needs {tuple(shape)} "
                                  "(adapters made for another base model?)")
        adapters[name] = src.read(name).float()
    extra = sorted(set(src.names) - set(shapes))
    src.close()
    if extra:
        raise CheckpointError(f"{step} has tensors that are no adapters of this base: {extra[:3]}")
    return spec, adapters, meta


def read_adapter(path: str | os.PathLike, model: Model) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """``(spec, adapters)`` from a PEFT adapter folder or an mff LoRA run, for the base ``model``
    (fp32 CPU adapters; ``model.with_lora(spec)`` runs them).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither; a PEFT folder mff cannot read (see :func:`read_peft`).
        CheckpointError: an mff run without adapters, for another family, or whose adapters do
            not fit the base (tensor and both shapes named).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"adapter {p} does not exist")
    if is_peft_folder(p):
        return read_peft(p, model)
    if is_lora_run(p):
        spec, adapters, _ = _run_adapters(p, model)
        return spec, adapters
    raise ValueError(f"adapter {p} is neither a PEFT adapter folder (adapter_config.json) nor an mff LoRA run "
                     "(a finetune --ckpt-dir trained with --lora.r)")


def _place(adapters: Mapping[str, torch.Tensor], like: torch.Tensor, same_dtype: bool) -> dict[str, torch.Tensor]:
    """The adapters on ``like``'s device; in its dtype when ``same_dtype`` (to run beside it), else fp32 (to merge)."""
    dtype = like.dtype if same_dtype and like.is_floating_point() else torch.float32
    return {k: v.to(device=like.device, dtype=dtype) for k, v in adapters.items()}


def merge_adapter(model: Model, params: Mapping[str, torch.Tensor], adapter: str | os.PathLike) -> tuple[Model, dict[str, torch.Tensor]]:
    """``(model, params)`` with the adapter at ``adapter`` merged into the weights (``W + s B A``,
    in fp32, stored in the weights' dtype). Errors as :func:`read_adapter`."""
    spec, adapters = read_adapter(adapter, model)
    lm = model.with_lora(spec)
    first = params[spec.targets[0]]
    return model, merge(lm, params, _place(adapters, first, same_dtype=False))


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
               adapter: str | os.PathLike | None = None, merged: bool = True) -> tuple[Model, dict[str, torch.Tensor]]:
    """Load any checkpoint mff reads, with LoRA adapters: ``model, params = mff.load(path)``.

    Args:
        path: an HF model folder, an mff checkpoint (a LoRA run too: its base is loaded from the
            path its metadata names, and its adapters applied), a .gguf file, or a MindSpore /
            MindFormers checkpoint with its HF config.json beside it.
        device, dtype: as :func:`mff.ckpt.autoload.load` (the adapters follow the weights).
        adapter: a PEFT adapter folder or an mff LoRA run to apply on top of ``path``.
        merged: True (default) merges the adapters into the weights and returns the plain
            model; False returns ``(model.with_lora(spec), {**base params, **adapters})``.
    Raises:
        As :func:`mff.ckpt.autoload.load` and :func:`read_adapter`; CheckpointError when a
        LoRA run's base is gone or is not the base it was trained on.
    """
    if adapter is not None and is_lora_run(path):
        raise ValueError(f"{path} is a LoRA run (it carries its own adapters); pass its base as the checkpoint and {path} as the adapter, "
                         "or leave the adapter out")
    if is_lora_run(path):
        step = resolve_mff_step_dir(path)
        meta = read_meta(step, required=("lora", "base"))
        base_path = meta["base"].get("path")
        if not base_path or not Path(base_path).exists():
            raise CheckpointError(f"{path} holds LoRA adapters of the base {base_path!r}, which does not exist here; convert the "
                                  "run on the machine that has the base, or put the base back at that path")
        model, params = load_base(base_path, device, dtype)
        spec, adapters, _ = _run_adapters(path, model)
        want = meta["base"].get("fingerprint")
        if want is not None and base_fingerprint(params, spec) != want:
            raise CheckpointError(f"{path} was trained on another version of its base {base_path} (its weights changed since)")
    else:
        model, params = load_base(path, device, dtype)
        if adapter is None:
            return model, params
        spec, adapters = read_adapter(adapter, model)
    lm = model.with_lora(spec)
    missing = [t for t in spec.targets if t not in params]
    if missing:
        raise CheckpointError(f"the adapters adapt weights the base lacks, e.g. {adapter_path(missing[0], 'A')!r}")
    like = params[spec.targets[0]]
    if merged:
        return model, merge(lm, params, _place(adapters, like, same_dtype=False))
    return lm, {**params, **_place(adapters, like, same_dtype=True)}
