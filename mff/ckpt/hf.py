"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single or sharded).

Names: mff param paths are HF's in-memory (v5) names, so most tensors map one to one. The
differences are the checkpoint layouts HF converts on load:

- routed experts: mff stacks them (``mlp.experts.gate_up_proj`` [E, 2I, D], gate rows then up
  rows, and ``mlp.experts.down_proj`` [E, D, I]); checkpoints store one tensor per expert
  (``mlp.experts.{e}.gate_proj.weight`` ...), which is also what HF v5's ``save_pretrained``
  writes. Both layouts load; :func:`save_hf` writes per-expert tensors.
- DeepSeek-V3 MTP layers (``model.layers.{num_hidden_layers + k}``): loaded when all are there;
  a folder with none (what ``save_pretrained`` writes) loads with MTP off and one notice; a
  folder with only some is an error. GLM-4.5's MTP layers are skipped with a notice (mff does
  not build them, nor does HF).
- DeepSeek-V3 FP8 weights (``weight_scale_inv``) are dequantised (:mod:`mff.ckpt.fp8`).
- ``*.rotary_emb.inv_freq`` buffers of old checkpoints are ignored; ``lm_head.weight`` is
  ignored when the embeddings are tied.

Reading streams one shard at a time into preallocated params, so peak memory stays near the
model's size plus one shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mff.ckpt import fp8
from mff.ckpt.safetensors_io import SafetensorsFolder, write_sharded
from mff.ckpt.staging import staged_folder
from mff.model import Family, Model, check_model_fits
from mff.models import family_for_model_type

if TYPE_CHECKING:
    from mff.ckpt.shards import ShardedTensors

__all__ = ["read_hf_config", "config_from_hf_dict", "load_hf_tensors", "load_hf", "save_hf", "hf_tensor_names", "HFCheckpointError"]


class HFCheckpointError(ValueError):
    """A checkpoint that cannot be loaded as the model it claims to be (message names the tensor)."""


_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<which>gate_up_proj|down_proj)$")
_IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq$"),)


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object (a dict) stored in the file ``path``.

    Raises:
        ValueError: the file is not valid JSON, or holds something other than an object.
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(d).__name__}")
    return d


def read_hf_config(folder: str | os.PathLike) -> dict:
    """``config.json`` of an HF model folder as a dict.

    Raises:
        FileNotFoundError: ``folder`` is missing or has no config.json.
        ValueError: config.json is not a JSON object with a ``model_type``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; an HF model folder needs config.json and safetensors weights")
    d = read_json_object(path)
    if not d.get("model_type"):
        raise ValueError(f"{path} has no model_type; cannot tell which architecture it is")
    return d


def config_from_hf_dict(d: Mapping[str, Any]) -> tuple[Family, Any]:
    """The family and its config for an HF config dict.

    Raises:
        ValueError: unknown ``model_type`` (lists the supported ones), or a config the family
            rejects (names the field).
    """
    family = family_for_model_type(str(d["model_type"]))
    if family.from_hf_config is None:
        raise ValueError(f"family {family.name} cannot read HF configs")
    cfg = family.from_hf_config(dict(d))
    cfg.validate()
    return family, cfg


def _per_expert_names(prefix: str, which: str, E: int) -> list[str]:
    if which == "gate_up_proj":
        return [f"{prefix}.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj")]
    return [f"{prefix}.{e}.down_proj.weight" for e in range(E)]


def hf_tensor_names(model: Model) -> dict[str, list[tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]]:
    """Per mff param path, its per-expert checkpoint tensors: ``[(name, shape, view of the
    param receiving it)]``. Params that map one to one are absent."""
    out = {}
    for path, shape in model.param_shapes().items():
        m = _EXPERT_RE.match(path)
        if not m:
            continue
        E, rows, cols = shape
        entries = []
        if m["which"] == "gate_up_proj":
            inter = rows // 2
            for e in range(E):
                entries.append((f"{m['prefix']}.{e}.gate_proj.weight", (inter, cols), lambda t, e=e, i=inter: t[e, :i]))
                entries.append((f"{m['prefix']}.{e}.up_proj.weight", (inter, cols), lambda t, e=e, i=inter: t[e, i:]))
        else:
            for e in range(E):
                entries.append((f"{m['prefix']}.{e}.down_proj.weight", (rows, cols), lambda t, e=e: t[e]))
        out[path] = entries
    return out


def _mtp_paths(model: Model) -> list[str]:
    L = model.config.num_hidden_layers
    return [p for p in model.param_shapes() if p.startswith("model.layers.") and int(p.split(".")[2]) >= L]


def _checkpoint_names_for(model: Model, params: list[str], available: set[str]) -> set[str]:
    expert = hf_tensor_names(model)
    names = set()
    for p in params:
        if p in expert and p not in available:
            names.update(n for n, _, _ in expert[p])
        else:
            names.add(p)
    return names


class _DictSource:
    """In-memory tensors (e.g. from GGUF) behaving like a one-shard folder."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self.names = list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def shards(self):
        yield "<memory>", self

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name):
        return self.tensors[name]

    def read(self, name):
        return self.tensors[name]


