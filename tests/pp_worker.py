"""Three fp32 AdamW training steps of tiny 4-layer models under pipeline parallelism, saving what
the layout must not change: the losses, the grad norms, the expert loads of every step and the
final full params.

    torchrun --nproc_per_node=2 tests/pp_worker.py OUT --families deepseek3,qwen3 --pp 2 --schedule 1f1b
    python tests/pp_worker.py OUT --families deepseek3,qwen3          # the single-process reference

Every rank builds the same global batch; each data-parallel rank takes its rows and cuts them
into micro-batches of ``--micro-rows`` rows: the pipeline runs them as its micro-batches, the
reference one after the other (grad accumulation), so both compute the same per-micro-batch
balance losses. Each rank writes ``OUT.rank<R>`` with the full values of the params it holds
(the test merges them). Used by tests/test_pp.py; not a test itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mff.backend import init_distributed  # noqa: E402
from mff.optim import OptimConfig, init_state  # noqa: E402
from mff.parallel import ParallelConfig, build_mesh, data_parallel_rank, data_parallel_size  # noqa: E402
from mff.train.pipeline import Pipeline  # noqa: E402
from mff.train.step import train_step  # noqa: E402
from tests import layout_worker  # noqa: E402
from tests.layout_worker import full  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 8


def tiny(family: str):
    """tests/layout_worker.py's tiny config with 4 layers (deepseek3: a dense first layer, 3 MoE
    layers, one MoE MTP depth; qwen3: tied embeddings) and the balance losses on (deepseek3's
    per-sequence terms, qwen3_moe's Switch statistics)."""
    return layout_worker.tiny(family, num_hidden_layers=4, aux_loss_alpha=1e-3, router_aux_loss_coef=1e-2)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    return layout_worker.global_batch(step, GLOBAL_BATCH, seed=2000)


def run(family: str, mesh, parallel: ParallelConfig, micro_rows: int) -> dict:
    model = tiny(family)
    dp, rank = data_parallel_size(mesh), data_parallel_rank(mesh)
    rows = GLOBAL_BATCH // dp
    pipe = None
    if parallel.pp > 1:
        parallel = dataclasses.replace(parallel, pp_microbatches=rows // micro_rows)
        pipe = Pipeline(model, parallel, mesh, layout_worker.SEQ, rows, torch.device("cpu"))
        params = model.init(seed=7, mesh=mesh, keys=pipe.keys)
    else:
        params = model.init(seed=7, mesh=mesh)
    # eps 1e-5 as tests/layout_worker.py: a grad that is zero up to rounding must not turn a
    # summation-order difference into a visible param difference
    optim = OptimConfig(lr=1e-3, max_grad_norm=1.0, eps=1e-5)
    state = init_state(optim, params)
    losses, terms, norms, loads, scatters = [], [], [], [], []
    for step in range(STEPS):
        COUNT["reduce_scatter"] = 0
        b = global_batch(step)
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()}
        if pipe is not None:
            stats = pipe.step(params, state, [mine], optim.lr, optim, bias_update_rate=1e-3)
        else:
            micro = [{k: v[i:i + micro_rows] for k, v in mine.items()} for i in range(0, rows, micro_rows)]
            stats = train_step(model, params, state, micro, optim.lr, optim, bias_update_rate=1e-3)
        losses.append(stats.loss)
        terms.append(stats.losses)
        norms.append(stats.grad_norm)
        loads.append({k: v.clone() for k, v in stats.expert_load.items()})
        scatters.append(COUNT["reduce_scatter"])
    saved = pipe.owned if pipe is not None else list(params)
    names = mesh.mesh_dim_names
    fsdp = sum(1 for v in params.values() if v.requires_grad and any(
        isinstance(p, Shard) and names[i] == "dp_shard" and mesh.size(i) > 1 for i, p in enumerate(v.placements)))
    return {"losses": losses, "terms": terms, "grad_norms": norms, "loads": loads, "params": {k: full(params[k]) for k in saved},
            "stages": pipe.describe() if pipe is not None else None, "reduce_scatters": scatters, "fsdp_params": fsdp,
            "microbatches": pipe.microbatches if pipe is not None else len(range(0, rows, micro_rows))}


COUNT = {"reduce_scatter": 0}
_reduce_scatter = funcol.reduce_scatter_single


def _counting_reduce_scatter(*args, **kwargs):  # DTensor's Partial -> Shard (the FSDP gradient reduction) calls this
    COUNT["reduce_scatter"] += 1
    return _reduce_scatter(*args, **kwargs)


funcol.reduce_scatter_single = _counting_reduce_scatter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--families", required=True)
    ap.add_argument("--micro-rows", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--stages-per-rank", type=int, default=None)
    ap.add_argument("--dp-shard", type=int, default=-1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    info = init_distributed("cpu", 120.0)
    parallel = ParallelConfig(pp=a.pp, pp_schedule=a.schedule, pp_stages_per_rank=a.stages_per_rank, dp_shard=a.dp_shard, ep=a.ep, tp=a.tp)
    mesh = build_mesh("cpu", parallel, info.world_size)
    result = layout_worker.counted_result(mesh)
    for family in a.families.split(","):
        result[family] = run(family, mesh, parallel, a.micro_rows)
    torch.save(result, f"{a.out}.rank{info.rank}")


if __name__ == "__main__":
    main()
