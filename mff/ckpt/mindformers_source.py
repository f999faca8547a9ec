"""What a MindFormers checkpoint holds and which model it is: the tensor sources (a MindSpore
``.ckpt`` file, a MindFormers safetensors file or folder) and the model config (an HF
``config.json``, a MindFormers config JSON or a MindFormers YAML).

Formats: ``/work/shared/reference/mindformers_formats.md`` §2 (``.ckpt``; read by
:mod:`mff.ckpt.mindspore`), §2 "MindSpore safetensors" (standard safetensors with
``{"format": "ms"}`` metadata; MindFormers shards ``ms-model-000NN-of-000MM.safetensors`` with
``param_name_map.json`` or ``ms-model.safetensors.index.json``), §5 (YAML ``model.model_config``
holds HF config keys plus MindFormers extras such as ``use_contiguous_weight_layout_attention``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mff.ckpt.mindspore import ckpt_names, is_mindspore_ckpt, iter_ckpt, read_ckpt
from mff.model import Family
from mff.models import family_for_model_type, get_family

__all__ = ["MindFormersSource", "open_source", "is_mindformers_checkpoint", "read_model_config", "mindformers_files"]

_ST_DTYPES = {"F64": "Float64", "F32": "Float32", "F16": "Float16", "BF16": "BFloat16", "I64": "Int64", "I32": "Int32",
              "I16": "Int16", "I8": "Int8", "U8": "UInt8", "BOOL": "Bool"}
_INDEX_FILES = ("param_name_map.json", "ms-model.safetensors.index.json")


class MindFormersSource:
    """The tensors of a MindFormers checkpoint, read one at a time.

    ``entries``: ``{name: (MindSpore dtype name, shape)}`` in file order, read without loading
    any tensor. ``stream(want)`` yields ``(name, value)`` for the names ``want`` accepts (values
    as :func:`mff.ckpt.mindspore.iter_ckpt` gives them: tensors, 0-d scalars, or ``str``);
    ``read(names)`` returns a few named tensors.
    """

    def __init__(self, kind: str, where: str, entries: dict[str, tuple[str, tuple[int, ...]]], files: list[Path]):
        self.kind, self.where, self.entries, self.files = kind, where, entries, files

    def stream(self, want: Container[str]) -> Iterator[tuple[str, torch.Tensor | str]]:
        """``(name, value)`` for each wanted entry, one in memory at a time."""
        if self.kind == "ckpt":
            for name, value in iter_ckpt(self.files[0]):
                if name in want:
                    yield name, value
            return
        for f in self.files:
            with _open_st(f) as h:
                for name in h.keys():
                    if name in want:
                        yield name, _get(h, f, name)

    def read(self, names: Container[str]) -> dict[str, torch.Tensor | str]:
        """The named entries (for a few small lookups before streaming)."""
        if self.kind == "ckpt":
            return read_ckpt(self.files[0], names=names)
        return dict(self.stream(names))


def _open_st(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise ValueError(f"{path} is not a readable safetensors file (corrupt or truncated?): {e}") from None


def _get(h, path: Path, name: str) -> torch.Tensor:
    try:
        return h.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {name!r} (file corrupt or truncated?): {e}") from None


def _st_format(path: Path) -> str | None:
    """The ``format`` metadata of a safetensors file, or None when it is not one."""
    try:
        with safe_open(str(path), framework="pt") as h:
            return (h.metadata() or {}).get("format", "")
    except Exception:
        return None


def mindformers_files(path: str | os.PathLike) -> tuple[str, list[Path]] | None:
    """``("ckpt" | "safetensors", files)`` when ``path`` is a MindFormers checkpoint, else None.

    Recognised: a MindSpore ``.ckpt`` file; a safetensors file whose metadata says
    ``{"format": "ms"}``; a folder holding exactly one ``.ckpt`` file, or MindFormers
    safetensors shards (``ms-model-*.safetensors``, ``param_name_map.json`` /
    ``ms-model.safetensors.index.json`` naming them, or ``{"format": "ms"}`` files) and no HF
    ``model.safetensors`` / index.

    Raises:
        FileNotFoundError: an index names a missing shard file.
        ValueError: a malformed index; a folder with several ``.ckpt`` files (ambiguous).
    """
    p = Path(path)
    if p.is_file():
        if is_mindspore_ckpt(p):
            return "ckpt", [p]
        if p.suffix == ".safetensors" and _st_format(p) == "ms":
            return "safetensors", [p]
        return None
    if not p.is_dir() or (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return None
    for index in _INDEX_FILES:
        if (p / index).is_file():
            return "safetensors", _index_files(p / index)
    shards = sorted(p.glob("ms-model*.safetensors")) or sorted(f for f in p.glob("*.safetensors") if _st_format(f) == "ms")
    if shards:
        return "safetensors", shards
    ckpts = sorted(f for f in p.glob("*.ckpt") if is_mindspore_ckpt(f))
    if len(ckpts) > 1:
        raise ValueError(f"{p} holds several .ckpt files ({[f.name for f in ckpts]}); pass the one to use")
    return ("ckpt", ckpts) if ckpts else None


def _index_files(index: Path) -> list[Path]:
    try:
        d = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{index} is not valid JSON: {e}") from None
    m = d.get("weight_map", d) if isinstance(d, dict) else None
    if not isinstance(m, dict) or not all(isinstance(v, str) and Path(v).name == v for v in m.values()):
        raise ValueError(f"{index} must map tensor names to shard file names in the folder")
    files = [index.parent / f for f in dict.fromkeys(m.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
    return files


def is_mindformers_checkpoint(path: str | os.PathLike) -> bool:
    """True when :func:`mindformers_files` recognises ``path`` (errors count as False)."""
    try:
        return mindformers_files(path) is not None
    except (OSError, ValueError):
        return False


def open_source(path: str | os.PathLike) -> MindFormersSource:
    """The :class:`MindFormersSource` of a ``.ckpt`` file or MindFormers safetensors file/folder.

    Raises:
        FileNotFoundError: ``path`` missing.
        ValueError: not a MindFormers checkpoint (says what is expected), a tensor stored twice.
        MindSporeCheckpointError: an encrypted, damaged or otherwise unreadable ``.ckpt``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    found = mindformers_files(p)
    if found is None:
        raise ValueError(f"{p} is not a MindSpore .ckpt file or MindFormers safetensors (a file with {{\"format\": \"ms\"}} "
                         "metadata, or a folder of ms-model-*.safetensors)")
    kind, files = found
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    if kind == "ckpt":
        for name, ttype, shape in ckpt_names(files[0]):
            entries[name] = (ttype, shape)
    else:
        for f in files:
            with _open_st(f) as h:
                for name in h.keys():
                    if name in entries:
                        raise ValueError(f"{p}: tensor {name!r} is stored twice")
                    sl = h.get_slice(name)
                    entries[name] = (_ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
    return MindFormersSource(kind, str(p), entries, files)


# ------------------------------------------------------------------------------------------
# model config

# MindFormers / Megatron spellings read when the HF key is absent
_MF_ALIASES = {"num_nextn_predict_layers": ("mtp_num_layers",)}


def _load_config_file(path: Path) -> dict:
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            d = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a mapping")
        model = d.get("model")
        mc = model.get("model_config") if isinstance(model, dict) else None
        if not isinstance(mc, dict):
            raise ValueError(f"{path} has no model: model_config: mapping (a MindFormers YAML keeps the model config there)")
        mc = dict(mc)
        if "use_legacy" in d and "use_legacy" not in mc:
            mc["use_legacy"] = d["use_legacy"]
        return mc
    try:
        d = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return d


def read_model_config(path: str | os.PathLike, family: str | Family | None = None) -> tuple[Family, Any, dict]:
    """``(family, config, raw dict)`` from an HF ``config.json``, a MindFormers config JSON or a
    MindFormers YAML (its ``model.model_config``; Mcore model configs use HF key names). The
    raw dict also carries the MindFormers layout switches (``use_contiguous_weight_layout_attention``,
    ``use_interleaved_weight_layout_mlp``, ``use_legacy``).

    ``family`` (a name like ``qwen3``) is needed when the config has no ``model_type``; when both
    are there they must agree.

    Raises:
        FileNotFoundError: ``path`` missing.
        ValueError: unreadable file, no model_type and no ``family``, a family that disagrees with
            the config's model_type, legacy YAML model keys (``num_heads``...), or a config value the
            family rejects (named).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config {p} does not exist")
    d = _load_config_file(p)
    if "num_heads" in d and "num_attention_heads" not in d:
        raise ValueError(f"{p} is a legacy MindFormers model config (num_heads, n_kv_heads, ...); pass the model's HF config.json "
                         "as --config instead")
    fam = get_family(family) if isinstance(family, str) else family
    model_type = d.get("model_type")
    if model_type:
        try:
            from_type = family_for_model_type(str(model_type))
        except ValueError:
            from_type = None
        if fam is None:
            if from_type is None:
                raise ValueError(f"{p}: model_type {model_type!r} names no mff family; pass --model")
            fam = from_type
        elif from_type is not None and from_type.name != fam.name and {from_type.name, fam.name} != {"deepseek3", "telechat3"}:
            raise ValueError(f"{p} has model_type {model_type!r} ({from_type.name}) but the model given is {fam.name}")
    if fam is None:
        raise ValueError(f"{p} has no model_type; pass --model with the model family ({', '.join(sorted(_families()))})")
    hf = dict(d)
    for key, aliases in _MF_ALIASES.items():
        for a in aliases:
            if key not in hf and a in hf:
                hf[key] = hf[a]
    if fam.from_hf_config is None:
        raise ValueError(f"model {fam.name} cannot read HF-style configs")
    cfg = fam.from_hf_config(hf)
    cfg.validate()
    return fam, cfg, d


def _families() -> list[str]:
    from mff.models import FAMILIES

    return list(FAMILIES)


def layout_switches(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """The MindFormers layout switches of a raw model config (defaults when absent)."""
    raw = raw or {}
    return {
        "contiguous_qkv": bool(raw.get("use_contiguous_weight_layout_attention", False)),
        "interleaved_fc1": bool(raw.get("use_interleaved_weight_layout_mlp", True)),
        "mla_qkv_concat": bool(raw.get("mla_qkv_concat", True)),
        "use_legacy": raw.get("use_legacy"),
        "qkv_concat": bool(raw.get("qkv_concat", False)),
    }