def load_hf_tensors(
    source: SafetensorsFolder | ShardedTensors | Mapping[str, torch.Tensor],
    family: Family,
    config: Any,
    hf_config: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
    where: str = "checkpoint",
) -> tuple[Model, dict[str, torch.Tensor]]:
    """Build ``family``/``config`` and fill its params from checkpoint tensors.

    ``dtype`` None keeps each tensor's stored dtype (FP8 weights become bf16); otherwise params
    are cast to ``dtype`` except the family's fp32 params. Params come back without grad.

    Raises:
        HFCheckpointError: a missing tensor, a tensor of the wrong shape (both shapes named),
            tensors the model does not have (listed), only some of the MTP layers, FP8 weights
            without a quantization_config.
    """
    check_model_fits(family, config, device, dtype, where)  # before anything is built or read
    src = source if hasattr(source, "shards") else _DictSource(source)  # a folder-like source, or a plain Mapping
    available = set(src.names)
    hf_config = hf_config or {}
    model = Model(family, config)
    notices = []

    # DeepSeek-V3 MTP: all, none (load with MTP off) or some (error)
    n_mtp = getattr(config, "num_nextn_predict_layers", 0)
    if n_mtp and family.name in ("deepseek3", "telechat3"):
        mtp = _mtp_paths(model)
        wanted = _checkpoint_names_for(model, mtp, available)
        have = wanted & available
        if not have:
            config = dataclasses.replace(config, num_nextn_predict_layers=0)
            model = Model(family, config)
            notices.append(f"note: {where} has no MTP tensors (config asks for {n_mtp} MTP layer(s)); loading with MTP off")
        elif have != wanted:
            missing = sorted(wanted - have)
            raise HFCheckpointError(f"{where} holds only some MTP tensors; missing {len(missing)}, e.g. {missing[:5]}")

    # tied config, but the folder holds a head that differs from the embedding: HF then keeps
    # the two apart (and warns); so does mff
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in available and "model.embed_tokens.weight" in available:
        head, emb = src.read("lm_head.weight"), src.read("model.embed_tokens.weight")
        if head.shape != emb.shape or not torch.equal(head, emb):
            config = dataclasses.replace(config, tie_word_embeddings=False)
            model = Model(family, config)
            notices.append(f"note: {where}: config ties the embeddings but lm_head.weight differs from model.embed_tokens.weight; "
                           "loading them untied (as transformers does)")
        del head, emb

    block = fp8.block_size_from_config(dict(hf_config))
    expert = hf_tensor_names(model)
    shapes = model.param_shapes()
    # destination of every checkpoint tensor: (param path, view fn, expected shape)
    dest: dict[str, tuple[str, Callable | None, tuple[int, ...]]] = {}
    for path, shape in shapes.items():
        if path in expert and path not in available:
            for name, sub_shape, view in expert[path]:
                dest[name] = (path, view, sub_shape)
        else:
            dest[path] = (path, None, tuple(shape))

    def param_dtype(path: str, stored: torch.dtype, dequantised: bool) -> torch.dtype:
        if dtype is None:
            return torch.bfloat16 if dequantised else stored
        return torch.float32 if model.is_fp32(path) else dtype

    L = config.num_hidden_layers
    skipped_mtp = 0
    unknown = []
    for name in src.names:
        if name in dest:
            continue
        if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] in dest:
            continue
        if any(r.match(name) for r in _IGNORED):
            continue
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        parts = name.split(".")
        if family.name == "glm4_moe" and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= L:
            skipped_mtp += 1
            continue
        unknown.append(name)
    if unknown:
        raise HFCheckpointError(f"{where} has {len(unknown)} tensors the {family.name} model does not: {sorted(unknown)[:8]}")
    missing = sorted(set(dest) - available)
    if missing:
        raise HFCheckpointError(f"{where} lacks {len(missing)} tensors the {family.name} model needs, e.g. {missing[:8]}")
    if skipped_mtp:
        notices.append(f"note: skipped {skipped_mtp} MTP tensors of {where} (layers >= {L}; mff's glm4_moe does not build MTP)")
    for name in dest:
        got = tuple(src.shape(name))
        if got != dest[name][2]:
            raise HFCheckpointError(f"{where}: tensor {name!r} has shape {got}, the model expects {dest[name][2]}")

    params: dict[str, torch.Tensor] = {}
    for _, handle in src.shards():
        for name in handle.keys():
            if name not in dest:
                continue
            path, view, _ = dest[name]
            t = handle.get_tensor(name)
            dequantised = False
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (block and t.dtype == torch.uint8):
                scale_name = name + "_scale_inv"
                if not name.endswith(".weight") or block is None or scale_name not in available:
                    why = ("the checkpoint has no fp8 quantization_config (config.json quantization_config.weight_block_size)"
                           if block is None else f"there is no {scale_name!r}")
                    raise HFCheckpointError(f"{where}: {name!r} is stored as {t.dtype}, which mff dequantises only as an "
                                            f"X.weight with X.weight_scale_inv; {why}")
                t = fp8.dequantize_block_fp8(t, src.read(scale_name), block, torch.float32, name=name)
                dequantised = True
            elif not t.is_floating_point():
                raise HFCheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}; expected a floating-point tensor")
            elif name + "_scale_inv" in available:
                raise HFCheckpointError(f"{where}: {name + '_scale_inv'!r} scales {name!r}, which is stored as {t.dtype}, "
                                        "not FP8; the checkpoint is inconsistent")
            if path not in params:
                params[path] = torch.empty(shapes[path], dtype=param_dtype(path, t.dtype, dequantised), device=device)
            target = params[path] if view is None else view(params[path])
            with torch.no_grad():
                target.copy_(t)
            del t
    for line in notices:
        print(line, file=sys.stderr)
    return model, {p: params[p] for p in shapes}


