"""Model families: one file each (config + named sizes, skeleton, init and sharding tables)."""

from __future__ import annotations

from typing import Any

from mff.model import Family, Model
from mff.models import deepseek3, glm4, glm4_moe, llama, qwen3, qwen3_moe, telechat3

__all__ = ["FAMILIES", "get_family", "build", "family_for_model_type"]

FAMILIES: dict[str, Family] = {
    f.name: f for f in (deepseek3.FAMILY, telechat3.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, glm4.FAMILY, glm4_moe.FAMILY, llama.FAMILY)
}


def get_family(name: str) -> Family:
    """The family called ``name``, or the one that reads HF configs of ``model_type`` ``name``
    (``deepseek_v3`` is ``deepseek3``, ``qwen2`` is ``llama``). Raises ValueError listing the
    valid names."""
    if name in FAMILIES:
        return FAMILIES[name]
    for fam in FAMILIES.values():
        if name in fam.hf_model_types:
            return fam
    aliases = sorted(t for f in FAMILIES.values() for t in f.hf_model_types if t not in FAMILIES)
    raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(FAMILIES))} "
                     f"(or an HF model_type: {', '.join(aliases)})")


def family_for_model_type(model_type: str) -> Family:
    """The family that reads HF configs with ``model_type`` (e.g. ``deepseek_v3``, ``telechat3``)."""
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unknown model_type {model_type!r}; supported: {', '.join(known)}")


def size_config(family: Family, size: str) -> Any:
    """The config of a named size. Raises ValueError listing the family's sizes."""
    try:
        return family.sizes[size]
    except KeyError:
        raise ValueError(f"unknown size {size!r} for model {family.name}; valid sizes: {', '.join(family.sizes)}") from None


def build(family: str | Family, config: Any = None, size: str | None = None) -> Model:
    """A :class:`mff.model.Model` of ``family`` with ``config`` (or the named ``size``, default
    the family's default size)."""
    fam = get_family(family) if isinstance(family, str) else family
    if config is None:
        config = size_config(fam, size or fam.default_size)
    return Model(fam, config)
