"""Tables and counts shared by the GQA families (llama, qwen3, qwen3_moe, glm4, glm4_moe):
init table, sharding table, parameter and FLOP counts, and the HF ``config.json`` translation.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mff.nn.loss import count_targets as _count
from mff.nn.rope import RopeParameters

__all__ = [
    "gqa_init_table", "GQA_SHARDING_TABLE", "gqa_param_counts", "gqa_train_flops_per_token", "lm_count_targets",
    "lm_balance_count_targets", "config_from_hf", "config_to_hf", "rope_to_hf", "config_from_dict",
]


def gqa_init_table(cfg: Any) -> list[tuple[str, tuple]]:
    """Norms 1, biases and expert bias 0, residual output projections N(0, (r / sqrt(2 L))^2)
    (GPT-2's scaled init), the rest N(0, r^2) with r = ``initializer_range``."""
    std = cfg.initializer_range
    out_std = std / math.sqrt(2 * cfg.num_hidden_layers)
    return [
        ("**.e_score_correction_bias", ("zeros",)),
        ("**.*norm.weight", ("ones",)),
        ("**.bias", ("zeros",)),
        ("**.o_proj.weight", ("normal", out_std)),
        ("**.down_proj.weight", ("normal", out_std)),
        ("**.experts.down_proj", ("normal", out_std)),
        ("**", ("normal", std)),
    ]


# (path pattern, logical axis per dim); "embed" is the hidden dim that FSDP splits. The fused
# gate_up projections keep their row dim unsplit: a TP split must interleave gate and up rows.
GQA_SHARDING_TABLE = [
    ("model.embed_tokens.weight", ("vocab", "embed")),
    ("lm_head.weight", ("vocab", "embed")),
    ("**.q_proj.weight", ("heads", "embed")),
    ("**.k_proj.weight", ("heads", "embed")),
    ("**.v_proj.weight", ("heads", "embed")),
    ("**.q_proj.bias", ("heads",)),
    ("**.k_proj.bias", ("heads",)),
    ("**.v_proj.bias", ("heads",)),
    ("**.o_proj.weight", ("embed", "heads")),
    ("**.o_proj.bias", ("embed",)),
    ("**.q_norm.weight", (None,)),
    ("**.k_norm.weight", (None,)),
    ("**.mlp.gate.weight", (None, "embed")),
    ("**.mlp.gate.e_score_correction_bias", (None,)),
    ("**.experts.gate_up_proj", ("expert", None, "embed")),
    ("**.experts.down_proj", ("expert", "embed", "mlp")),
    ("**.gate_up_proj.weight", (None, "embed")),
    ("**.gate_proj.weight", ("mlp", "embed")),
    ("**.up_proj.weight", ("mlp", "embed")),
    ("**.down_proj.weight", ("embed", "mlp")),
    ("**.gate_proj.bias", ("mlp",)),
    ("**.up_proj.bias", ("mlp",)),
    ("**.down_proj.bias", ("embed",)),
    ("**.*norm.weight", ("embed",)),
]


def gqa_param_counts(cfg: Any, shapes: Mapping[str, torch.Size], expert_fraction: float = 1.0) -> dict[str, int]:
    """``total`` params and ``activated`` per token: routed experts count ``expert_fraction``
    (K / E) of their size, the output head counts, the embedding lookup does not (unless tied)."""
    total, act = 0, 0.0
    for path, shape in shapes.items():
        n = math.prod(shape)
        total += n
        if ".experts." in path:
            act += n * expert_fraction
        elif not (path == "model.embed_tokens.weight" and not cfg.tie_word_embeddings):
            act += n
    return {"total": total, "activated": int(round(act)), "total_no_mtp": total, "activated_no_mtp": int(round(act))}


def gqa_train_flops_per_token(cfg: Any, shapes: Mapping[str, torch.Size], seq_len: int, expert_fraction: float = 1.0) -> float:
    """6 x activated params + causal attention ``6 H (2 Dh) (T + 1) / 2`` per layer (PaLM appendix B)."""
    dense = gqa_param_counts(cfg, shapes, expert_fraction)["activated"]
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * 2 * cfg.head_dim * (seq_len + 1) / 2
    return 6.0 * (dense + attn)


def lm_count_targets(cfg: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"lm": targets}`` of a batch (models without a balance loss)."""
    labels = batch.get("labels")
    return {} if labels is None else {"lm": _count(labels)}


def lm_balance_count_targets(cfg: Any, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``lm`` targets and ``balance`` = tokens B*T (the Switch balance loss averages over tokens)."""
    labels = batch.get("labels")
    if labels is None:
        return {}
    return {"lm": _count(labels), "balance": torch.tensor(labels.numel(), dtype=torch.int64)}


# ------------------------------------------------------------------------------------------
# HF config.json <-> family config

_ROPE_KEYS = {f.name for f in dataclasses.fields(RopeParameters)}


def _rope_from_hf(d: Mapping[str, Any]) -> RopeParameters:
    """RoPE parameters from either generation of HF config: v5 ``rope_parameters`` (with
    ``rope_theta`` inside) or v4 ``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``),
    ``partial_rotary_factor`` inside or at the top level."""
    src: dict[str, Any] = {}
    rp = d.get("rope_parameters")
    rs = d.get("rope_scaling")
    for part in (rs, rp):
        if isinstance(part, Mapping):
            src.update(part)
    if "rope_theta" not in src and d.get("rope_theta") is not None:
        src["rope_theta"] = d["rope_theta"]
    if "partial_rotary_factor" not in src and d.get("partial_rotary_factor") is not None:
        src["partial_rotary_factor"] = d["partial_rotary_factor"]
    if "type" in src and "rope_type" not in src:
        src["rope_type"] = src["type"]
    kwargs = {k: v for k, v in src.items() if k in _ROPE_KEYS and v is not None}
    kwargs.setdefault("rope_type", "default")
    if kwargs["rope_type"] not in ("default", "yarn", "llama3"):
        raise ValueError(f"config.json: rope type {kwargs['rope_type']!r} is not supported (supported: default, yarn, llama3)")
    for k in ("rope_theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor",
              "high_freq_factor", "partial_rotary_factor"):
        if k in kwargs:
            kwargs[k] = float(kwargs[k])
    if "original_max_position_embeddings" in kwargs:
        kwargs["original_max_position_embeddings"] = int(kwargs["original_max_position_embeddings"])
    return RopeParameters(**kwargs)


def rope_to_hf(rope: RopeParameters) -> dict[str, Any]:
    """HF v5 ``rope_parameters`` holding only the keys of ``rope.rope_type``."""
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.rope_theta}
    if rope.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = rope.partial_rotary_factor
    if rope.rope_type == "yarn":
        for k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings", "truncate"):
            out[k] = getattr(rope, k)
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
    elif rope.rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            out[k] = getattr(rope, k)
    return out


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """A JSON value converted to the dataclass field's type (lists -> tuples; ints -> floats)."""
    if isinstance(value, list):
        return tuple(value)
    ann = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    if float in ann and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_from_hf(config_cls: type, d: Mapping[str, Any], aliases: Mapping[str, tuple[str, ...]] = (),
                   checks: Callable[[Mapping[str, Any]], None] | None = None) -> Any:
    """The family config ``config_cls`` from an HF ``config.json`` dict.

    Each field takes the value of the key of its own name, else of one of its ``aliases`` (e.g.
    ``num_experts`` / ``num_local_experts``); missing keys keep the class default, other keys
    are ignored. ``rope_parameters`` accepts both HF generations (see :func:`_rope_from_hf`).
    ``checks`` rejects configs asking for features mff does not implement.

    Raises:
        ValueError: ``hidden_act`` other than silu, an unsupported rope type, or what ``checks``
            rejects; the message names the key and its value.
    """
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    if checks is not None:
        checks(d)
    hints = typing.get_type_hints(config_cls)
    kwargs: dict[str, Any] = {}
    aliases = dict(aliases)
    for f in dataclasses.fields(config_cls):
        if f.name == "rope_parameters":
            kwargs[f.name] = _rope_from_hf(d)
            continue
        for key in (f.name, *aliases.get(f.name, ())):
            if key in d:
                if d[key] is None and f.name == "head_dim":
                    break
                kwargs[f.name] = _coerce(f.name, d[key], hints[f.name])
                break
    return config_cls(**kwargs)


def config_to_hf(cfg: Any, model_type: str, architecture: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """An HF v5 ``config.json`` dict of ``cfg`` (fields in ``skip`` are mff-only and left out)."""
    out: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for f in dataclasses.fields(cfg):
        if f.name in skip:
            continue
        v = getattr(cfg, f.name)
        if f.name == "rope_parameters":
            v = rope_to_hf(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def config_from_dict(config_cls: type, d: Mapping[str, Any]) -> Any:
    """Rebuild a family config from :func:`mff.recipes.common.config_to_dict` output (checkpoint
    metadata): nested ``rope_parameters`` becomes :class:`RopeParameters`, lists tuples.

    Raises:
        ValueError: a key the config class does not have.
    """
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no fields {unknown}")
    kwargs = {}
    for k, v in d.items():
        if k == "rope_parameters" and isinstance(v, Mapping):
            v = RopeParameters(**v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return config_cls(**kwargs)
