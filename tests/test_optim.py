"""Functional AdamW against torch.optim.AdamW, the schedule's closed-form values, clipping
against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch

from mff.optim import OptimConfig, adamw, clip_grads_, warmup_cosine


def test_adamw_matches_torch_over_10_steps():
    g = torch.Generator().manual_seed(0)
    init = {"model.embed_tokens.weight": torch.randn(6, 4, generator=g), "a.weight": torch.randn(5, 3, generator=g), "a.norm.weight": torch.randn(3, generator=g)}
    cfg = OptimConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = torch.optim.AdamW(
        [{"params": [ref["a.weight"]], "weight_decay": 0.1},
         {"params": [ref["model.embed_tokens.weight"], ref["a.norm.weight"]], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )
    state = adamw.init(ours)
    for step in range(10):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in init.items()}
        lr = 1e-2 * (step + 1) / 10
        with torch.no_grad():
            adamw.update(ours, grads, state, lr, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        for k, p in ref.items():
            p.grad = grads[k].clone()
        opt.step()
    for k in init:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), atol=1e-6, rtol=0)
    assert int(state["step"]) == 10


def test_adamw_with_non_contiguous_grads_updates_the_right_elements(monkeypatch):
    """A transposed grad of a contiguous param (what a grouped GEMM's backward can give) must
    update the same elements as its contiguous copy (torch._fused_adamw_ on CPU walks the
    memory as one flat buffer and would not), and still through the fused kernel (the grad is
    copied into the param's layout rather than the group taking the foreach path)."""
    fused, original = [], adamw._fused_group
    monkeypatch.setattr(adamw, "_fused_group", lambda *a, **k: fused.append(a[4]) or original(*a, **k))
    g = torch.Generator().manual_seed(0)
    init = {"experts.gate_up_proj": torch.randn(2, 6, 4, generator=g), "b.weight": torch.randn(3, 5, generator=g),
            "experts.down_proj": torch.randn(2, 1, 4, generator=g)}
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    grads = {"experts.gate_up_proj": torch.randn(2, 4, 6, generator=g).transpose(1, 2), "b.weight": torch.randn(5, 3, generator=g).t(),
             "experts.down_proj": torch.randn(2, 4, 1, generator=g).transpose(1, 2)}  # "contiguous", with other strides
    assert all(v.stride() != init[k].stride() for k, v in grads.items()) and grads["experts.down_proj"].is_contiguous()
    results = []
    for gs in (grads, {k: v.clone(memory_format=torch.contiguous_format) for k, v in grads.items()}):
        params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
        state = adamw.init(params)
        assert set(state["exp_avg"]) == set(init)
        with torch.no_grad():
            for _ in range(2):
                adamw.update(params, gs, state, 1e-2, cfg)
        results.append({k: v.detach() for k, v in params.items()})
    if hasattr(torch, "_fused_adamw_"):
        assert sorted(k for keys in fused for k in keys) == sorted(list(init) * 4)  # 2 updates x 2 variants
    for k in init:
        assert not torch.equal(results[1][k], init[k])
        torch.testing.assert_close(results[0][k], results[1][k], atol=0, rtol=0)


def test_warmup_cosine_values():
    lrs = [warmup_cosine(s, 1.0, 2, 10, 0.0) for s in range(1, 11)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] == 1.0  # first step > 0, peak at end of warmup
    assert lrs[-1] > 0  # last step not wasted
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert lrs[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 8)))
    assert warmup_cosine(10, 1.0, 2, 10, 0.1) >= 0.1
    with pytest.raises(ValueError):
        warmup_cosine(0, 1.0, 2, 10)


def test_clip_matches_torch():
    g = torch.Generator().manual_seed(1)
    grads = {"a": torch.randn(4, 4, generator=g) * 3, "b": torch.randn(7, generator=g)}
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, v in zip(ps, grads.values()):
        p.grad = v.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ps, 1.0)
    norm = clip_grads_(grads, 1.0)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for p, v in zip(ps, grads.values()):
        torch.testing.assert_close(v, p.grad)
