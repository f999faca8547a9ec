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
    "gqa_init_table", "scaled_init_table", "gqa_sharding_table", "gqa_param_counts", "gqa_train_flops_per_token", "lm_count_targets",
    "lm_balance_count_targets", "config_from_hf", "config_to_hf", "rope_to_hf", "config_from_dict",
]


def gqa_init_table(cfg: Any) -> list[tuple[str, tuple]]:
    """:func:`scaled_init_table` over the model's ``num_hidden_layers``."""
    return scaled_init_table(cfg.initializer_range, cfg.num_hidden_layers)


def scaled_init_table(std: float, num_layers: int) -> list[tuple[str, tuple]]:
    """Norms 1, biases and expert bias 0, residual output projections N(0, (std / sqrt(2 L))^2)
    with L = ``num_layers`` (GPT-2's scaled init), the rest N(0, std^2)."""
    out_std = std / math.sqrt(2 * num_layers)
    return [
        ("**.e_score_correction_bias", ("zeros",)),
        ("**.*norm.weight", ("ones",)),
        ("**.bias", ("zeros",)),
        ("**.o_proj.weight", ("normal", out_std)),
        ("**.down_proj.weight", ("normal", out_std)),
        ("**.experts.down_proj", ("normal", out_std)),
        ("**", ("normal", std)),
    ]


