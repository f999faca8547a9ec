"""MindFormers checkpoints in and out, no MindSpore needed: MindSpore ``.ckpt`` files and
MindFormers safetensors, in the Mcore or the legacy naming, to mff params (and AdamW state) and
back.

Names and layouts: :mod:`mff.ckpt.mindformers_names` (tables from
``docs/mindformers_formats.md`` §3). Files: :mod:`mff.ckpt.mindformers_source`
and :mod:`mff.ckpt.mindspore` (§2).

What a training checkpoint holds besides weights, and what import does with it:

- ``adam_m.<name>`` / ``adam_v.<name>`` (MindFormers AdamW moments, fp32, shaped like the
  param; ``mf:core/optim/adamw.py``): with ``optimizer=True`` mapped through the same layout
  transforms into mff's AdamW state ``{"step", "exp_avg", "exp_avg_sq"}`` (step from
  ``global_step``), else skipped.
- router buffers ``*.expert_load``, ``*.fi_accu`` (§3.2, zeros, not weights) and gradient
  accumulation buffers ``accu_grads.*``: skipped, counted in a notice.
- bookkeeping entries (strings, and one-element tensors with a dot-free name: ``global_step``,
  ``epoch_num``, ``step_num``, ``loss_scale`` ...): returned as ``metadata``.
- anything else the model does not have is an error listing those names; so are missing ones.

Import streams: params are allocated once and each source tensor, read one at a time, is split
into the param regions it covers, so peak memory is the params plus one source tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mff.ckpt.mindformers_names import LegacyLayout, McoreLayout, MFTensor, legacy_tensors, mcore_tensors
from mff.ckpt.mindformers_source import MindFormersSource, layout_switches, open_source, read_model_config
from mff.ckpt.mindspore import write_ckpt
from mff.ckpt.safetensors_io import parse_size, write_safetensors
from mff.model import Family, Model, check_model_fits

__all__ = [
    "MindFormersCheckpointError", "MindFormersCheckpoint", "load_mindformers", "mindformers_tensors", "save_mindformers",
    "detect_layout", "SKIPPED_BUFFERS",
]

SKIPPED_BUFFERS = (".expert_load", ".fi_accu")
SKIPPED_PREFIXES = ("accu_grads.",)
OPTIM_SLOTS = {"adam_m.": "exp_avg", "adam_v.": "exp_avg_sq"}
_LIST = 20  # names shown in an error before "... and N more"


class MindFormersCheckpointError(ValueError):
    """A MindFormers checkpoint that does not fit the model (the message names the tensors)."""


def _names(names: list[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(names[:_LIST]) + more


@dataclass
class MindFormersCheckpoint:
    """What :func:`load_mindformers` returns.

    Attributes:
        model: the mff model (config possibly adjusted: MTP off when the file has none, untied
            head when the file's head differs from the embedding).
        params: ``{param path: tensor}`` (plain tensors, no grad).
        optimizer_state: mff AdamW state ``{"step": int64 0-d, "exp_avg": {path: T},
            "exp_avg_sq": {path: T}}`` (fp32) when asked for, else None.
        metadata: bookkeeping entries (``global_step``, ``epoch_num``, ...): python ints,
            floats and strings.
        layout: ``"mcore"`` or ``"legacy"``, and the options found.
    """

    model: Model
    params: dict[str, torch.Tensor]
    optimizer_state: dict | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    layout: McoreLayout | LegacyLayout | None = None


def _is_meta_entry(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    return dtype == "str" or ("." not in name and math.prod(shape) <= 1)


def detect_layout(names: list[str], raw_config: Mapping[str, Any] | None = None) -> McoreLayout | LegacyLayout:
    """The layout of a MindFormers checkpoint from its weight names (optimizer and bookkeeping
    entries excluded) and the MindFormers config switches.

    Legacy names start with ``model.`` (``model.tok_embeddings``, ``model.layers``...), Mcore
    names with ``embedding.`` / ``decoder.`` / ``mtp.`` / ``output_layer.`` (§3: Mcore cells use
    ``auto_prefix=False``). Within Mcore: ``linear_kvb`` = fused MLA, ``linear_q``/``gating`` =
    separate q/k/v and gate/up (inference names); the fused QKV and fc1 row layouts cannot be
    told from names and come from ``use_contiguous_weight_layout_attention`` (default False)
    and ``use_interleaved_weight_layout_mlp`` (default True). Legacy ``w_qkv`` /
    ``w_gate_hidden`` = fused Llama-family names.

    Raises:
        MindFormersCheckpointError: both kinds of names, or neither.
    """
    sw = layout_switches(raw_config)
    legacy = [n for n in names if n.startswith("model.") or n == "lm_head.weight"]
    mcore = [n for n in names if n.split(".")[0] in ("embedding", "decoder", "mtp", "output_layer")]
    if legacy and mcore:
        raise MindFormersCheckpointError(f"the checkpoint mixes legacy names ({legacy[0]!r}) and Mcore names ({mcore[0]!r})")
    if legacy and not (len(legacy) == 1 and legacy[0] == "lm_head.weight"):
        return LegacyLayout(qkv_concat=any(".attention.w_qkv." in n or ".feed_forward.w_gate_hidden." in n for n in names))
    if not mcore:
        raise MindFormersCheckpointError(f"no MindFormers weight names found (expected Mcore 'decoder.layers.*' or legacy "
                                         f"'model.layers.*'); the first names are {names[:5]}")
    qkv = "contiguous" if sw["contiguous_qkv"] else "interleaved"
    if any(n.endswith(".self_attention.linear_q.weight") for n in names):
        qkv = "separate"
    fc1 = "interleaved" if sw["interleaved_fc1"] else "contiguous"
    if any(n.endswith(".mlp.gating.weight") for n in names):
        fc1 = "separate"
    fused = not any(".self_attention.linear_kv_up_proj." in n for n in names)
    return McoreLayout(qkv=qkv, fc1=fc1, mla_fused=fused)


def mindformers_tensors(model: Model, layout: McoreLayout | LegacyLayout = McoreLayout()) -> list[MFTensor]:
    """The MindFormers tensors of ``model`` in ``layout`` (see :mod:`mff.ckpt.mindformers_names`)."""
    return legacy_tensors(model, layout) if isinstance(layout, LegacyLayout) else mcore_tensors(model, layout)


# ------------------------------------------------------------------------------------------
# import


def _adjust_config(family: Family, config: Any, source: MindFormersSource, weights: list[str], legacy: bool, where: str,
                   notices: list[str]) -> Any:
    """MTP off when the file has no MTP tensors (all or none, as :mod:`mff.ckpt.hf`); an untied
    head when the config ties the embeddings but the file holds a different head."""
    n_mtp = getattr(config, "num_nextn_predict_layers", 0)
    if n_mtp and family.name in ("deepseek3", "telechat3"):
        L = config.num_hidden_layers
        if legacy:
            has = any(n.startswith("model.mtp_hidden_fusers.") or (n.startswith("model.layers.") and int(n.split(".")[2]) >= L)
                      for n in weights)
        else:
            has = any(n.startswith("mtp.") for n in weights)
        if not has:
            notices.append(f"note: {where} has no MTP tensors (config asks for {n_mtp} MTP layer(s)); loading with MTP off")
            config = dataclasses.replace(config, num_nextn_predict_layers=0)
    head = "lm_head.weight" if legacy else "output_layer.weight"
    emb = "model.tok_embeddings.embedding_weight" if legacy else "embedding.word_embeddings.weight"
    if getattr(config, "tie_word_embeddings", False) and head in weights and emb in weights:
        got = source.read({head, emb})
        if got[head].shape != got[emb].shape or not torch.equal(got[head], got[emb]):
            notices.append(f"note: {where}: config ties the embeddings but {head} differs from {emb}; loading them untied")
            config = dataclasses.replace(config, tie_word_embeddings=False)
    return config


def load_mindformers(
    path: str | os.PathLike,
    family: str | Family | None = None,
    config: Any = None,
    *,
    config_path: str | os.PathLike | None = None,
    raw_config: Mapping[str, Any] | None = None,
    layout: McoreLayout | LegacyLayout | None = None,
    optimizer: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
) -> MindFormersCheckpoint:
    """Load a MindFormers checkpoint (a ``.ckpt`` file, a MindFormers safetensors file or
    folder) into mff params.

    The model comes from ``family`` + ``config`` (a family config object), or from
    ``config_path`` (an HF ``config.json``, MindFormers config JSON or YAML; ``family`` needed
    when it has no ``model_type``). The layout (Mcore or legacy, fused or unfused MLA...) is
    detected from the names (:func:`detect_layout`) unless ``layout`` is given.

    Args:
        dtype: the params' dtype (the family's fp32 params stay fp32); None keeps the stored dtypes.
        optimizer: also map ``adam_m.*`` / ``adam_v.*`` into mff AdamW state (error if absent).
    Returns:
        :class:`MindFormersCheckpoint`.
    Raises:
        FileNotFoundError: ``path`` or the config missing.
        ValueError: no config given, a config mff rejects (named field).
        MindFormersCheckpointError: tensors the model does not have (listed), tensors the model
            needs that are missing (listed), a tensor of the wrong shape (name and both shapes),
            a non-float weight, optimizer state asked for but absent or incomplete.
        MindSporeCheckpointError: an encrypted or damaged ``.ckpt``.
    """
    source = open_source(path)
    where = source.where
    if config is None:
        if config_path is None:
            raise ValueError(f"{where}: a MindFormers checkpoint does not name its model; pass the model config "
                             "(an HF config.json or a MindFormers config/YAML) and the model family")
        family, config, raw_config = read_model_config(config_path, family)
    elif isinstance(family, str) or family is None:
        from mff.models import get_family

        if family is None:
            raise ValueError("load_mindformers: a config object needs its family")
        family = get_family(family)

    weights, optim, meta_names, skipped = _classify(source)
    if layout is None:
        layout = detect_layout(weights, raw_config)
    legacy = isinstance(layout, LegacyLayout)
    notices: list[str] = []
    config = _adjust_config(family, config, source, weights, legacy, where, notices)
    check_model_fits(family, config, device, dtype, where)
    model = Model(family, config)
    table = {e.name: e for e in mindformers_tensors(model, layout)}
    weights = _check_weights(model, table, source, weights, legacy, notices)
    opt_want = _optimizer_plan(model, table, source, optim) if optimizer else {}
    if optim and not optimizer:
        notices.append(f"note: skipped {len(optim)} optimizer entries (adam_m.* / adam_v.*) of {where}")
    if skipped:
        notices.append(f"note: skipped {skipped} router / gradient-accumulation buffers of {where} (expert_load, fi_accu, accu_grads)")

    shapes = model.param_shapes()
    params: dict[str, torch.Tensor] = {}
    state = None
    if optimizer:  # fp32 moments of the trained params (mff AdamW's layout, mff.optim.adamw)
        trained = [p for p in shapes if model.is_trainable(p)]
        state = {"step": torch.zeros((), dtype=torch.int64)}
        state.update({slot: {p: torch.zeros(shapes[p], dtype=torch.float32, device=device) for p in trained} for slot in OPTIM_SLOTS.values()})
    if dtype is not None:  # all params allocated before the stream, so the heap does not interleave them with the read buffers
        for n in weights:
            for p in table[n].params:
                if p not in params:
                    params[p] = torch.empty(shapes[p], dtype=torch.float32 if model.is_fp32(p) else dtype, device=device)
    metadata: dict[str, Any] = {}
    for name, value in source.stream(set(weights) | set(opt_want) | set(meta_names)):
        if name in opt_want:
            slot, e = opt_want[name]
            _scatter(e, value, state[slot], name, where)
        elif name in table:
            e = table[name]
            for p in e.params:
                if p not in params:
                    target = value.dtype if dtype is None else (torch.float32 if model.is_fp32(p) else dtype)
                    params[p] = torch.empty(shapes[p], dtype=target, device=device)
            _scatter(e, value, params, name, where)
        else:
            metadata[name] = value if isinstance(value, str) else value.reshape(-1)[0].item() if value.numel() else None
        del value
    if state is not None and isinstance(metadata.get("global_step"), (int, float)):
        state["step"] = torch.tensor(int(metadata["global_step"]), dtype=torch.int64)
    for line in notices:
        print(line, file=sys.stderr)
    return MindFormersCheckpoint(model, {p: params[p] for p in shapes}, state, metadata, layout)


def _classify(source: MindFormersSource) -> tuple[list[str], list[str], list[str], int]:
    """``(weights, optimizer entries, bookkeeping entries, number of skipped buffers)``."""
    weights, optim, meta, skipped = [], [], [], 0
    for name, (dt, shape) in source.entries.items():
        if name.startswith(SKIPPED_PREFIXES) or name.endswith(SKIPPED_BUFFERS):
            skipped += 1
        elif name.startswith(tuple(OPTIM_SLOTS)):
            optim.append(name)
        elif _is_meta_entry(name, shape, dt):
            meta.append(name)
        else:
            weights.append(name)
    return weights, optim, meta, skipped


def _check_weights(model: Model, table: Mapping[str, MFTensor], source: MindFormersSource, weights: list[str], legacy: bool,
                   notices: list[str]) -> list[str]:
    """The weight names to read, after skipping GLM-4.5 MTP tensors and a tied head; raises for
    unknown (listed), missing (listed), mis-shaped (both shapes) and non-float tensors."""
    where, family, cfg = source.where, model.family.name, model.config
    if family == "glm4_moe":  # mff does not build GLM-4.5's MTP layers (nor does HF): their tensors are skipped
        mtp = [n for n in weights if n.startswith("mtp.")]
        if mtp:
            notices.append(f"note: skipped {len(mtp)} MTP tensors of {where} (mff's glm4_moe does not build MTP)")
            weights = [n for n in weights if not n.startswith("mtp.")]
    head = "lm_head.weight" if legacy else "output_layer.weight"
    if getattr(cfg, "tie_word_embeddings", False) and head in weights:  # equal to the embedding (checked by _adjust_config)
        weights = [n for n in weights if n != head]
    unknown = [n for n in weights if n not in table]
    if unknown:
        raise MindFormersCheckpointError(f"{where} has {len(unknown)} tensors the {family} model does not: {_names(unknown)}")
    missing = [n for n in table if n not in source.entries]
    if missing:
        raise MindFormersCheckpointError(f"{where} lacks {len(missing)} tensors the {family} model needs: {_names(missing)}")
    for n in weights:
        _check_shape(table[n], source.entries[n], n, family, where)
        if source.entries[n][0] not in ("Float32", "Float16", "BFloat16", "Float64"):
            raise MindFormersCheckpointError(f"{where}: tensor {n!r} has dtype {source.entries[n][0]}; expected a floating-point tensor")
    return weights


def _optimizer_plan(model: Model, table: Mapping[str, MFTensor], source: MindFormersSource, optim: list[str]) -> dict[str, tuple[str, MFTensor]]:
    """``{adam entry: (mff slot, table entry)}`` for the trained params; moments of frozen params
    (the expert bias, which MindFormers does not train either) are left out. Raises for entries
    of tensors the model lacks and for trained tensors without both moments (listed)."""
    where, family = source.where, model.family.name
    plan, bad = {}, []
    for n in optim:
        prefix = next(p for p in OPTIM_SLOTS if n.startswith(p))
        e = table.get(n[len(prefix):])
        if e is None:
            bad.append(n)
        elif all(model.is_trainable(p) for p in e.params):
            _check_shape(e, source.entries[n], n, family, where)
            plan[n] = (OPTIM_SLOTS[prefix], e)
    if bad:
        raise MindFormersCheckpointError(f"{where} has {len(bad)} optimizer entries for tensors the {family} model does not have: "
                                         f"{_names(bad)}")
    need = [p + e.name for p in OPTIM_SLOTS for e in table.values() if all(model.is_trainable(q) for q in e.params)]
    absent = [n for n in need if n not in plan]
    if absent:
        raise MindFormersCheckpointError(f"{where} lacks {len(absent)} optimizer entries the model needs (asked for the optimizer "
                                         f"state): {_names(absent)}")
    return plan


def _check_shape(e: MFTensor, entry: tuple[str, tuple[int, ...]], name: str, family: str, where: str) -> None:
    got = tuple(entry[1])
    if not e.accepts(got):
        raise MindFormersCheckpointError(f"{where}: tensor {name!r} has shape {got}, the {family} config expects {e.shape}")


@torch.no_grad()
def _scatter(e: MFTensor, value: torch.Tensor, into: Mapping[str, torch.Tensor], name: str, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise MindFormersCheckpointError(f"{where}: {name!r} holds a string, not a tensor")
    pieces = e.split(value)
    for (path, view), piece in zip(e.parts, pieces):
        view(into[path]).copy_(piece)


# ------------------------------------------------------------------------------------------
# export


def _mf_dtype(e: MFTensor, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if e.fp32:
        return torch.float32
    return dtype or t.dtype


def mindformers_state(model: Model, params: Mapping[str, torch.Tensor], layout: McoreLayout | LegacyLayout = McoreLayout(),
                      optimizer_state: Mapping | None = None, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype, Any]]:
    """``(name, shape, dtype, getter)`` of every MindFormers tensor of ``params`` (and
    ``adam_m.*`` / ``adam_v.*`` from ``optimizer_state``, fp32), each getter building its
    tensor on call (so a writer holds one at a time). Router weight and expert bias are fp32;
    the rest keep the params' dtype or take ``dtype``."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()

    entries = mindformers_tensors(model, layout)
    for e in entries:
        first = params[e.parts[0][0]]
        dt = _mf_dtype(e, first, dtype)
        yield e.name, e.shape, dt, (lambda e=e, dt=dt: e.join([view(full(params[p])) for p, view in e.parts]).to(dt).contiguous())
    if optimizer_state is None:
        return
    for prefix, slot in OPTIM_SLOTS.items():
        moments = optimizer_state[slot]
        for e in entries:
            if not all(p in moments for p in e.params):
                continue
            yield (prefix + e.name, e.shape, torch.float32,
                   lambda e=e, m=moments: e.join([view(full(m[p])) for p, view in e.parts]).float().contiguous())


