"""Run three fp32 AdamW training steps of tiny models on one parallel layout and save what the
layout must not change: the losses, the grad norms and the final full params.

    torchrun --nproc_per_node=N tests/layout_worker.py OUT.pt --families deepseek3,qwen3_moe --tp 2
    python tests/layout_worker.py OUT.pt --families deepseek3          # the single-process reference

``--lora R`` also runs the families of ``--lora-families`` (default: all) with LoRA adapters of
rank R on every projection (frozen base, the adapters trained; saved under ``<family>+lora``,
their params being the adapters).

Every rank builds the same global batch; each data-parallel rank takes its rows, in micro-batches
of ``--micro-rows`` rows. The reference runs the same micro-batches one after the other (grad
accumulation): a balance loss is computed per micro-batch (as Megatron's default), so only the
same micro-batches give the same loss. Used by
tests/test_dist_layouts.py (issue 5, acceptance 1-2); not a test itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mff  # noqa: E402
import mff.nn.moe as moe  # noqa: E402
from mff.backend import init_distributed  # noqa: E402
from mff.models import get_family  # noqa: E402
from mff.nn.layers import Linear  # noqa: E402
from mff.optim import OptimConfig, init_state  # noqa: E402
from mff.parallel import ParallelConfig, build_mesh, data_parallel_rank, data_parallel_size  # noqa: E402
from mff.train.step import train_step  # noqa: E402

STEPS = 3
GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 255  # an odd vocabulary: tp splits it unevenly (padded to a multiple of tp)


def tiny(family: str, **extra):
    """A tiny config of ``family`` whose heads, KV heads, experts and hidden all divide 4 (the vocab
    does not); ``extra``: more field overrides (those the family's config has)."""
    cfg = get_family(family).sizes["tiny"]
    over = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family in ("deepseek3", "telechat3"):
        over.update(intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, first_k_dense_replace=1,
                    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, num_nextn_predict_layers=1)
    else:
        over.update(intermediate_size=128, num_key_value_heads=2, head_dim=16)
        if family in ("qwen3_moe", "glm4_moe"):
            over.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    over.update(extra)
    names = {f.name for f in dataclasses.fields(cfg)}
    return mff.build(family, dataclasses.replace(cfg, **{k: v for k, v in over.items() if k in names}))


def global_batch(step: int, rows: int = GLOBAL_BATCH, seed: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class _NoFullVocab(TorchDispatchMode):
    """Fails on any plain tensor with a dim of the vocabulary's size: under tensor parallelism
    neither the embedding nor the head nor the loss may hold all V rows or logits."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and VOCAB in t.shape:
                raise AssertionError(f"{func} made a {tuple(t.shape)} tensor: the full vocabulary on one tp rank")
        return out


def assert_tp_is_real(model, params, batch, tp: int) -> None:
    """One forward and backward (no logits) on a tp > 1 mesh computes with 1/tp of the heads
    in q and o projections and 1/tp of the dense MLP width (would fail if weights were
    gathered whole), and never makes a tensor of the full vocabulary's size."""
    widths, hooks = [], []
    shapes = model.param_shapes()
    for name, m in model.skeleton.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if isinstance(m, Linear) and kind in ("q_proj", "q_b_proj", "o_proj", "down_proj"):
            column = kind in ("q_proj", "q_b_proj")
            want = shapes[name + ".weight"][0 if column else 1] // tp

            def hook(mod, args, out, name=name, column=column, want=want):
                widths.append((name, out.shape[-1] if column else args[0].shape[-1], want))

            hooks.append(m.register_forward_hook(hook))
    try:
        with _NoFullVocab():
            out = model.forward(params, batch, logits=False)
            torch.autograd.grad(out.loss, [p for p in params.values() if p.requires_grad])
    finally:
        for h in hooks:
            h.remove()
    assert any(n.endswith("o_proj") for n, _, _ in widths), widths
    bad = [w for w in widths if w[1] != w[2]]
    assert not bad, f"(layer, width used, width of 1/tp): {bad}"


def assert_lora_placed_like_base(params, mesh) -> None:
    """Column-parallel weights' B and row-parallel weights' A are split over tp like the weight;
    stacked experts' adapters are split by expert over ep like the experts."""
    names = list(mesh.mesh_dim_names)
    for name, t in params.items():
        if not name.endswith((".lora_A", ".lora_B")):
            continue
        base = params[name[: -len(".lora_A")]]
        for axis in ("tp", "ep"):
            i = names.index(axis)
            if mesh.size(i) == 1:
                continue
            bp, ap = base.placements[i], t.placements[i]
            if name.endswith(".lora_B") and bp == Shard(0) and base.dim() == 2:
                assert ap == Shard(0), (name, t.placements)
            if name.endswith(".lora_A") and bp == Shard(1) and base.dim() == 2:
                assert ap == Shard(1), (name, t.placements)
            if base.dim() == 3 and bp == Shard(0):
                assert ap == Shard(0), (name, t.placements)


def run(family: str, mesh, micro_rows: int, lora_r: int = 0) -> dict:
    model = tiny(family)
    params = model.init(seed=7, mesh=mesh)
    tp = mesh.size(mesh.mesh_dim_names.index("tp"))
    saved = params
    if lora_r:
        model = mff.peft.add_lora(model, r=lora_r, alpha=2 * lora_r)
        for t in params.values():
            t.requires_grad_(False)
        saved = mff.peft.init_adapters(model, seed=9, mesh=mesh)
        params = {**params, **saved}
        assert_lora_placed_like_base(params, mesh)
    if tp > 1:
        assert_tp_is_real(model, params, global_batch(0), tp)
    # eps 1e-5, not 1e-8: near g = 0 an AdamW step moves a param by lr * g / eps, so a grad that
    # is zero up to rounding (GQA key biases: softmax ignores a per-row shift; a tied-embedding
    # element whose embedding and head grads cancel) turns the fp32 rounding of another
    # summation order (~1e-8 there) into a param difference of lr / eps x 1e-8, whatever the
    # layout: 1e-5 at eps 1e-6 (glm4 tp=2 measured 1.09e-5 on one element of 16k), 1e-6 at 1e-5.
    # Grads well above eps still move each param by ~lr per step, so a wrong grad shows.
    optim = OptimConfig(lr=1e-3, max_grad_norm=1.0, eps=1e-5)
    state = init_state(optim, params)
    dp, rank = data_parallel_size(mesh), data_parallel_rank(mesh)
    rows = GLOBAL_BATCH // dp
    losses, norms = [], []
    for step in range(STEPS):
        b = global_batch(step)
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()}
        micro = [{k: v[i:i + micro_rows] for k, v in mine.items()} for i in range(0, rows, micro_rows)]
        stats = train_step(model, params, state, micro, optim.lr, optim, bias_update_rate=0.0 if lora_r else 1e-3)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
    trained = sorted(k for k, v in saved.items() if v.requires_grad)
    assert sorted(k for k, _ in _state_paths(state)) == trained, "optimizer state must cover exactly the trained params"
    return {"losses": losses, "grad_norms": norms, "params": {k: full(v) for k, v in saved.items()}}


def _state_paths(state: dict):
    """``(param path, slot)`` of the optimizer state's per-param tensors."""
    for slot, tree in state.items():
        if isinstance(tree, dict):
            for path in tree:
                if slot == "exp_avg":
                    yield path, slot


def counted_result(mesh) -> dict:
    """The result dict of a worker: the mesh, and ``ep_dispatches``, counted from now on (the
    tests check that an ep layout really sends tokens to their experts' ranks)."""
    result = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "ep_dispatches": 0}
    dispatched = moe._dispatched_experts

    def counting(*args):
        result["ep_dispatches"] += 1
        return dispatched(*args)

    moe._dispatched_experts = counting
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--families", required=True)
    ap.add_argument("--micro-rows", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--lora", type=int, default=0)
    ap.add_argument("--lora-families", default=None)
    for name in ("dp_replicate", "dp_shard", "tp", "ep"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=-1 if name == "dp_shard" else 1)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    info = init_distributed("cpu", 120.0)
    mesh = build_mesh("cpu", ParallelConfig(dp_replicate=a.dp_replicate, dp_shard=a.dp_shard, tp=a.tp, ep=a.ep), info.world_size)
    result = counted_result(mesh)
    for family in a.families.split(","):
        result[family] = run(family, mesh, a.micro_rows)
        if a.lora and (a.lora_families is None or family in a.lora_families.split(",")):
            result[family + "+lora"] = run(family, mesh, a.micro_rows, a.lora)
    if info.rank == 0:
        tmp = a.out + ".tmp"
        torch.save(result, tmp)
        os.replace(tmp, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
