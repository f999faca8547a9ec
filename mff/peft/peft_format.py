"""Hugging Face PEFT adapter folders in and out: ``adapter_config.json`` +
``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained``.

Keys (PEFT's saved names, ``base_model.model.`` + the HF module path):

- a linear layer ``M`` (``M.weight`` [F, D]): ``M.lora_A.weight`` [r, D], ``M.lora_B.weight`` [F, r]
  (``lora.Linear``, ``target_modules``);
- stacked experts ``X.gate_up_proj`` / ``X.down_proj`` [E, F, D] (``target_parameters``,
  PEFT's ``lora.ParamWrapper``): ``lora_A.weight`` [E*r, D] expert-major (rows ``e*r .. e*r+r-1``
  are expert e's ``A``) and ``lora_B.weight`` [F, r*E] rank-major, expert-minor (column
  ``j*E + e`` is column j of expert e's ``B``), so ``delta[e] = B[:, :, e] @ A[e]`` after PEFT's
  reshapes to (E, r, D) and (F, r, E). When both weights of one experts module are targeted
  PEFT nests one wrapper in the other: the param registered first (``gate_up_proj``) is the
  inner one, saved under ``X.base_layer.lora_*``, the other under ``X.lora_*``. Checked against
  ``peft`` 0.21 itself in ``tests/test_peft_interop.py``, not taken from documentation.

The scale is PEFT's: ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``); ``rank_pattern`` /
``alpha_pattern`` give single targets their own rank and alpha (read and written). DoRA, LoRA
biases and ``modules_to_save`` are refused when read.

MoE models: PEFT 0.21 on transformers v5 rewrites ``target_modules`` entries named ``gate_proj``,
``up_proj`` or ``down_proj`` of MoE model types into the stacked experts' ``target_parameters``
(a v4 -> v5 conversion, huggingface/peft#3711, fix pending), so the dense and shared-expert MLP
projections would lose their adapters. mff therefore writes those projections of an MoE model as
``target_parameters`` (``mlp.gate_proj.weight``, ``mlp.shared_experts.up_proj.weight``): PEFT wraps
them as 2-D parameters with the same ``lora_A`` / ``lora_B`` keys and the same numerics.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from mff.ckpt.safetensors_io import write_safetensors
from mff.ckpt.staging import staged_folder
from mff.model import LoRASpec, Model
from mff.nn.lora import adapter_path
from mff.nn.moe import Experts
from mff.peft.targets import candidate_weights

__all__ = ["PEFT_PREFIX", "save_peft", "read_peft", "is_peft_folder", "PeftFormatError"]

PEFT_PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # registration order in mff and HF v5 experts modules
_MOE_RENAMED = ("gate_proj", "up_proj", "down_proj", "gate")  # target_modules names PEFT's v4 -> v5 MoE conversion rewrites


class PeftFormatError(ValueError):
    """A PEFT folder mff cannot read (the message names the file, key or setting)."""


def is_peft_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding ``adapter_config.json``."""
    return (Path(path) / CONFIG).is_file()


def _expert_modules(model: Model) -> set[str]:
    return {name for name, m in model.skeleton.named_modules() if isinstance(m, Experts)}


def _layer_suffix(path: str) -> str:
    """The path inside its decoder layer: ``model.layers.3.mlp.gate_proj.weight`` -> ``mlp.gate_proj.weight``."""
    parts = path.split(".")
    return ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else path


def _peft_pattern_value(patterns: dict, keys: list[str], default):
    r"""PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``re.match(rf"(.*\.)?({pattern})$", key)``)."""
    for pattern, value in (patterns or {}).items():
        if any(re.match(rf"(.*\.)?({pattern})$", k) for k in keys):
            return value
    return default


def _main_layer(model: Model, path: str) -> bool:
    parts = path.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) < model.config.num_hidden_layers


