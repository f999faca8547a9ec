"""Functional Muon (mff.optim.muon) against torch.optim.Muon: 2-D params, tall and wide
matrices, stacked experts; param selection between Muon and AdamW; checkpoint round trip;
DTensor params on a size-1 mesh."""

from __future__ import annotations

import pytest
import torch

from mff import ckpt
from mff.optim import OptimConfig, adamw
from mff.optim import muon as M

needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")


def _rand(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _torch_muon(params, lr, wd, mode, nesterov=True):
    return torch.optim.Muon(params, lr=lr, weight_decay=wd, adjust_lr_fn=mode, nesterov=nesterov)


@needs_torch_muon
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("mode,nesterov", [("original", True), ("match_rms_adamw", True), ("original", False)])
def test_matches_torch_muon_over_10_steps(mode, nesterov, shape):
    path = "model.layers.0.mlp.down_proj.weight"
    init = _rand(shape, 0)
    ours = {path: init.clone().requires_grad_(True)}
    ref = torch.nn.Parameter(init.clone())
    opt = _torch_muon([ref], 0.02, 0.1, mode, nesterov)
    hyper, cfg = M.MuonHyper(adjust_lr=mode, nesterov=nesterov), OptimConfig(weight_decay=0.1)
    state = M.init(ours)
    assert set(state["momentum_buffer"]) == {path} and not state["exp_avg"]
    for step in range(10):
        g = _rand(shape, 100 + step)
        lr = 0.02 * (step + 1) / 10
        M.update(ours, {path: g}, state, lr, hyper=hyper, adamw_cfg=cfg)
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
    torch.testing.assert_close(ours[path].detach(), ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(state["momentum_buffer"][path], opt.state[ref]["momentum_buffer"], atol=1e-6, rtol=0)
    assert int(state["step"]) == 10


@needs_torch_muon
@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(1024, 256), (256, 1024)])
def test_tall_and_wide_update_orientation_and_scale(shape, mode):
    lr = 0.01
    g = _rand(shape, 1)
    ours = {"w": torch.zeros(shape, requires_grad=True)}
    ref = torch.nn.Parameter(torch.zeros(shape))
    opt = _torch_muon([ref], lr, 0.0, mode)
    ref.grad = g.clone()
    opt.step()
    M.update(ours, {"w": g}, M.init(ours, adamw_patterns=()), lr, hyper=M.MuonHyper(adjust_lr=mode), adamw_cfg=OptimConfig(weight_decay=0.0))
    delta = -ours["w"].detach()
    assert delta.shape == shape
    torch.testing.assert_close(delta, -ref.detach(), atol=1e-6, rtol=0)
    # The update is the adjusted lr times a near-orthogonal matrix aligned with g.
    alr = M.adjust_lr(lr, shape, mode)
    expected = {("original", 1024): 2 * lr, ("original", 256): lr}.get((mode, shape[0]), 0.2 * 32 * lr)  # sqrt(1024/256), 0.2 sqrt(1024)
    assert alr == pytest.approx(expected)
    s = torch.linalg.svdvals(delta / alr)
    assert 0.5 < s.min() and s.max() < 1.5
    assert (delta * g).sum() / (delta.norm() * g.norm()) > 0.7
    if mode == "match_rms_adamw":
        assert 0.15 * lr < delta.pow(2).mean().sqrt() < 0.25 * lr


@needs_torch_muon
@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
def test_stacked_experts_equal_per_matrix_torch_muon(mode):
    E, out, inp = 4, 24, 16
    path = "model.layers.1.mlp.experts.down_proj"
    init = _rand((E, out, inp), 2)
    ours = {path: init.clone().requires_grad_(True)}
    refs = [torch.nn.Parameter(init[e].clone()) for e in range(E)]
    opt = _torch_muon(refs, 0.02, 0.1, mode)
    state = M.init(ours)
    assert state["momentum_buffer"][path].shape == (E, out, inp)
    for step in range(5):
        g = _rand((E, out, inp), 200 + step)
        M.update(ours, {path: g}, state, 0.02, hyper=M.MuonHyper(adjust_lr=mode), adamw_cfg=OptimConfig(weight_decay=0.1))
        for e, r in enumerate(refs):
            r.grad = g[e].clone()
        opt.step()
    torch.testing.assert_close(ours[path].detach(), torch.stack([r.detach() for r in refs]), atol=1e-5, rtol=0)


