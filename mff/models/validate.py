"""Config checks shared by the GQA families; each raises ValueError naming the field, its value
and what it must be."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["need", "check_gqa", "check_moe", "check_pad_token"]


def need(cond: bool, msg: str) -> None:
    """Raise ``ValueError("model config: " + msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(f"model config: {msg}")


def check_pad_token(cfg: Any) -> None:
    """``pad_token_id`` None or a row of the embedding (``-vocab_size <= id < vocab_size``, what
    ``torch.nn.Embedding(padding_idx=...)`` and so transformers accept): an export with another
    one would not load anywhere."""
    pad, vocab = getattr(cfg, "pad_token_id", None), getattr(cfg, "vocab_size", None)
    if pad is not None and isinstance(vocab, int):
        need(-vocab <= pad < vocab, f"pad_token_id={pad} is outside the vocabulary (vocab_size={vocab}); "
                                    "set it to a token id below vocab_size, or to null")


MAX_HEAD_DIM = 65536
"""Widest attention head a config may ask for (real models use 64-512): the rotary tables are
built for it before any weight, so an absurd value would allocate gigabytes first."""


def check_gqa(cfg: Any) -> None:
    """Sizes > 0, heads a multiple of KV heads, finite eps / init, RoPE parameters, rotary dims even,
    the pad token in the vocabulary."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and v > 0, f"{name}={v!r} must be an int > 0")
    need(cfg.head_dim <= MAX_HEAD_DIM, f"head_dim={cfg.head_dim} is past {MAX_HEAD_DIM:,}; no attention head is that wide")
    need(cfg.num_attention_heads % cfg.num_key_value_heads == 0,
         f"num_attention_heads={cfg.num_attention_heads} must be a multiple of num_key_value_heads={cfg.num_key_value_heads}")
    need(math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, f"rms_norm_eps={cfg.rms_norm_eps} must be > 0")
    need(math.isfinite(cfg.initializer_range) and cfg.initializer_range >= 0, f"initializer_range={cfg.initializer_range} must be >= 0")
    try:
        cfg.rope_parameters.validate()
    except ValueError as e:
        raise ValueError(f"model config: {e}") from None
    rot = int(cfg.head_dim * cfg.rope_parameters.partial_rotary_factor)
    need(rot >= 2 and rot % 2 == 0, f"rotary dims head_dim * partial_rotary_factor = {rot} must be even and >= 2")
    check_pad_token(cfg)


def check_moe(cfg: Any, num_experts: int, n_group: int = 1, topk_group: int = 1) -> None:
    """Experts >= 1, 1 <= top-k <= experts (and within topk_group groups), expert width > 0."""
    need(num_experts >= 1, f"the number of routed experts ({num_experts}) must be >= 1")
    need(1 <= cfg.num_experts_per_tok <= num_experts, f"num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, {num_experts}]")
    need(cfg.moe_intermediate_size > 0, f"moe_intermediate_size={cfg.moe_intermediate_size} must be > 0")
    need(n_group >= 1 and num_experts % n_group == 0, f"{num_experts} experts must divide into n_group={n_group} groups")
    need(1 <= topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    need(cfg.num_experts_per_tok <= topk_group * (num_experts // n_group),
         f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts of topk_group={topk_group} groups")
