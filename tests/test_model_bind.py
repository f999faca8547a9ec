"""Model.bind: params swapped into the skeleton once for a block of calls (the eager decode loop)
give the same outputs as Model.forward, and the skeleton is restored on exit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mff


def _model(family: str):
    model = mff.build(family)
    cfg = dataclasses.replace(model.config, vocab_size=97, num_hidden_layers=2, max_position_embeddings=64)
    model = mff.build(family, cfg)
    return model, {k: v.detach() for k, v in model.init(seed=0).items()}


def _skeleton_state(model):
    return {n: (p.device.type, tuple(p.shape)) for n, p in model.skeleton.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_bound_forward_equals_forward_and_restores_the_skeleton(family):
    model, params = _model(family)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    before = _skeleton_state(model)
    with torch.no_grad():
        want = model.forward(params, batch)
        cache_want = model.init_cache(2, 16)
        step_want = model.forward(params, {"input_ids": ids[:, :5]}, cache_want, logits="last")
        with model.bind(params) as forward:
            got = forward(batch)
            step_got = forward({"input_ids": ids[:, :5]}, model.init_cache(2, 16), logits="last")
            assert all(p.device.type == "cpu" for p in model.skeleton.parameters())  # bound inside the block
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert torch.equal(step_got.logits, step_want.logits)
    for (k, a), (_, b) in zip(step_got.cache["layers"][0].items(), step_want.cache["layers"][0].items()):
        assert torch.equal(a, b), k
    assert _skeleton_state(model) == before  # the meta skeleton is back


def test_forward_inside_a_bound_block_uses_its_own_params_and_restores_the_bound_ones():
    model, params = _model("qwen3")
    other = {k: v * 1.5 if v.dim() >= 2 else v for k, v in params.items()}
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, want_other = model.forward(params, {"input_ids": ids}), model.forward(other, {"input_ids": ids})
        with model.bind(params) as forward:
            first = forward({"input_ids": ids})
            nested = model.forward(other, {"input_ids": ids})
            again = forward({"input_ids": ids})
    assert torch.equal(first.logits, want.logits) and torch.equal(again.logits, want.logits)
    assert torch.equal(nested.logits, want_other.logits)
    assert not torch.equal(nested.logits, want.logits)


def test_bind_restores_the_skeleton_after_an_exception():
    model, params = _model("qwen3")
    before = _skeleton_state(model)
    with pytest.raises(ValueError, match="logits="):
        with model.bind(params) as forward:
            forward({"input_ids": torch.zeros(1, 3, dtype=torch.int64)}, logits="all")
    assert _skeleton_state(model) == before


def test_bind_checks_the_param_paths():
    model, params = _model("qwen3")
    missing = dict(params)
    name = sorted(missing)[0]
    del missing[name]
    with pytest.raises(RuntimeError, match="1 missing"):
        with model.bind(missing):
            pass
    with pytest.raises(RuntimeError, match="1 unexpected"):
        with model.bind({**params, "model.extra.weight": torch.zeros(1)}):
            pass
    assert all(p.device.type == "meta" for p in model.skeleton.parameters())


def test_bind_blocks_do_not_nest_and_a_stale_forward_raises():
    model, params = _model("qwen3")
    ids = {"input_ids": torch.zeros(1, 3, dtype=torch.int64)}
    with torch.no_grad():
        with model.bind(params) as forward:
            assert model.is_bound
            with pytest.raises(RuntimeError, match="already inside a bind block"):
                with model.bind(params):
                    pass
            forward(ids)  # the outer block still holds its params
        assert not model.is_bound
        with pytest.raises(RuntimeError, match="has ended"):
            forward(ids)
    assert all(p.device.type == "meta" for p in model.skeleton.parameters())


def test_generate_inside_a_generate_callback_uses_its_own_params():
    """An eager generate called from another's on_token (the model already bound) swaps its params
    per call and gives its own tokens; the outer generate's tokens are unchanged."""
    from mff.generate import generate

    model, params = _model("qwen3")
    other = {k: v * 3.0 if v.dim() >= 2 else v for k, v in params.items()}
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(3))
    want_outer, want_inner = generate(model, params, ids, 4), generate(model, other, ids, 4)
    inner = []
    outer = generate(model, params, ids, 4, on_token=lambda t: inner.append(generate(model, other, ids, 4)))
    assert torch.equal(outer, want_outer)
    assert inner and all(torch.equal(x, want_inner) for x in inner)
    assert not model.is_bound and all(p.device.type == "meta" for p in model.skeleton.parameters())
