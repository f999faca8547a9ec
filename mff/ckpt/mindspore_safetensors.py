"""MindSpore and MindFormers safetensors: single files and MindFormers' sharded folders.

Format source: ``docs/mindformers_formats.md`` section 2 (MindSpore 2.10
``train/serialization.py`` ``_exec_save(format="safetensors")``; MindFormers unified /
converted weights). ``mindspore.save_checkpoint(..., format="safetensors")`` writes standard
safetensors with ``__metadata__`` ``{"format": "ms"}`` (plus ``"remove_redundancy"`` and
``"crc_num"`` when used; a tensor saved as packed ``Int4`` (qint4x2) is flagged by
``metadata[name] == "Int4"``). MindFormers folders hold shards such as
``ms-model-00001-of-00004.safetensors`` (or ``model-0000i-of-0000n``) with a name -> file map in
``param_name_map.json`` (a plain ``{name: file}`` object or ``{"weight_map": {...}}``) or an
HF-style ``*.safetensors.index.json``; ``hyper_param.safetensors`` (training state) is not in
the map and is not read. Reading goes through :class:`mff.ckpt.safetensors_io.SafetensorsFolder`
(lazy: one shard open at a time).
"""

from __future__ import annotations

import os
from collections.abc import Container
from pathlib import Path

import torch

from mff.ckpt.safetensors_io import SafetensorsFolder, read_weight_map

__all__ = ["open_mindformers_safetensors", "read_ms_safetensors", "is_ms_safetensors"]

PARAM_NAME_MAP = "param_name_map.json"


def _index_files(folder: Path) -> list[Path]:
    maps = [folder / PARAM_NAME_MAP] if (folder / PARAM_NAME_MAP).is_file() else []
    return maps + sorted(folder.glob("*.safetensors.index.json"))


def open_mindformers_safetensors(path: str | os.PathLike) -> SafetensorsFolder:
    """A lazy view (``names``, ``shape``, ``read``, ``shards``) of MindSpore / MindFormers safetensors.

    ``path`` is a ``.safetensors`` file, or a folder with ``param_name_map.json`` (preferred, as
    MindFormers' loader does), else one ``*.safetensors.index.json`` (``ms-model.safetensors.index.json``,
    ``model.safetensors.index.json``), else exactly one ``.safetensors`` file. Tensors keep the
    stored dtype (BF16 included) and names.

    Raises:
        FileNotFoundError: ``path`` missing; a folder without a map and with zero or several
            safetensors files (listed); a map naming missing shards.
        ValueError: a malformed map, a map that disagrees with the shards, several index files
            without ``param_name_map.json`` (ambiguous), a corrupt file, a tensor stored as
            packed ``Int4`` (qint4x2; not decoded by mff).
    """
    path = Path(path)
    if path.is_file():
        view = SafetensorsFolder(path.parent, files=[path.name])
    elif path.is_dir():
        maps = _index_files(path)
        if maps and maps[0].name != PARAM_NAME_MAP and len(maps) > 1:
            raise ValueError(f"{path} has several index files {[m.name for m in maps]} and no {PARAM_NAME_MAP}: "
                             "pass the folder of one checkpoint")
        if maps:
            weight_map = read_weight_map(maps[0], flat_ok=True)
            view = SafetensorsFolder(path, files=sorted(set(weight_map.values())), weight_map=weight_map, index_name=maps[0].name)
        else:
            present = sorted(p.name for p in path.glob("*.safetensors"))
            if len(present) != 1:
                raise FileNotFoundError(f"{path} has no {PARAM_NAME_MAP} and no *.safetensors.index.json, and "
                                        + (f"several safetensors files {present}: which file holds which tensor is unknown"
                                           if present else "no .safetensors file"))
            view = SafetensorsFolder(path, files=present)
    else:
        raise FileNotFoundError(f"{path} does not exist (expected a .safetensors file or a MindFormers safetensors folder)")
    int4 = sorted(k for md in view.file_metadata.values() for k, v in md.items() if v == "Int4" and k in view.file_of)
    if int4:
        raise ValueError(f"{path}: tensors stored as packed Int4 (MindSpore qint4x2) are not decoded by mff: {int4[:5]}")
    return view


def read_ms_safetensors(path: str | os.PathLike, names: Container[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (or those in ``names``) of a MindSpore safetensors file or MindFormers folder,
    read shard by shard; see :func:`open_mindformers_safetensors` for layouts and errors."""
    view = open_mindformers_safetensors(path)
    out: dict[str, torch.Tensor] = {}
    for _, handle in view.shards():
        for k in handle.keys():
            if names is None or k in names:
                out[k] = handle.get_tensor(k)
    return out


def is_ms_safetensors(path: str | os.PathLike) -> bool:
    """True when ``path`` is a safetensors file whose metadata says ``{"format": "ms"}`` (MindSpore wrote it)."""
    try:
        view = SafetensorsFolder(Path(path).parent, files=[Path(path).name])
    except (OSError, ValueError):
        return False
    return view.file_metadata[Path(path).name].get("format") == "ms"
