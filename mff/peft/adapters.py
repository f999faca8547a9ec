"""LoRA adapters as a param pytree beside the base params: the spec, init, placements on the
mesh, merge and unmerge (pure functions; the base params are never copied or changed)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mff.model import LoRASpec, Model, path_seed
from mff.nn.lora import adapter_path, delta_weight
from mff.parallel.sharding import DEFAULT_AXIS_MAP, AxisMap, resolve_placements, shard_params
from mff.peft.config import LoraConfig
from mff.peft.targets import resolve_targets
from mff.tree import first_match

__all__ = ["lora_spec", "add_lora", "init_adapters", "adapter_sharding_table", "merge", "unmerge", "split_params"]


def lora_spec(model: Model, cfg: LoraConfig) -> LoRASpec:
    """The :class:`mff.model.LoRASpec` of ``cfg`` for ``model`` (targets resolved to weight
    paths). Raises ValueError for bad values or targets (see :func:`resolve_targets`)."""
    if isinstance(cfg.r, bool) or not isinstance(cfg.r, int):
        raise TypeError(f"LoRA r must be an int, got {cfg.r!r}")
    if cfg.alpha is not None and (isinstance(cfg.alpha, bool) or not isinstance(cfg.alpha, (int, float))):
        raise TypeError(f"LoRA alpha must be a number, got {cfg.alpha!r}")
    cfg.validate()
    if cfg.r < 1:
        raise ValueError(f"--lora.r {cfg.r} must be >= 1")
    return LoRASpec(targets=resolve_targets(model, cfg.targets), r=cfg.r, alpha=cfg.alpha_value, dropout=cfg.dropout, rslora=cfg.rslora)


def add_lora(model: Model, r: int, alpha: float | None = None, targets: tuple[str, ...] = ("all",), dropout: float = 0.0,
             rslora: bool = False) -> Model:
    """``model`` with LoRA adapters of rank ``r`` on ``targets`` (see :class:`LoraConfig`)::

        lora_model = mff.peft.add_lora(model, r=8, alpha=16)
        adapters = mff.peft.init_adapters(lora_model, seed=0)
        out = lora_model.forward({**params, **adapters}, batch)
    """
    if isinstance(targets, str):
        targets = (targets,)
    if targets is None or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"LoRA targets must be a sequence of strings (names or path patterns), got {targets!r}")
    return model.with_lora(lora_spec(model, LoraConfig(r=r, alpha=alpha, targets=tuple(targets), dropout=dropout, rslora=rslora)))


def _spec(model: Model) -> LoRASpec:
    if model.lora is None:
        raise ValueError("the model has no LoRA adapters: build it with mff.peft.add_lora or model.with_lora")
    return model.lora


def init_adapters(model: Model, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  mesh: DeviceMesh | None = None, axis_map: AxisMap = DEFAULT_AXIS_MAP) -> dict[str, torch.Tensor]:
    """Fresh adapters (trainable leaves): ``B = 0``, so the model starts as the base model, and
    ``A`` ~ U(-1/sqrt(in), 1/sqrt(in)) per expert (PEFT's default, ``kaiming_uniform_(a=sqrt(5))``
    on [r, in]), drawn per path from ``seed`` (:func:`mff.model.path_seed`) on the CPU in fp32.
    With ``mesh`` the adapters are DTensors placed as :func:`adapter_sharding_table` says.
    """
    out = {}
    for path, shape in model.adapter_shapes().items():
        if path.endswith(".lora_B"):
            t = torch.zeros(shape, dtype=torch.float32)
        else:
            bound = 1.0 / math.sqrt(shape[-1])
            t = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=torch.Generator().manual_seed(path_seed(seed, path)))
        out[path] = t.to(device=device, dtype=dtype).requires_grad_(True)
    if mesh is not None:
        out = shard_params(out, adapter_sharding_table(model), mesh, axis_map)
    return out


def adapter_sharding_table(model: Model) -> list[tuple[str, tuple]]:
    """Sharding rows for the adapters, from their base weights' rows: ``A`` keeps the weight's
    input-dim axis (row-parallel weights: ``A`` split like their columns; FSDP's ``embed``),
    ``B`` the output-dim axis (column-parallel weights: ``B`` split like their rows); the rank
    dim is never split. Stacked experts keep the ``expert`` dim on both (split by expert over
    ep)."""
    table = model.sharding_table
    rows = []
    for path in _spec(model).targets:
        hit = first_match(path, table)
        if hit is None:
            raise ValueError(f"param {path!r}: no row of the sharding table matches it")
        axes = hit[1]
        if len(axes) == 2:
            a, b = (None, axes[1]), (axes[0], None)
        else:
            a, b = (axes[0], None, axes[2]), (axes[0], axes[1], None)
        rows += [(adapter_path(path, "A"), a), (adapter_path(path, "B"), b)]
    return rows


def adapter_placements(model: Model, mesh: DeviceMesh, axis_map: AxisMap = DEFAULT_AXIS_MAP) -> dict[str, tuple]:
    """``{adapter path: placements}`` on ``mesh`` (see :func:`adapter_sharding_table`)."""
    table = adapter_sharding_table(model)
    return {p: resolve_placements(p, s, table, mesh, axis_map) for p, s in model.adapter_shapes().items()}


def split_params(params: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(base, adapters)`` of one dict holding both (adapters: the ``.lora_A`` / ``.lora_B`` paths)."""
    base, adapters = {}, {}
    for k, v in params.items():
        (adapters if k.endswith((".lora_A", ".lora_B")) else base)[k] = v
    return base, adapters


def _delta(model: Model, adapters: Mapping[str, torch.Tensor], path: str, like: torch.Tensor) -> torch.Tensor:
    a, b = adapters[adapter_path(path, "A")], adapters[adapter_path(path, "B")]
    if isinstance(a, DTensor):
        a, b = a.full_tensor(), b.full_tensor()
    d = delta_weight(a.detach().float(), b.detach().float(), _spec(model).scale_of(path))
    if isinstance(like, DTensor):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(d.to(like.device_mesh.device_type), like.device_mesh, like.placements)
    return d.to(like.device)


def _apply(model: Model, params: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], sign: float) -> dict[str, torch.Tensor]:
    spec = _spec(model)
    missing = [adapter_path(p, w) for p in spec.targets for w in "AB" if adapter_path(p, w) not in adapters]
    if missing:
        raise ValueError(f"adapters lack {len(missing)} tensors, e.g. {missing[:3]}")
    lacking = [p for p in spec.targets if p not in params]
    if lacking:
        raise ValueError(f"params lack {len(lacking)} adapted weights, e.g. {lacking[:3]}")
    for name, shape in model.adapter_shapes().items():
        if tuple(adapters[name].shape) != tuple(shape):
            raise ValueError(f"adapter {name!r} has shape {tuple(adapters[name].shape)}, the model's LoRA slot is {tuple(shape)}")
    out = dict(params)
    with torch.no_grad():
        for path in spec.targets:
            w = params[path]
            merged = (w.float() + sign * _delta(model, adapters, path, w)).to(w.dtype)
            out[path] = merged.requires_grad_(w.requires_grad)
    return out


def merge(model: Model, params: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base params with each target weight replaced by ``W + s B A`` (computed in fp32, stored in
    ``W``'s dtype); the result runs on ``model.with_lora(None)`` and equals the adapted model.
    New tensors: ``params`` and ``adapters`` are not changed.

    Raises:
        ValueError: the model has no LoRA, or ``adapters`` lack a factor.
    """
    return _apply(model, params, adapters, 1.0)


def unmerge(model: Model, merged: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`merge`: ``W - s B A`` for each target (exact up to rounding)."""
    return _apply(model, merged, adapters, -1.0)
