"""One MoE experts layer under expert parallelism, for tests/test_ep.py (not a test itself).

    torchrun --nproc_per_node=2 tests/ep_worker.py OUT_DIR

Each rank builds the same full expert weights, shards them by expert over ``ep`` = WORLD_SIZE,
makes its own tokens and routings (:func:`inputs`, deterministic per rank and case), runs the
layer forward and backward, and saves to ``OUT_DIR/rank{r}.pt`` what the test checks against a
plain single-process loop: the local expert count, the rows the dispatch all-to-all delivered,
the output, the input gradient and the full weight gradients.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mff.nn.moe as moe  # noqa: E402
from mff.backend import init_distributed  # noqa: E402
from mff.parallel import ParallelConfig, build_mesh, gather, shard_params  # noqa: E402

E, D, I, K, N = 4, 8, 6, 2, 5
TABLE = [("gate_up_proj", ("expert", "mlp", "embed")), ("down_proj", ("expert", "embed", "mlp"))]
CASES = ("random", "all_to_rank0")
"""``random``: each token picks K distinct experts at random; ``all_to_rank0``: every rank
routes only to experts 0 and 1 (rank 0's at ep=2), so rank 1 receives no rows."""


def weights() -> dict[str, torch.Tensor]:
    """The full stacked weights ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I]."""
    g = torch.Generator().manual_seed(0)
    return {"gate_up_proj": torch.randn(E, 2 * I, D, generator=g), "down_proj": torch.randn(E, D, I, generator=g) / 2}


def inputs(rank: int, case: str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens ``x`` [N, D], routing ``w`` [N, K], ``idx`` [N, K] and the output
    gradient ``up`` [N, D] of one case."""
    g = torch.Generator().manual_seed(100 * CASES.index(case) + rank)
    x = torch.randn(N, D, generator=g)
    if case == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    else:
        idx = torch.stack([torch.randperm(2, generator=g) for _ in range(N)])
    return {"x": x, "w": torch.rand(N, K, generator=g), "idx": idx, "up": torch.randn(N, D, generator=g)}


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    info = init_distributed("cpu", 60.0)
    mesh = build_mesh("cpu", ParallelConfig(ep=info.world_size, dp_shard=1), info.world_size)
    with torch.device("meta"):
        layer = moe.Experts(E, D, I)
    params = {k: v.requires_grad_() for k, v in shard_params(weights(), TABLE, mesh).items()}
    sent = []
    plain_all_to_all = moe.all_to_all

    def recording(x, out_splits, in_splits, group):
        y = plain_all_to_all(x, out_splits, in_splits, group)
        sent.append(y.detach().clone())
        return y

    moe.all_to_all = recording
    result = {"local_experts": gather(params["gate_up_proj"], keep=("ep",)).shape[0]}
    for case in CASES:
        inp = inputs(info.rank, case)
        x = inp["x"].clone().requires_grad_()
        sent.clear()
        y, counts = torch.func.functional_call(layer, params, (x, inp["w"], inp["idx"]), strict=True)
        grads = torch.autograd.grad((y * inp["up"]).sum(), [x, params["gate_up_proj"], params["down_proj"]])
        result[case] = {
            "received": sent[0],  # the dispatch (tokens to experts); sent[1] is the combine
            "y": y.detach(), "counts": counts, "grad_x": grads[0],
            "grad_gate_up": grads[1].full_tensor(), "grad_down": grads[2].full_tensor(),
            "grad_placements": (str(grads[1].placements), str(params["gate_up_proj"].placements)),
        }
    tmp = os.path.join(out_dir, f"rank{info.rank}.pt.tmp")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(out_dir, f"rank{info.rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
