"""torchtitan (0.3.0, PyPI) as a peer in the training benchmark: its Qwen3 and DeepSeek-V3 models
built with the benchmark configs of ``bench/configs.py`` and loaded from the same HF checkpoint,
through torchtitan's own ``StateDictAdapter.from_hf``.

What it takes on a CPU-only machine (found for torchtitan 0.3.0 with torch 2.13.0):

- ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 triton`` and ``pip install tyro``:
  the package imports ``triton`` (its expert-parallel dispatch kernels, via
  ``models/common/moe.py``) and ``spmd_types`` at import time, and ``tyro`` for its config manager;
  the triton wheel installs and imports on a CPU-only Linux (no kernel of it runs here).
- Attention: torchtitan's language models accept only FlexAttention or varlen attention, and
  torch 2.13's FlexAttention has no backward on CPU ("FlexAttention does not support backward on
  CPU"), so every layer's ``inner_attention`` is swapped for torchtitan's own
  ``ScaledDotProductAttention`` (causal SDPA, GQA through ``enable_gqa``).
- Routed experts: ``GroupedExperts`` always runs ``torch._grouped_mm`` on bf16 casts of the tokens
  and weights, also in an fp32 model, so torchtitan's "fp32" rows compute the experts in bf16.
- No FSDP on one process: mixed precision is ``torch.autocast`` to bf16 (what torchtitan's
  ``maybe_enable_amp`` does without FSDP).

:func:`available` says whether it can be imported (and why not); :func:`build` returns the model.
"""

from __future__ import annotations

import glob
from pathlib import Path

__all__ = ["available", "build"]


def available() -> str | None:
    """None when torchtitan's models import here, else the reason (the ImportError's message)."""
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401
    except Exception as e:  # ImportError, or an error inside its import chain
        return f"{type(e).__name__}: {e}"
    return None


def _qwen3_config(cfg):
    import torchtitan.models.qwen3 as q3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.max_position_embeddings, theta=cfg.rope_parameters.rope_theta)
    layers = q3._build_qwen3_layers(n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                                    n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_dim=cfg.intermediate_size,
                                    fuse_qkv=True, attn_backend="flex", rope=rope)
    D, V = cfg.hidden_size, cfg.vocab_size
    return q3.Qwen3Model.Config(vocab_size=V, dim=D, norm=q3._qwen3_norm(D), enable_weight_tying=cfg.tie_word_embeddings,
                                tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=q3._EMBEDDING_INIT),
                                lm_head=Linear.Config(in_features=D, out_features=V, param_init=q3._LINEAR_INIT), layers=layers)


def _deepseek3_config(cfg):
    import torchtitan.models.deepseek_v3 as ds
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE

    r = cfg.rope_parameters
    rope = ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=cfg.max_position_embeddings, theta=r.rope_theta, scaling="yarn",
                              rope_factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                              original_seq_len=r.original_max_position_embeddings)
    layers = ds._build_dsv3_layers(
        n_layers=cfg.num_hidden_layers, n_dense_layers=cfg.first_k_dense_replace, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, mscale=r.mscale_all_dim,
        dense_hidden_dim=cfg.intermediate_size, moe_hidden_dim=cfg.moe_intermediate_size, num_experts=cfg.n_routed_experts,
        num_shared_experts=cfg.n_shared_experts, router_top_k=cfg.num_experts_per_tok, router_score_func="sigmoid",
        router_num_expert_groups=cfg.n_group, router_num_limited_groups=cfg.topk_group, router_route_scale=cfg.routed_scaling_factor,
        router_route_norm=cfg.norm_topk_prob, attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=rope)
    D, V = cfg.hidden_size, cfg.vocab_size
    return ds.DeepSeekV3Model.Config(vocab_size=V, dim=D, layers=layers, mtp_layers=[],
                                     tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=ds._EMBEDDING_INIT),
                                     norm=RMSNorm.Config(normalized_shape=D, eps=cfg.rms_norm_eps, param_init=ds._NORM_INIT),
                                     lm_head=Linear.Config(in_features=D, out_features=V, param_init=ds._output_linear_init(D)))


def build(family: str, cfg, hf_dir: Path):
    """torchtitan's model for the mff benchmark config ``cfg`` of ``family`` (``qwen3`` or
    ``deepseek3``), fp32 on CPU, SDPA attention, its weights from the HF checkpoint ``hf_dir``
    (per-expert keys, as ``mff.save_hf`` writes) through torchtitan's ``from_hf``.
    ``model(tokens [B, T]) -> logits [B, T, V]`` (fp32).

    Raises:
        ValueError: another family; RuntimeError (``load_state_dict``): a weight that does not map.
    """
    import torch
    from safetensors.torch import load_file
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if family == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter
        tt_cfg = _qwen3_config(cfg)
    elif family == "deepseek3":
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as Adapter
        tt_cfg = _deepseek3_config(cfg)
    else:
        raise ValueError(f"torchtitan peer: family {family!r} is not one of qwen3, deepseek3")
    for layer in tt_cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = tt_cfg.build()
    model.init_weights()  # fills the RoPE buffers; every parameter is then loaded below
    for m in model.modules():  # torchtitan's MLA/MoE layer builders leave RMSNorm at its default eps 1e-5
        if isinstance(m, torch.nn.RMSNorm):
            m.eps = cfg.rms_norm_eps
    hf_sd = {}
    for f in sorted(glob.glob(str(Path(hf_dir) / "*.safetensors"))):
        hf_sd.update(load_file(f))
    tt_sd = Adapter(tt_cfg, None).from_hf(hf_sd)
    result = model.load_state_dict(tt_sd, strict=False)
    missing = [k for k in result.missing_keys if "expert_bias" not in k and "tokens_per_expert" not in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"torchtitan peer: weights missing {missing[:3]} / unexpected {result.unexpected_keys[:3]}")
    if any(torch.isnan(p.detach()).any() for p in model.parameters()):
        raise RuntimeError("torchtitan peer: NaN weights after loading")
    return model
