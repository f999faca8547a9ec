"""Expert parallelism (issue 5): the dispatch bookkeeping against a plain loop on one process,
and one 2-process torchrun launch showing that EP is real: each rank holds E/2 experts, the
all-to-all delivers exactly the token rows routed to its experts, and the output and gradients
equal a single-process float64 loop over all ranks' tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mff.parallel.ep import plan_receive, plan_send
from tests import ep_worker
from tests.cli_util import ROOT, cli_env
from tests.dist_util import free_port


def _slots_for(idx_per_rank: list[torch.Tensor], experts: range) -> list[tuple[int, int, int, int]]:
    """(expert, source rank, token n, choice k) of every slot routed to ``experts``, ordered
    by expert, then source, then (n, k): the order the local grouped GEMM expects."""
    out = []
    for e in experts:
        for src, idx in enumerate(idx_per_rank):
            for n in range(idx.shape[0]):
                for k in range(idx.shape[1]):
                    if int(idx[n, k]) == e:
                        out.append((e, src, n, k))
    return out


@pytest.mark.parametrize("P,E,K,N", [(2, 4, 2, 7), (4, 8, 3, 5), (3, 6, 1, 4), (2, 4, 2, 0)])
def test_dispatch_bookkeeping_matches_loop(P, E, K, N):
    """Simulate P ranks in one process: each plans its sends, the count exchange and the row
    all-to-all are done by hand, and every destination's rows (after its local permutation)
    must be exactly the loop's slots for its experts; the return trip restores each source's order."""
    g = torch.Generator().manual_seed(P * 100 + E)
    El = E // P
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) if N else torch.zeros(0, K, dtype=torch.int64)
           for _ in range(P)]
    if P == 2 and N:
        idx[1] = idx[1] % El  # rank 1 routes only to rank 0's experts: nothing goes to rank 1 from it
    sends = [plan_send(i, E, P) for i in idx]
    for i, s in zip(idx, sends):
        assert s.counts.tolist() == [int((i == e).sum()) for e in range(E)]
        assert s.send_splits == [int(((i >= r * El) & (i < (r + 1) * El)).sum()) for r in range(P)]
        # sorted slots: experts non-decreasing, each (n, k) once, in (n, k) order within an expert
        assert i.reshape(-1)[s.order].tolist() == sorted(i.reshape(-1).tolist())
        assert (s.token_of_slot == s.order // K).all()
    # each source's sorted slots as (expert, source, n, k), cut into per-destination blocks
    blocks = []
    for src, (i, s) in enumerate(zip(idx, sends)):
        slots = [(int(i.reshape(-1)[o]), src, int(o) // K, int(o) % K) for o in s.order]
        ends = torch.tensor(s.send_splits).cumsum(0).tolist()
        blocks.append([slots[a:b] for a, b in zip([0, *ends[:-1]], ends)])
    for dst in range(P):
        recv_counts = torch.stack([s.counts[dst * El:(dst + 1) * El] for s in sends])  # what exchange_counts returns
        plan = plan_receive(recv_counts)
        received = [slot for src in range(P) for slot in blocks[src][dst]]  # all_to_all: source-major
        assert plan.recv_splits == [len(blocks[src][dst]) for src in range(P)]
        want = _slots_for(idx, range(dst * El, (dst + 1) * El))
        assert [received[j] for j in plan.local_order.tolist()] == want
        assert plan.local_counts == [sum(1 for s in want if s[0] == e) for e in range(dst * El, (dst + 1) * El)]


def test_plan_send_rejects_indivisible_experts():
    with pytest.raises(ValueError, match="6 experts do not divide over ep 4"):
        plan_send(torch.zeros(2, 1, dtype=torch.int64), 6, 4)


def _reference(case: str, P: int):
    """Float64 loop over all P ranks' tokens with the full weights: outputs per rank, input
    grads per rank, and the weight grads of sum_r <y_r, up_r>."""
    w = {k: v.double().requires_grad_() for k, v in ep_worker.weights().items()}
    I = ep_worker.I
    ys, xs, loss = [], [], 0
    for r in range(P):
        inp = ep_worker.inputs(r, case)
        x = inp["x"].double().requires_grad_()
        y = torch.zeros_like(x)
        rows = []
        for n in range(x.shape[0]):
            acc = 0
            for k in range(inp["idx"].shape[1]):
                e = int(inp["idx"][n, k])
                h = w["gate_up_proj"][e] @ x[n]
                acc = acc + inp["w"][n, k].double() * (w["down_proj"][e] @ (F.silu(h[:I]) * h[I:]))
            rows.append(acc)
        y = torch.stack(rows)
        loss = loss + (y * inp["up"].double()).sum()
        ys.append(y)
        xs.append(x)
    grads = torch.autograd.grad(loss, [*xs, w["gate_up_proj"], w["down_proj"]])
    return ys, grads[:P], grads[P], grads[P + 1]



def test_ep2_dispatch_is_real(tmp_path):
    P = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={P}", f"--master_port={free_port()}",
           str(ROOT / "tests" / "ep_worker.py"), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(P)]
    E, El = ep_worker.E, ep_worker.E // P
    assert [res["local_experts"] for res in got] == [El] * P
    for case in ep_worker.CASES:
        ys, gxs, g_gate_up, g_down = _reference(case, P)
        idx = [ep_worker.inputs(r, case)["idx"] for r in range(P)]
        xs = [ep_worker.inputs(r, case)["x"] for r in range(P)]
        for rank, res in enumerate(got):
            c = res[case]
            # the rows arrive source-major: (source, expert, n, k)
            by_source = sorted(_slots_for(idx, range(rank * El, (rank + 1) * El)), key=lambda s: (s[1], s[0]))
            want_rows = torch.stack([xs[src][n] for _, src, n, _ in by_source]) if by_source else torch.zeros(0, ep_worker.D)
            assert torch.equal(c["received"], want_rows), (case, rank)
            assert c["counts"].tolist() == torch.bincount(idx[rank].reshape(-1), minlength=E).tolist()
            torch.testing.assert_close(c["y"].double(), ys[rank], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c["grad_x"].double(), gxs[rank], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c["grad_gate_up"].double(), g_gate_up, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c["grad_down"].double(), g_down, atol=1e-5, rtol=1e-5)
            assert c["grad_placements"][0] == c["grad_placements"][1]
    assert got[1]["all_to_rank0"]["received"].shape[0] == 0  # rank 1's experts got no tokens