def save_mindformers(
    path: str | os.PathLike,
    model: Model,
    params: Mapping[str, torch.Tensor],
    format: str = "ckpt",
    layout: McoreLayout | LegacyLayout = McoreLayout(),
    optimizer_state: Mapping | None = None,
    metadata: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> list[Path]:
    """Write mff params as a MindFormers checkpoint (Mcore names by default).

    ``format="ckpt"``: one MindSpore ``.ckpt`` file at ``path`` (what ``mindspore.load_checkpoint``
    reads), tensors built and written one at a time, ``metadata`` (e.g. ``global_step``) as
    scalar entries; with ``optimizer_state`` (mff AdamW) also ``adam_m.*`` / ``adam_v.*`` and
    ``global_step``. ``format="safetensors"``: a folder ``path`` with
    ``ms-model-0000i-of-0000n.safetensors`` (metadata ``{"format": "ms"}``) and
    ``param_name_map.json``, one shard in memory at a time; tensors only (weights and moments,
    no ``metadata`` and no step). Files are written under temp names and renamed. Returns the
    files written.

    Raises:
        ValueError: an unknown ``format``; a bad ``max_shard_size``; ``metadata`` with safetensors.
        MindFormersLayoutError: a model the layout cannot express.
    """
    if format not in ("ckpt", "safetensors"):
        raise ValueError(f"format={format!r}; expected ckpt or safetensors")
    if metadata and format == "safetensors":
        raise ValueError(f"metadata {sorted(metadata)} can only be written to a .ckpt (format='ckpt'), not to safetensors")
    items = list(mindformers_state(model, params, layout, optimizer_state, dtype))
    meta = dict(metadata or {})
    if optimizer_state is not None and "global_step" not in meta:
        meta["global_step"] = int(optimizer_state["step"])
    p = Path(path)
    if format == "ckpt":
        write_ckpt(p, ((name, get) for name, _, _, get in items), metadata=meta)
        return [p]
    limit = parse_size(max_shard_size)
    shards: list[list] = [[]]
    size = 0
    for it in items:
        n = math.prod(it[1]) * torch.empty((), dtype=it[2]).element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += n
    p.mkdir(parents=True, exist_ok=True)
    files, name_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"ms-model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(p / fname, {name: get() for name, _, _, get in shard}, {"format": "ms"})
        files.append(p / fname)
        name_map.update({name: fname for name, *_ in shard})
    tmp = p / "param_name_map.json.tmp"
    tmp.write_text(json.dumps(name_map, indent=2) + "\n")
    os.replace(tmp, p / "param_name_map.json")
    return files + [p / "param_name_map.json"]