def load_hf(folder: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = torch.float32):
    """``(model, params)`` from an HF model folder (config.json + safetensors). See
    :func:`load_hf_tensors` for the errors and the dtype rule."""
    d = read_hf_config(folder)
    family, cfg = config_from_hf_dict(d)
    return load_hf_tensors(SafetensorsFolder(folder), family, cfg, d, device, dtype, where=str(folder))


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_state_names(model: Model, params: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype, Callable[[], torch.Tensor]]]:
    """The checkpoint tensors of ``params`` in HF's on-disk layout (experts one per tensor):
    ``[(name, shape, dtype, getter)]``, getters returning views of the params."""
    expert = hf_tensor_names(model)
    out = []
    for path in model.param_shapes():
        t = params[path]
        if path in expert:
            for name, shape, view in expert[path]:
                out.append((name, torch.Size(shape), t.dtype, lambda t=t, view=view: view(t)))
        else:
            out.append((path, t.shape, t.dtype, lambda t=t: t))
    return out


def save_hf(model: Model, params: Mapping[str, torch.Tensor], out_dir: str | os.PathLike, max_shard_size: int | str = "5GB",
            progress: Callable[[int], None] | None = None, extra_files: Mapping[str, str] | None = None) -> Path:
    """Write an HF model folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads:
    ``config.json`` and safetensors shards (experts one tensor per expert, as HF stores them),
    plus ``extra_files`` (name -> text, e.g. ``tokenizer.json``, written as UTF-8). Without a
    ``generation_config.json`` among them, one is written from the config's ``bos_token_id`` /
    ``eos_token_id`` / ``pad_token_id`` when it sets any (as ``save_pretrained`` does).

    Written into a temp folder beside ``out_dir`` and renamed into place, so ``out_dir`` is
    never half-written. Params may be DTensors (gathered) or plain tensors on any device.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        ValueError: the family has no HF config mapping; a param missing from ``params``.
    """
    from torch.distributed.tensor import DTensor

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder")
    if model.family.to_hf_config is None:
        raise ValueError(f"family {model.family.name} has no HF config mapping")
    missing = [p for p in model.param_shapes() if p not in params]
    if missing:
        raise ValueError(f"params lack {len(missing)} paths of the model, e.g. {missing[:5]}")
    cpu = {}
    for p in model.param_shapes():
        t = params[p].detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        cpu[p] = t.to("cpu")
    hf = model.family.to_hf_config(model.config)
    dtypes = {t.dtype for t in cpu.values()}
    main = max(dtypes, key=lambda dt: sum(t.numel() for t in cpu.values() if t.dtype == dt))
    hf["dtype"] = _DTYPE_NAMES.get(main, "float32")
    items = hf_state_names(model, cpu)
    getters = {name: get for name, _, _, get in items}
    extra = dict(extra_files or {})
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    if gen and "generation_config.json" not in extra:
        extra["generation_config.json"] = json.dumps(gen, indent=2) + "\n"
    with staged_folder(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        for name, text in extra.items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_sharded(tmp, [(n, s, d) for n, s, d, _ in items], lambda n: getters[n](), max_shard_size,
                      metadata={"format": "pt"}, progress=progress)
    return out