def gqa_sharding_table(cfg: Any) -> list[tuple[str, tuple]]:
    """(path pattern, logical axis per dim) of the GQA families. ``embed`` is the hidden dim
    FSDP splits; ``heads`` dims split in whole heads of ``head_dim`` rows, ``mlp`` the MLP
    width and ``vocab`` the vocabulary (tensor parallelism: q/k/v and gate/up column-parallel,
    o and down row-parallel, see :mod:`mff.parallel.tp`). GLM-4's fused ``gate_up_proj`` is
    stored split by rows and computed as :class:`mff.nn.mlp.FusedGatedMLP` says. Routed experts
    are not tensor-parallel: their ``mlp`` dims stay whole (None), so every tp rank computes
    them in full from the same tokens."""
    heads = ("heads", cfg.head_dim)
    return [
        ("model.embed_tokens.weight", ("vocab", "embed")),
        ("lm_head.weight", ("vocab", "embed")),
        ("**.q_proj.weight", (heads, "embed")),
        ("**.k_proj.weight", (heads, "embed")),
        ("**.v_proj.weight", (heads, "embed")),
        ("**.q_proj.bias", (heads,)),
        ("**.k_proj.bias", (heads,)),
        ("**.v_proj.bias", (heads,)),
        ("**.o_proj.weight", ("embed", heads)),
        ("**.o_proj.bias", ("embed",)),
        ("**.q_norm.weight", (None,)),
        ("**.k_norm.weight", (None,)),
        ("**.mlp.gate.weight", (None, "embed")),
        ("**.mlp.gate.e_score_correction_bias", (None,)),
        ("**.experts.gate_up_proj", ("expert", None, "embed")),
        ("**.experts.down_proj", ("expert", "embed", None)),
        ("**.gate_up_proj.weight", ("mlp", "embed")),
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
# what each rope type needs in config.json (HF raises without them, so does mff)
_ROPE_REQUIRED = {"yarn": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _typed(where: str, key: str, value: Any, annotation: Any) -> Any:
    """``value`` from JSON checked against a config field's annotation and converted (lists to
    tuples, ints to floats for float fields). Raises ValueError naming the key, the value and
    the expected type; bools are never accepted as numbers, nor strings as anything else."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _typed(where, key, value, opt)
            except ValueError:
                continue
        raise ValueError(f"{where}: {key}={value!r} must be {' or '.join(_type_name(o) for o in options)}")
    if origin is typing.Literal:
        if value not in typing.get_args(annotation):
            raise ValueError(f"{where}: {key}={value!r} is not supported (expected one of {list(typing.get_args(annotation))})")
        return value
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: {key}={value!r} must be a list of {_type_name(item)}")
        return tuple(_typed(where, f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key}={value!r} must be true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {key}={value!r} must be an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key}={value!r} must be a number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key}={value!r} must be a string")
        return value
    if annotation is RopeParameters:
        if isinstance(value, RopeParameters):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: {key}={value!r} must be an object of RoPE parameters")
        return _rope_from_dict(where, dict(value))
    return value


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is tuple:
        return f"a list of {_type_name(typing.get_args(t)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(t, str(t))


def _rope_from_dict(where: str, src: dict) -> RopeParameters:
    hints = typing.get_type_hints(RopeParameters)
    kwargs = {k: _typed(where, f"rope_parameters.{k}", v, hints[k]) for k, v in src.items() if k in _ROPE_KEYS and v is not None}
    kwargs.setdefault("rope_type", "default")
    missing = [k for k in _ROPE_REQUIRED.get(kwargs["rope_type"], ()) if k not in kwargs]
    if missing:
        raise ValueError(f"{where}: rope type {kwargs['rope_type']!r} needs {missing} in rope_parameters / rope_scaling")
    return RopeParameters(**kwargs)


def _rope_from_hf(d: Mapping[str, Any], partial_rotary: bool, defaults: RopeParameters = RopeParameters(),
                  max_position_embeddings: int = 4096) -> RopeParameters:
    """RoPE parameters from either generation of HF config: v5 ``rope_parameters`` (with
    ``rope_theta`` inside) or v4 ``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``),
    ``partial_rotary_factor`` inside or at the top level (read only by families that use it,
    as HF does).

    A non-empty ``rope_scaling`` replaces ``rope_parameters`` whole, as in transformers 5
    (``convert_rope_params_to_dict``). A key the config leaves out means what it means to
    transformers (``PreTrainedConfig.standardize_rope_params`` and ``modeling_rope_utils``): ``rope_theta`` and
    ``partial_rotary_factor`` take the family's defaults (``defaults``: GLM-4's 0.5, ...);
    YaRN and llama3 without ``original_max_position_embeddings`` take a top-level
    ``original_max_position_embeddings`` if there is one, else ``max_position_embeddings``; YaRN
    without ``mscale`` derives its cos/sin factor from ``factor`` alone (stored as mscale 0).
    """
    src: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        part = d.get(key)
        if part is not None and not isinstance(part, Mapping):
            raise ValueError(f"config.json: {key}={part!r} must be an object (e.g. {{\"rope_type\": \"yarn\", \"factor\": 4.0}})")
    rp, rs = d.get("rope_parameters"), d.get("rope_scaling")
    # transformers (PreTrainedConfig.convert_rope_params_to_dict): a non-empty rope_scaling replaces
    # rope_parameters whole, whatever its type; rope_theta and partial_rotary_factor then come from the top level
    block = rs if isinstance(rs, Mapping) and rs else rp if isinstance(rp, Mapping) else {}
    src.update(block)
    if src.get("rope_theta") is None:
        src["rope_theta"] = d["rope_theta"] if d.get("rope_theta") is not None else defaults.rope_theta
    if not partial_rotary:
        src.pop("partial_rotary_factor", None)
    elif src.get("partial_rotary_factor") is None:
        # a top-level key wins over the family default even when null (null: the whole head rotates)
        top = d["partial_rotary_factor"] if "partial_rotary_factor" in d else defaults.partial_rotary_factor
        src["partial_rotary_factor"] = 1.0 if top is None else top
    if "type" in src and "rope_type" not in src:
        src["rope_type"] = src["type"]
    rope_type = src.get("rope_type", "default")
    if rope_type not in ("default", "yarn", "llama3"):
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (supported: default, yarn, llama3)")
    if rope_type in ("yarn", "llama3"):
        if d.get("original_max_position_embeddings") is not None:  # HF gives a top-level one priority (Phi-3's layout)
            src["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        elif src.get("original_max_position_embeddings") is None:
            mpe = d.get("max_position_embeddings")
            src["original_max_position_embeddings"] = mpe if mpe is not None else max_position_embeddings
    if rope_type == "yarn" and src.get("mscale") is None:
        src["mscale"] = 0.0
    return _rope_from_dict("config.json", src)


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


def config_from_hf(config_cls: type, d: Mapping[str, Any], aliases: Mapping[str, tuple[str, ...]] = (),
                   checks: Callable[[Mapping[str, Any]], None] | None = None, partial_rotary: bool = False) -> Any:
    """The family config ``config_cls`` from an HF ``config.json`` dict.

    Each field takes the value of the key of its own name, else of one of its ``aliases`` (e.g.
    ``num_experts`` / ``num_local_experts``); missing keys keep the class default (the HF
    config class's default: ``tests/test_config_defaults.py`` checks every key of every family
    against transformers), other keys are ignored. Every value is type-checked against the
    field (``"false"`` is not a bool, ``"64"`` not an int). ``rope_parameters`` accepts both HF
    generations (see :func:`_rope_from_hf`); ``partial_rotary`` families also read
    ``partial_rotary_factor``. ``checks`` rejects configs asking for features mff lacks.

    Raises:
        ValueError: a value of the wrong type, ``hidden_act`` other than silu, an unsupported or
            incomplete rope block, a ``pad_token_id`` outside the vocabulary, or what ``checks``
            rejects; the message names the key and value.
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
            mpe = next(g.default for g in dataclasses.fields(config_cls) if g.name == "max_position_embeddings")
            kwargs[f.name] = _rope_from_hf(d, partial_rotary, f.default, mpe)
            continue
        for key in (f.name, *aliases.get(f.name, ())):
            if key in d:
                kwargs[f.name] = _typed("config.json", key, d[key], hints[f.name])
                break
    cfg = config_cls(**kwargs)
    pad, vocab = getattr(cfg, "pad_token_id", None), getattr(cfg, "vocab_size", None)
    if pad is not None and vocab is not None and not -vocab <= pad < vocab:
        # transformers refuses it too (its embedding's padding_idx must be a row)
        where = "pad_token_id" if "pad_token_id" in d else f"pad_token_id (not in config.json; {config_cls.__name__}'s default)"
        raise ValueError(f"config.json: {where}={pad} is outside the vocabulary (vocab_size={vocab}); "
                         "set pad_token_id to a token id below vocab_size, or to null")
    return cfg


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


def config_from_dict(config_cls: type, d: Any, where: str = "checkpoint metadata") -> Any:
    """Rebuild a family config from :func:`mff.recipes.common.config_to_dict` output (checkpoint
    metadata): nested ``rope_parameters`` becomes :class:`RopeParameters`, lists tuples; every
    value is type-checked.

    Raises:
        ValueError: ``d`` is not a mapping, a key the config class does not have, or a value of
            the wrong type (named), or a config that fails its ``validate()``.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: the model config must be a mapping, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(str(k) for k in set(d) - names)
    if unknown:
        raise ValueError(f"{where}: {config_cls.__name__} has no fields {unknown}")
    hints = typing.get_type_hints(config_cls)
    cfg = config_cls(**{k: _typed(where, k, v, hints[k]) for k, v in d.items()})
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg
