"""Helpers for tests that compare mff with HF transformers on tiny random models."""

from __future__ import annotations

import math

import torch


def init_o1(model: torch.nn.Module, seed: int = 0, bias_scale: float = 0.0) -> None:
    """Re-initialise an HF model so activations stay O(1) and logits are far from uniform.

    Matrices ~ N(0, 1/fan_in) (so each linear keeps unit scale), norms ~ 1 + N(0, 0.1^2),
    embeddings ~ N(0, 1), router weights ~ N(0, 4/fan_in) (decisive routing), expert biases
    ~ U(-bias_scale, bias_scale).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g)) if "norm" in name else p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                std = (2.0 if name.endswith("gate.weight") else 1.0) / math.sqrt(fan_in)
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(bias_scale * (2 * torch.rand(b.shape, generator=g) - 1))


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF params and the expert-bias buffers, detached, by their in-memory names."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v for k, v in sd.items() if "rotary_emb" not in k}
