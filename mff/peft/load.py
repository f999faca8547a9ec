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
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from mff.ckpt.autoload import check_finite_weights, checkpoint_kind, resolve_mff_step_dir
from mff.ckpt.autoload import load as load_base
from mff.ckpt.checkpoint import CheckpointError, open_tensors, read_meta
from mff.model import LoRASpec, Model
from mff.nn.lora import adapter_path
from mff.peft.adapters import merge
from mff.peft.peft_format import is_peft_folder, read_peft

__all__ = ["lora_meta", "spec_from_meta", "base_fingerprint", "is_lora_run", "read_adapter", "run_adapters", "merge_adapter", "load_model", "load_with_text"]


def lora_meta(spec: LoRASpec) -> dict:
    """The ``lora`` entry of a LoRA run's checkpoint metadata."""
    return {"r": spec.r, "alpha": spec.alpha, "dropout": spec.dropout, "rslora": spec.rslora, "targets": list(spec.targets),
            "overrides": [list(o) for o in spec.overrides]}


def spec_from_meta(d: Mapping) -> LoRASpec:
    """Inverse of :func:`lora_meta`."""
    return LoRASpec(targets=tuple(d["targets"]), r=int(d["r"]), alpha=float(d["alpha"]), dropout=float(d.get("dropout", 0.0)),
                    rslora=bool(d.get("rslora", False)), overrides=tuple((str(p), int(r), float(a)) for p, r, a in d.get("overrides", ())))


def base_fingerprint(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex, 16 digits) over every param of the base: its path and 128 of its values (the
    first 64 and 64 spread evenly over the rest), rounded to bf16 so that the same checkpoint
    loaded in fp32 or bf16 gives the same fingerprint. Plain tensors (the weights as loaded); a
    change to any weight's sampled values, or to the set of params, changes it."""
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name]
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        flat = t.detach().reshape(-1)
        n = flat.numel()
        k = min(64, n)
        idx = torch.cat([torch.arange(k), torch.arange(k, dtype=torch.int64) * max(n - 1, 0) // max(k - 1, 1)])  # exact integers
        h.update(name.encode())
        h.update(flat[idx].to("cpu", torch.bfloat16).to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:16]


def is_lora_run(path: str | os.PathLike) -> bool:
    """True for an mff checkpoint (run or step folder) that holds LoRA adapters."""
    try:
        if checkpoint_kind(path) != "mff":
            return False
        return "lora" in read_meta(resolve_mff_step_dir(path))
    except (FileNotFoundError, ValueError, CheckpointError):
        return False


def run_adapters(path: str | os.PathLike) -> tuple[Model, dict[str, torch.Tensor], dict]:
    """``(model with its LoRA slots, adapters, metadata)`` of an mff LoRA run, without its base:
    the model (no weights) is built from the run's metadata. Raises CheckpointError as
    :func:`read_adapter`."""
    from mff.models import build, get_family
    from mff.models.common import config_from_dict

    meta = read_meta(resolve_mff_step_dir(path), required=("lora", "family", "config"))
    family = get_family(meta["family"])
    model = build(family, config_from_dict(family.config_cls, meta["config"]))
    spec, adapters, meta = _run_adapters(path, model)
    return model.with_lora(spec), adapters, meta


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
               adapter: str | os.PathLike | None = None, merged: bool = True,
               allow_non_finite: bool = False) -> tuple[Model, dict[str, torch.Tensor]]:
    """Load any checkpoint mff reads, with LoRA adapters: ``model, params = mff.load(path)``.

    Args:
        path: an HF model folder, an mff checkpoint (a LoRA run too: its base is loaded from the
            path its metadata names, and its adapters applied), a .gguf file, or a MindSpore /
            MindFormers checkpoint with its HF config.json beside it.
        device, dtype: as :func:`mff.ckpt.autoload.load` (the adapters follow the weights).
        adapter: a PEFT adapter folder or an mff LoRA run to apply on top of ``path``.
        merged: True (default) merges the adapters into the weights and returns the plain
            model; False returns ``(model.with_lora(spec), {**base params, **adapters})``.
        allow_non_finite: load base weights that hold NaN or inf (refused by default, naming
            the tensor).
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
            raise CheckpointError(f"{path} holds LoRA adapters of the base {base_path!r}, which does not exist here; put the base back "
                                  f"at that path, or load a copy of it with mff.load(BASE, adapter={str(path)!r}) (convert --src BASE "
                                  f"--adapter {path}); convert --src {path} --to peft needs no base")
        model, params = load_base(base_path, device, dtype, allow_non_finite)
        spec, adapters, _ = _run_adapters(path, model)
        want = meta["base"].get("fingerprint")
        if want is not None and base_fingerprint(params) != want:
            raise CheckpointError(f"{path} was trained on another version of its base {base_path} (its weights changed since); "
                                  f"to apply the adapters to it anyway: mff.load({str(base_path)!r}, adapter={str(path)!r})")
    else:
        model, params = load_base(path, device, dtype, allow_non_finite)
        if adapter is None:
            return model, params
        spec, adapters = read_adapter(adapter, model)
        if is_lora_run(adapter):
            want = (read_meta(resolve_mff_step_dir(adapter)).get("base") or {}).get("fingerprint")
            if want is not None and base_fingerprint(params) != want:
                print(f"note: {adapter} was trained on another base than {path} (the weights differ); applying its adapters anyway",
                      file=sys.stderr)
    if not allow_non_finite:
        check_finite_weights(adapters, str(adapter if adapter is not None else path))
    lm = model.with_lora(spec)
    missing = [t for t in spec.targets if t not in params]
    if missing:
        raise CheckpointError(f"the adapters adapt weights the base lacks, e.g. {adapter_path(missing[0], 'A')!r}")
    like = params[spec.targets[0]]
    if merged:
        return model, merge(lm, params, _place(adapters, like, same_dtype=False))
    return lm, {**params, **_place(adapters, like, same_dtype=True)}


def load_with_text(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32,
                   adapter: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None):
    """``(model, params, text)``: the checkpoint at ``path`` (any kind :func:`load_model` reads,
    ``adapter`` merged into its weights) and its :class:`mff.ckpt.tokenizer_files.TextAssets`
    (tokenizer, chat template, EOS ids), with ``tokenizer`` (a tokenizer.json) replacing its own.

    Raises:
        As :func:`load_model`; FileNotFoundError when the checkpoint has no tokenizer and none
        is given.
    """
    from mff.ckpt.autoload import load_gguf
    from mff.ckpt.tokenizer_files import load_text_assets, read_tokenizer

    if checkpoint_kind(path) == "gguf":
        model, params, g = load_gguf(path, device, dtype)
        text = load_text_assets(path, gguf=g)
        if adapter is not None:
            model, params = merge_adapter(model, params, adapter)
    else:
        model, params = load_model(path, device, dtype, adapter=adapter)  # an mff LoRA run comes merged
        text = load_text_assets(path)
    if tokenizer is not None:
        text.tokenizer = read_tokenizer(Path(tokenizer))
        text.add_eos_token_id()
    if text.tokenizer is None:
        raise FileNotFoundError(f"{path} comes with no tokenizer (no tokenizer.json); pass --tokenizer PATH")
    return model, params, text
