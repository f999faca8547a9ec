"""Training tokens/s of the quick-start model for each torch CPU thread count, side by side.

    python bench/threads.py [--threads 1 2 --rounds 5 --steps 4 --batch-size 16 --seq-len 256]

The model is the tiny DeepSeek-V3 of the quick start (``python -m mff.recipes.pretrain``), with
the quick start's batch (16 x 256 tokens), random token ids and AdamW. Each round runs
``--steps`` optimizer steps (``mff.train.step.train_step``) at every thread count in turn, after
one warm-up step, so every count sees the same load; the figure is the median over the rounds
of tokens/s. It prints the machine's load average beside it: the result depends on what else
runs, which is the point (on a machine shared with other work fewer threads can be faster).
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
from mff.optim import OptimConfig, init_state  # noqa: E402
from mff.train.step import train_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args(argv)
    model = mff.build("deepseek3", size="tiny")
    params = model.init(seed=0)
    optim = OptimConfig(lr=1e-3)
    state = init_state(optim, params)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    batch = [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}]
    rate = model.config.moe_router_bias_update_rate
    results: dict[int, list[float]] = {n: [] for n in args.threads}
    for n in args.threads:  # warm-up at each count
        torch.set_num_threads(n)
        train_step(model, params, state, batch, 1e-3, optim, rate)
    for _ in range(args.rounds):
        for n in args.threads:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, params, state, batch, 1e-3, optim, rate)
            results[n].append(args.steps * args.batch_size * args.seq_len / (time.perf_counter() - t0))
    load = os.getloadavg()
    print(f"tiny deepseek3, batch {args.batch_size} x {args.seq_len}, {args.rounds} rounds of {args.steps} steps; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    print("| threads | tokens/s (median) | min | max |")
    print("|---|---|---|---|")
    for n, xs in results.items():
        print(f"| {n} | {statistics.median(xs):,.0f} | {min(xs):,.0f} | {max(xs):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
