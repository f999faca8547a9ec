"""What a MindFormers checkpoint holds and which model it is: the tensor sources (a MindSpore
``.ckpt`` file, a MindFormers safetensors file or folder) and the model config (an HF
``config.json``, a MindFormers config JSON or a MindFormers YAML).

Formats: ``docs/mindformers_formats.md`` §2 (``.ckpt``; read by
:mod:`mff.ckpt.mindspore`), §2 "MindSpore safetensors" (standard safetensors with
``{"format": "ms"}`` metadata; MindFormers shards ``ms-model-000NN-of-000MM.safetensors`` with
``param_name_map.json`` or ``ms-model.safetensors.index.json``), §5 (YAML ``model.model_config``
holds HF config keys plus MindFormers extras such as ``use_contiguous_weight_layout_attention``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mff.ckpt.hf import read_json_object
from mff.ckpt.mindspore import ckpt_names, is_mindspore_ckpt, iter_ckpt, read_ckpt
from mff.ckpt.mindspore_safetensors import PARAM_NAME_MAP, is_ms_safetensors, open_mindformers_safetensors
from mff.ckpt.safetensors_io import SafetensorsFolder
from mff.model import Family
from mff.models import family_for_model_type, get_family

__all__ = ["MindFormersSource", "open_source", "read_model_config", "mindformers_kind", "layout_switches"]

_ST_DTYPES = {"F64": "Float64", "F32": "Float32", "F16": "Float16", "BF16": "BFloat16", "I64": "Int64", "I32": "Int32",
              "I16": "Int16", "I8": "Int8", "U8": "UInt8", "BOOL": "Bool"}


class MindFormersSource:
    """The tensors of a MindFormers checkpoint, read one at a time.

    ``entries``: ``{name: (MindSpore dtype name, shape)}`` in file order, read without loading
    any tensor. ``stream(want)`` yields ``(name, value)`` for the names in ``want`` (values as
    :func:`mff.ckpt.mindspore.iter_ckpt` gives them: tensors, 0-d scalars, or ``str``);
    ``read(names)`` returns a few named tensors.
    """

    def __init__(self, where: str, entries: dict[str, tuple[str, tuple[int, ...]]], ckpt: Path | None = None,
                 folder: SafetensorsFolder | None = None):
        self.where, self.entries, self._ckpt, self._folder = where, entries, ckpt, folder

    def stream(self, want: Container[str]) -> Iterator[tuple[str, torch.Tensor | str]]:
        """``(name, value)`` for each wanted entry, one in memory at a time."""
        if self._ckpt is not None:
            for name, value in iter_ckpt(self._ckpt):
                if name in want:
                    yield name, value
            return
        for _, handle in self._folder.shards():
            for name in handle.keys():
                if name in want:
                    yield name, handle.get_tensor(name)

    def read(self, names: Container[str]) -> dict[str, torch.Tensor | str]:
        """The named entries (for a few small lookups before streaming)."""
        if self._ckpt is not None:
            return read_ckpt(self._ckpt, names=names)
        return {n: self._folder.read(n) for n in self.entries if n in names}


def mindformers_kind(path: str | os.PathLike) -> str | None:
    """``"ckpt"`` or ``"safetensors"`` when ``path`` is a MindFormers checkpoint, else None.

    Recognised: a MindSpore ``.ckpt`` file (any file named ``*.ckpt``, so that reading it reports
    what is wrong with one that does not parse: encrypted, empty, truncated); a safetensors file with ``{"format": "ms"}``
    metadata; a folder without HF weights (``model.safetensors`` / its index) that holds
    ``param_name_map.json``, an ``ms-model*.safetensors.index.json``, a single ``{"format": "ms"}``
    safetensors file, or a single ``.ckpt`` file.
    """
    p = Path(path)
    if p.is_file():
        if p.suffix == ".ckpt" or is_mindspore_ckpt(p):
            return "ckpt"
        return "safetensors" if p.suffix == ".safetensors" and is_ms_safetensors(p) else None
    if not p.is_dir() or (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return None
    if (p / PARAM_NAME_MAP).is_file() or list(p.glob("ms-model*.safetensors.index.json")):
        return "safetensors"
    st = list(p.glob("*.safetensors"))
    if len(st) == 1 and is_ms_safetensors(st[0]):
        return "safetensors"
    return "ckpt" if len([f for f in p.glob("*.ckpt") if is_mindspore_ckpt(f)]) >= 1 else None


def open_source(path: str | os.PathLike) -> MindFormersSource:
    """The :class:`MindFormersSource` of a ``.ckpt`` file (or a folder holding one) or of
    MindFormers safetensors (file or folder; :func:`mff.ckpt.mindspore.open_mindformers_safetensors`).

    Raises:
        FileNotFoundError: ``path`` missing.
        ValueError: not a MindFormers checkpoint (says what is expected); a folder with several
            ``.ckpt`` files; what the safetensors reader raises (malformed map, corrupt file...).
        MindSporeCheckpointError: an encrypted, damaged or otherwise unreadable ``.ckpt``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    kind = mindformers_kind(p)
    if kind is None:
        raise ValueError(f"{p} is not a MindSpore .ckpt file or MindFormers safetensors (a file with {{\"format\": \"ms\"}} "
                         "metadata, or a folder with param_name_map.json)")
    if kind == "safetensors":
        view = open_mindformers_safetensors(p)
        entries = {n: (_ST_DTYPES.get(view.meta[n][0], view.meta[n][0]), tuple(view.meta[n][1])) for n in view.names}
        return MindFormersSource(str(p), entries, folder=view)
    ckpt = p
    if p.is_dir():
        found = sorted(f for f in p.glob("*.ckpt") if is_mindspore_ckpt(f))
        if len(found) > 1:
            raise ValueError(f"{p} holds several .ckpt files ({[f.name for f in found]}); pass the one to use")
        ckpt = found[0]
    entries = {name: (ttype, shape) for name, ttype, shape in ckpt_names(ckpt)}
    return MindFormersSource(str(p), entries, ckpt=ckpt)


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
        return dict(mc)
    return read_json_object(path)