def _compact(chosen: list[str], universe: list[str], cut) -> list[str]:
    """Entries for PEFT's list matching (``key == t`` or ``key.endswith("." + t)``): a short
    suffix where every member of ``universe`` with that suffix is chosen, else full paths."""
    out: list[str] = []
    by_suffix: dict[str, list[str]] = {}
    for p in universe:
        by_suffix.setdefault(cut(p), []).append(p)
    chosen_set = set(chosen)
    for suffix in dict.fromkeys(cut(p) for p in chosen):
        members = by_suffix[suffix]
        if all(m in chosen_set for m in members):
            out.append(suffix)
        else:
            out += [m for m in members if m in chosen_set]
    return sorted(out)


def save_peft(model: Model, adapters: Mapping[str, torch.Tensor], out_dir: str | os.PathLike, base_model_name_or_path: str | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write ``adapters`` (mff adapter paths, plain tensors or DTensors) as a PEFT folder.

    Written into a temp folder beside ``out_dir`` and renamed into place. ``dtype`` casts the
    tensors (default: as they are).

    Raises:
        ValueError: the model has no LoRA; an adapter on a weight HF models do not have (the
            MTP layers); a missing factor.
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    spec = model.lora
    if spec is None:
        raise ValueError("the model has no LoRA adapters to save")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder for the PEFT adapter")
    shapes = model.adapter_shapes()
    missing = sorted(set(shapes) - set(adapters))
    if missing:
        raise ValueError(f"adapters lack {len(missing)} of the model's {len(shapes)} factors, e.g. {missing[:3]}")
    for name, shape in shapes.items():
        if tuple(adapters[name].shape) != tuple(shape):
            raise ValueError(f"adapter {name!r} has shape {tuple(adapters[name].shape)}, the model's LoRA slot is {tuple(shape)}")
    if out.parent.exists() and not out.parent.is_dir():
        raise FileExistsError(f"{out}: {out.parent} is a file, not a folder")
    experts = _expert_modules(model)
    mtp = [p for p in spec.targets if not _main_layer(model, p)]
    if mtp:
        raise ValueError(f"adapters on {mtp[0]!r} (an MTP layer) have no PEFT form: HF models have no MTP layers; "
                         "train without them (--lora.targets all leaves them out)")
    moe = bool(experts)
    tensors: dict[str, torch.Tensor] = {}
    linear, params, dense_params = [], [], []
    rank_pattern, alpha_pattern = {}, {}
    for path in spec.targets:
        owner, _, pname = path.rpartition(".")
        a, b = adapters[adapter_path(path, "A")], adapters[adapter_path(path, "B")]
        a, b = [(t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu") for t in (a, b)]
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        if owner in experts:
            targeted = [p for p in _EXPERT_PARAMS if f"{owner}.{p}" in spec.targets]
            depth = len(targeted) - 1 - targeted.index(pname)
            key = PEFT_PREFIX + owner + ".base_layer" * depth
            E, F, r = b.shape
            tensors[key + ".lora_A.weight"] = a.reshape(E * r, a.shape[-1]).contiguous()
            tensors[key + ".lora_B.weight"] = b.permute(1, 2, 0).reshape(F, r * E).contiguous()
            params.append(path)
            peft_key = path
        else:
            tensors[PEFT_PREFIX + owner + ".lora_A.weight"] = a.contiguous()
            tensors[PEFT_PREFIX + owner + ".lora_B.weight"] = b.contiguous()
            if moe and owner.rpartition(".")[2] in _MOE_RENAMED:
                dense_params.append(path)
                peft_key = path
            else:
                linear.append(owner)
                peft_key = owner
        if spec.rank_of(path) != spec.r or spec.scale_of(path) != spec.scale:
            rank_pattern[re.escape(peft_key)] = spec.rank_of(path)
            alpha_pattern[re.escape(peft_key)] = next(al for p, _, al in spec.overrides if p == path)
    cands = [p for p in candidate_weights(model) if _main_layer(model, p)]
    renamed = {p for p in cands if moe and p.rpartition(".")[0] not in experts and p.rpartition(".")[0].rpartition(".")[2] in _MOE_RENAMED}
    linear_universe = [p.rpartition(".")[0] for p in cands if p.rpartition(".")[0] not in experts and p not in renamed]
    param_universe = [p for p in cands if p.rpartition(".")[0] in experts or p in renamed]
    has_experts = bool(params) or bool(dense_params)
    params = params + dense_params
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": spec.r, "lora_alpha": spec.alpha, "use_rslora": spec.rslora,
        "lora_dropout": 0.0 if has_experts else spec.dropout,  # PEFT's ParamWrapper refuses dropout (inference adapters need none)
        "target_modules": _compact(linear, linear_universe, lambda p: p.rpartition(".")[2]) if linear else None,
        "target_parameters": _compact(params, param_universe, _layer_suffix) if params else None,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_dora": False,
        "modules_to_save": None, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
    with staged_folder(out) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tmp / WEIGHTS, tensors, {"format": "pt"})
    return out


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise PeftFormatError(f"{folder} has no {CONFIG}; a PEFT adapter folder holds {CONFIG} and {WEIGHTS}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PeftFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise PeftFormatError(f"{path} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise PeftFormatError(f"{path}: peft_type {cfg.get('peft_type')!r}; mff reads LoRA adapters (LORA)")
    refused = [("use_dora", bool(cfg.get("use_dora")), "DoRA"), ("bias", cfg.get("bias", "none") != "none", "trained biases"), ("lora_bias", bool(cfg.get("lora_bias")), "LoRA biases"),
               ("modules_to_save", bool(cfg.get("modules_to_save")), "fully trained modules"),
               ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")), "transposed (Conv1D) weights")]
    for key, bad, what in refused:
        if bad:
            raise PeftFormatError(f"{path}: {key}={cfg.get(key)!r} ({what}) is not supported; mff reads plain LoRA adapters")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PeftFormatError(f"{path}: r={r!r} must be an integer >= 1")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        raise PeftFormatError(f"{path}: lora_alpha={alpha!r} must be a finite number > 0")
    dropout = cfg.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise PeftFormatError(f"{path}: lora_dropout={dropout!r} must be a number in [0, 1)")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict):
            raise PeftFormatError(f"{path}: {key} must be an object of pattern -> value, got {type(patterns).__name__}")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise PeftFormatError(f"{path}: {key} holds {pattern!r}, not a regular expression ({e})") from None
    for key in ("target_modules", "target_parameters"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, (str, list)):
            raise PeftFormatError(f"{path}: {key} must be a list of names or a regex string, got {type(v).__name__}")
    return cfg


def _rank_alpha(cfg: dict, keys: list[str], r0: int, alpha0: float) -> tuple[int, float]:
    r = _peft_pattern_value(cfg.get("rank_pattern"), keys, r0)
    alpha = _peft_pattern_value(cfg.get("alpha_pattern"), keys, alpha0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise PeftFormatError(f"{CONFIG}: rank_pattern gives {keys[-1]!r} rank {r!r}; expected an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha > 0):
        raise PeftFormatError(f"{CONFIG}: alpha_pattern gives {keys[-1]!r} alpha {alpha!r}; expected a finite number > 0")
    return int(r), float(alpha)


def _targeted_params(cfg: dict, module: str) -> list[str]:
    """The expert params of ``module`` the config's ``target_parameters`` select, in registration order."""
    names = cfg.get("target_parameters") or []
    out = []
    for p in _EXPERT_PARAMS:
        key = f"{module}.{p}"
        if any(key == t or key.endswith("." + t) for t in names):
            out.append(p)
    return out


def read_peft(folder: str | os.PathLike, model: Model) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """``(spec, adapters)`` from a PEFT adapter folder, for ``model`` (the base, without LoRA):
    the targets come from the tensors in ``adapter_model.safetensors``, r / alpha / rsLoRA /
    dropout from ``adapter_config.json``; the adapters are fp32 CPU tensors at mff adapter paths.
    Use ``model.with_lora(spec)`` to run them.

    Raises:
        PeftFormatError: a missing or unreadable file, an unsupported setting (named), a key
            that is no LoRA factor of a weight this model has, or a factor whose shape does not
            fit the base weight (the tensor and both shapes named: an adapter made for another
            base model).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise PeftFormatError(f"{folder} is not a folder; a PEFT adapter is a folder with {CONFIG} and {WEIGHTS}")
    cfg = _read_config(folder)
    wpath = folder / WEIGHTS
    if not wpath.is_file():
        alt = folder / "adapter_model.bin"
        hint = " (adapter_model.bin, pickle, is not read: save it with safe_serialization=True)" if alt.is_file() else ""
        raise PeftFormatError(f"{folder} has no {WEIGHTS}{hint}")
    try:
        with safe_open(wpath, framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise PeftFormatError(f"{wpath} is not a readable safetensors file: {e}") from None
    r0, alpha0 = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    shapes = model.param_shapes()
    ranks: dict[str, tuple[int, float]] = {}
    experts = _expert_modules(model)
    linear_owners = {p.rpartition(".")[0] for p in candidate_weights(model) if p.rpartition(".")[0] not in experts}
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        which = "A" if name.endswith(".lora_A.weight") else "B" if name.endswith(".lora_B.weight") else None
        if which is None:
            raise PeftFormatError(f"{wpath}: tensor {key!r} is not a lora_A / lora_B weight (embedding adapters and other "
                                  "PEFT methods are not supported)")
        module = name[: -len(".lora_A.weight")]
        depth = 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        if module in experts:
            targeted = _targeted_params(cfg, module)
            if depth >= len(targeted):
                raise PeftFormatError(f"{wpath}: tensor {key!r} is on {module!r}, but {CONFIG} target_parameters "
                                      f"{cfg.get('target_parameters')} select {len(targeted)} of its weights")
            path = f"{module}.{targeted[len(targeted) - 1 - depth]}"
            E, F, D = shapes[path]
            r = ranks.setdefault(path, _rank_alpha(cfg, [path], r0, alpha0))[0]
            if which == "A":
                want, conv = (E * r, D), (lambda x, E=E, D=D, r=r: x.reshape(E, r, D))
            else:
                want, conv = (F, r * E), (lambda x, E=E, F=F, r=r: x.reshape(F, r, E).permute(2, 0, 1).contiguous())
        elif module in linear_owners and depth == 0:
            path = f"{module}.weight"
            F, D = shapes[path]
            r = ranks.setdefault(path, _rank_alpha(cfg, [module, path], r0, alpha0))[0]
            want, conv = ((r, D) if which == "A" else (F, r)), (lambda x: x)
        else:
            raise PeftFormatError(f"{wpath}: tensor {key!r} adapts {module!r}, which this {model.family.name} model has no "
                                  "linear layer or stacked experts for (an adapter made for another model?)")
        if tuple(t.shape) != want:
            raise PeftFormatError(f"{wpath}: tensor {key!r} has shape {tuple(t.shape)}; {path!r} {tuple(shapes[path])} with r={r} "
                                  f"needs {want} (an adapter made for another base model?)")
        factors.setdefault(path, {})[which] = conv(t.float())
    incomplete = [p for p, f in factors.items() if len(f) != 2]
    if incomplete:
        raise PeftFormatError(f"{wpath}: {incomplete[0]!r} has only lora_{next(iter(factors[incomplete[0]]))}")
    if not factors:
        raise PeftFormatError(f"{wpath} holds no LoRA tensors")
    targets = tuple(p for p in shapes if p in factors)
    overrides = tuple((p, *ranks[p]) for p in targets if ranks[p] != (r0, alpha0))
    spec = LoRASpec(targets=targets, r=r0, alpha=alpha0, dropout=float(cfg.get("lora_dropout") or 0.0),
                    rslora=bool(cfg.get("use_rslora")), overrides=overrides)
    adapters = {adapter_path(p, w): factors[p][w] for p in targets for w in "AB"}
    return spec, adapters
