"""GQA head mapping and per-head q/k norm, closed form."""

from __future__ import annotations

import torch

from mff.nn.attention import repeat_kv
from mff.nn.gqa import GQA
from mff.nn.layers import RMSNorm


def _fill(module, params):
    return torch.func.functional_call(module, params, args=())


def test_four_query_heads_read_kv_heads_0_0_1_1():
    D, H, K, Dh = 8, 4, 2, 2
    attn = GQA(D, H, K, Dh)
    x = torch.randn(1, 3, D)
    # v_proj maps any input to a constant per KV head: head 0 -> 1.0, head 1 -> 2.0 (through a bias-free
    # trick: x has a constant column)
    x[..., 0] = 1.0
    v_w = torch.zeros(K * Dh, D)
    v_w[:Dh, 0] = 1.0
    v_w[Dh:, 0] = 2.0
    params = {"q_proj.weight": torch.randn(H * Dh, D), "k_proj.weight": torch.randn(K * Dh, D), "v_proj.weight": v_w,
              "o_proj.weight": torch.eye(D, H * Dh)}
    cos, sin = torch.ones(1, 3, Dh), torch.zeros(1, 3, Dh)
    out = torch.func.functional_call(attn, params, args=(x, cos, sin, None))
    # softmax weights sum to 1, so head h outputs its KV head's constant value
    per_head = out[0, :, : H * Dh].reshape(3, H, Dh)
    expected = torch.tensor([1.0, 1.0, 2.0, 2.0])[None, :, None].expand(3, H, Dh)
    torch.testing.assert_close(per_head, expected)
    assert torch.equal(repeat_kv(torch.arange(2.0).view(1, 1, 2, 1), 2).flatten(), torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_qk_norm_is_per_head():
    norm = RMSNorm(4, eps=1e-6)
    q = torch.tensor([[[[10.0, 0, 0, 0], [0, 0, 0, 0]]]])  # [B=1, T=1, H=2, Dh=4]
    out = torch.func.functional_call(norm, {"weight": torch.tensor([1.0, 2.0, 3.0, 4.0])}, args=(q,))
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([2.0, 0, 0, 0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[0, 0, 1], torch.zeros(4), atol=1e-4, rtol=0)
    # and the attention block applies it per head: with identity projections q_norm sees [H, Dh] rows
    attn = GQA(8, 2, 2, 4, qk_norm=True)
    assert attn.q_norm.weight.shape == (4,)