def read_model_config(path: str | os.PathLike, family: str | Family | None = None) -> tuple[Family, Any, dict]:
    """``(family, config, raw dict)`` from an HF ``config.json``, a MindFormers config JSON or a
    MindFormers YAML (its ``model.model_config``; Mcore model configs use HF key names). The
    raw dict also carries the MindFormers layout switches (``use_contiguous_weight_layout_attention``,
    ``use_interleaved_weight_layout_mlp``; :func:`layout_switches`).

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
    vocab, pad = hf.get("vocab_size"), hf.get("pad_token_id")
    if isinstance(vocab, int) and isinstance(pad, int) and not 0 <= pad < vocab:
        # MindFormers configs carry the full tokenizer's pad id even for a smaller vocabulary;
        # transformers refuses an embedding padding_idx outside the vocabulary
        print(f"notice: {p}: pad_token_id {pad} is outside vocab_size {vocab}; dropped", file=sys.stderr)
        hf.pop("pad_token_id")
    cfg = fam.from_hf_config(hf)
    cfg.validate()
    return fam, cfg, d


def _families() -> list[str]:
    from mff.models import FAMILIES

    return list(FAMILIES)


def layout_switches(raw: Mapping[str, Any] | None) -> dict[str, bool]:
    """The MindFormers row-layout switches of a raw model config (their defaults when absent):
    ``contiguous_qkv`` (``use_contiguous_weight_layout_attention``, default False) and
    ``interleaved_fc1`` (``use_interleaved_weight_layout_mlp``, default True); §3.1."""
    raw = raw or {}
    return {
        "contiguous_qkv": bool(raw.get("use_contiguous_weight_layout_attention", False)),
        "interleaved_fc1": bool(raw.get("use_interleaved_weight_layout_mlp", True)),
    }