def _model_params(dtype=torch.float32) -> dict[str, torch.Tensor]:
    shapes = {
        "model.embed_tokens.weight": (32, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (12, 8),
        "model.layers.0.mlp.experts.gate_up_proj": (3, 16, 8),
        "model.layers.0.mlp.gate.e_score_correction_bias": (3,),
        "model.layers.1.embed_tokens.weight": (32, 8),
        "model.layers.1.shared_head.head.weight": (32, 8),
        "lm_head.weight": (32, 8),
    }
    params = {k: _rand(s, i).to(dtype).requires_grad_(True) for i, (k, s) in enumerate(shapes.items())}
    params["model.layers.0.mlp.gate.e_score_correction_bias"].requires_grad_(False)  # updated outside the optimizer
    return params


def _grads(params, step: int) -> dict[str, torch.Tensor]:
    return {k: _rand(v.shape, 1000 * step + i).to(v.dtype) for i, (k, v) in enumerate(params.items()) if v.requires_grad}


HIDDEN = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"}


def test_param_selection_and_adamw_side_matches_adamw_update():
    params = _model_params()
    state = M.init(params)
    trained = {k for k, v in params.items() if v.requires_grad}
    assert set(state["momentum_buffer"]) == HIDDEN
    assert set(state["exp_avg"]) == set(state["exp_avg_sq"]) == trained - HIDDEN
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in state["exp_avg"]
    assert state["step"].dtype == torch.int64 and state["step"].dim() == 0
    assert not M.is_muon_param("model.layers.0.input_layernorm.weight", params["model.layers.0.input_layernorm.weight"], ())
    # overriding the patterns
    s2 = M.init(params, adamw_patterns=("**.q_proj.weight",))
    assert set(s2["momentum_buffer"]) == trained - {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"}
    # the AdamW side equals adamw.update on those params alone (same step counter)
    cfg = OptimConfig(weight_decay=0.1, no_decay=("model.embed_tokens.weight", "lm_head.weight"))
    side = {k: params[k].detach().clone().requires_grad_(True) for k in state["exp_avg"]}
    side_state = adamw.init(side)
    for step in range(3):
        grads = _grads(params, step)
        M.update(params, grads, state, 1e-2, adamw_cfg=cfg)
        adamw.update(side, {k: grads[k] for k in side}, side_state, 1e-2, cfg)
    for k in side:
        assert torch.equal(params[k].detach(), side[k].detach()), k
        assert torch.equal(state["exp_avg_sq"][k], side_state["exp_avg_sq"][k]), k
    with pytest.raises(KeyError, match="q_proj"):
        M.update(params, {k: g for k, g in _grads(params, 9).items() if "q_proj" not in k}, state, 1e-2)


def test_low_precision_params_get_fp32_state_and_update():
    params = _model_params(torch.bfloat16)
    state = M.init(params)
    assert all(v.dtype == torch.float32 for slot in ("momentum_buffer", "exp_avg") for v in state[slot].values())
    before = {k: v.detach().clone() for k, v in params.items()}
    M.update(params, _grads(params, 0), state, 1e-2)
    assert all(params[k].dtype == torch.bfloat16 and not torch.equal(params[k], before[k]) for k in params if params[k].requires_grad)


def test_hyper_and_helpers_validate():
    M.MuonHyper().validate()
    with pytest.raises(ValueError, match="adjust_lr"):
        M.MuonHyper(adjust_lr="spectral").validate()
    with pytest.raises(ValueError, match="momentum"):
        M.MuonHyper(momentum=1.0).validate()
    with pytest.raises(ValueError, match="adjust_lr mode"):
        M.adjust_lr(1.0, (4, 4), "nope")
    with pytest.raises(ValueError, match="matrix"):
        M.zeropower_via_newtonschulz(torch.ones(4))
    # a batch of matrices is each matrix on its own, for any number of leading dims
    g = _rand((2, 3, 10, 6), 5)
    out = M.zeropower_via_newtonschulz(g, dtype=torch.float32)
    assert out.shape == g.shape and out.dtype == torch.float32
    torch.testing.assert_close(out[1, 2], M.zeropower_via_newtonschulz(g[1, 2], dtype=torch.float32), atol=1e-5, rtol=0)


def test_checkpoint_round_trip_and_resume(tmp_path):
    cfg, hyper = OptimConfig(weight_decay=0.1), M.MuonHyper(adjust_lr="match_rms_adamw")
    full = _model_params()
    full_state = M.init(full)
    for step in range(6):
        M.update(full, _grads(full, step), full_state, 1e-2, hyper=hyper, adamw_cfg=cfg)

    params = _model_params()
    state = M.init(params)
    for step in range(3):
        M.update(params, _grads(params, step), state, 1e-2, hyper=hyper, adamw_cfg=cfg)
    step_dir = ckpt.save(tmp_path, 3, params, state, {})
    like = _model_params()
    p2, s2, _ = ckpt.load(step_dir, like, M.init(like))
    assert set(s2) == set(state) == {"step", "momentum_buffer", "exp_avg", "exp_avg_sq"}
    assert int(s2["step"]) == 3
    for slot in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
        assert set(s2[slot]) == set(state[slot]) and state[slot]
        for k in state[slot]:
            assert torch.equal(s2[slot][k], state[slot][k]), (slot, k)
    for step in range(3, 6):
        M.update(p2, _grads(p2, step), s2, 1e-2, hyper=hyper, adamw_cfg=cfg)
    for k in full:
        assert torch.equal(p2[k].detach(), full[k].detach()), k


def test_dtensor_params_on_size1_mesh_match_plain(dist1):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = dist1
    R = Replicate()
    placements = {
        "model.embed_tokens.weight": (R, Shard(0), R, R),
        "model.layers.0.input_layernorm.weight": (R, R, R, R),
        "model.layers.0.self_attn.q_proj.weight": (R, Shard(1), R, R),  # a matrix dim: gathered
        "model.layers.0.mlp.experts.gate_up_proj": (R, Shard(0), R, R),  # the expert dim: local
        "model.layers.0.mlp.gate.e_score_correction_bias": (R, R, R, R),
        "model.layers.1.embed_tokens.weight": (R, Shard(0), R, R),
        "model.layers.1.shared_head.head.weight": (R, Shard(0), R, R),
        "lm_head.weight": (Shard(0), R, R, R),
    }
    plain = _model_params()
    sharded = {k: distribute_tensor(v.detach(), mesh, placements[k]).requires_grad_(v.requires_grad) for k, v in plain.items()}
    ps, ss = M.init(plain), M.init(sharded)
    assert ss["momentum_buffer"]["model.layers.0.self_attn.q_proj.weight"].placements == placements["model.layers.0.self_attn.q_proj.weight"]
    for step in range(3):
        grads = _grads(plain, step)
        M.update(plain, grads, ps, 1e-2, adamw_cfg=OptimConfig(weight_decay=0.1))
        dgrads = {k: distribute_tensor(g, mesh, placements[k]) for k, g in grads.items()}
        M.update(sharded, dgrads, ss, 1e-2, adamw_cfg=OptimConfig(weight_decay=0.1))
    for k in plain:
        assert sharded[k].placements == placements[k]
        torch.testing.assert_close(sharded[k].full_tensor().detach(), plain[k].detach(), atol=0, rtol=0)
