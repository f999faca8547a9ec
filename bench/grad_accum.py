"""Training tokens/s of one global batch split into micro-batches, against the same batch whole.

    python bench/grad_accum.py [--rows 4 --seq-len 256 --rounds 5 --steps 3 --size tiny --threads N --grouped-mm auto]

The model is the tiny DeepSeek-V3 of the quick start. One optimizer step
(``mff.train.step.train_step``, AdamW) on ``--rows`` sequences of ``--seq-len`` tokens runs
as 1 micro-batch of ``--rows`` sequences and as ``--rows`` micro-batches of 1 sequence (what
``--grad-accum`` and MindFormers' ``micro_batch_num`` with ``batch_size: 1`` give), alternating
round by round so both see the same load; the figure is the median over the rounds. The
per-micro-batch overhead is the gap between the two (issue 21's target: within 20%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mff  # noqa: E402
from mff.backend import select_ops  # noqa: E402
from mff.data import split_microbatches  # noqa: E402
from mff.optim import OptimConfig, init_state  # noqa: E402
from mff.train.step import train_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--grouped-mm", default="auto", choices=("auto", "fused", "loop"),
                    help="the experts' grouped GEMM, as the recipes pick it (auto: torch._grouped_mm where it runs)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = select_ops("cpu", grouped_mm=args.grouped_mm)
    model = mff.build("deepseek3", size=args.size)
    params = model.init(seed=0)
    optim = OptimConfig(lr=1e-3)
    state = init_state(optim, params)
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    layouts = {f"1 x {args.rows}": [batch], f"{args.rows} x 1": split_microbatches(batch, args.rows)}
    rate = model.config.moe_router_bias_update_rate
    results: dict[str, list[float]] = {k: [] for k in layouts}
    for mbs in layouts.values():  # warm-up
        train_step(model, params, state, mbs, 1e-3, optim, rate)
    for _ in range(args.rounds):
        for name, mbs in layouts.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, params, state, mbs, 1e-3, optim, rate)
            results[name].append(args.steps * args.rows * args.seq_len / (time.perf_counter() - t0))
    load = os.getloadavg()
    print(f"deepseek3/{args.size}, {args.rows} x {args.seq_len} tokens per step, {torch.get_num_threads()} threads, "
          f"grouped GEMM {ops.names['grouped_mm']}, "
          f"{args.rounds} rounds of {args.steps} steps; load average {load[0]:.2f}")
    print("| micro-batches x sequences | tokens/s (median) | x whole batch |")
    print("|---|---|---|")
    base = statistics.median(results[f"1 x {args.rows}"])
    for name, xs in results.items():
        print(f"| {name} | {statistics.median(xs):,.0f} | {statistics.median(xs) / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
