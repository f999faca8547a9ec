"""RoPE / YaRN numerics: closed-form values and HF transformers' YaRN as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from mff.nn.rope import RopeParameters, apply_rope, rope_cos_sin, rope_inv_freq, yarn_softmax_scale


def test_yarn_factor40_scale_and_unit_cos_factor():
    rope = RopeParameters(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096)
    _, attention_factor = rope_inv_freq(rope, 64)
    assert attention_factor == 1.0  # exactly: mscale == mscale_all_dim
    scale = 192 ** -0.5 * yarn_softmax_scale(rope)
    assert scale == pytest.approx(192 ** -0.5 * 1.87385, rel=1e-5)
    assert (0.1 * math.log(40) + 1) ** 2 == pytest.approx(1.87385, abs=1e-5)


def test_no_correction_without_yarn():
    assert yarn_softmax_scale(RopeParameters()) == 1.0
    inv, af = rope_inv_freq(RopeParameters(rope_theta=10000.0), 8)
    torch.testing.assert_close(inv, 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert af == 1.0


@pytest.mark.parametrize("mscale,mscale_all_dim,factor", [(0.707, 1.0, 40.0), (1.0, 0.0, 4.0), (1.0, 1.0, 8.0)])
def test_yarn_matches_hf(mscale, mscale_all_dim, factor):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", rope_theta=10000.0, factor=factor, beta_fast=32.0, beta_slow=1.0,
                  mscale=mscale, mscale_all_dim=mscale_all_dim, original_max_position_embeddings=4096)
    cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=dict(params), max_position_embeddings=4096 * int(factor))
    hf_inv, hf_af = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    inv, af = rope_inv_freq(RopeParameters(**params), 64)
    assert torch.equal(inv, hf_inv.float())
    assert af == pytest.approx(hf_af, rel=1e-12)


def test_interleaved_rotation_preserves_pair_norms_and_dot_products():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 2, 8, generator=g)
    inv, _ = rope_inv_freq(RopeParameters(), 8)
    pos = torch.arange(5)[None]
    cos, sin = rope_cos_sin(pos, inv, 1.0, torch.float32)
    qi, ki = apply_rope(q, cos, sin, interleave=True), apply_rope(k, cos, sin, interleave=True)
    # rotation of pair j of position t by angle t * inv[j]: compare against a complex-number loop
    for t in range(5):
        for j in range(4):
            z = complex(q[0, t, 0, 2 * j], q[0, t, 0, 2 * j + 1]) * complex(math.cos(t * inv[j]), math.sin(t * inv[j]))
            assert qi[0, t, 0, j].item() == pytest.approx(z.real, abs=1e-5)
            assert qi[0, t, 0, 4 + j].item() == pytest.approx(z.imag, abs=1e-5)
    # relative position: <q_t, k_s> depends on t - s only
    shifted = rope_cos_sin(pos + 7, inv, 1.0, torch.float32)
    a = (qi[0, 3] * ki[0, 1]).sum()
    b = (apply_rope(q, *shifted, interleave=True)[0, 3] * apply_rope(k, *shifted, interleave=True)[0, 1]).sum()
    assert a.item() == pytest.approx(b.item(), abs=1e-4)
