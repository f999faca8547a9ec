"""Generation benchmark: mff's KV-cache decoding against HF transformers' ``generate``.

    python bench/generate.py [--threads 2 --prompt-len 32 --new-tokens 128 --repeats 5]

For each benchmark config (``bench/configs.py``: qwen3_bench, deepseek3_bench) the same random
weights run in HF transformers (fp32, greedy ``generate``) and in mff (greedy
:func:`mff.generate.generate`: fp32 eager, and fp32 and bf16 weights with the compiled decode
step, and bf16 eager; the eager rows on :func:`mff.generate.decode_layout` weights, as the
``generate`` recipe runs them), batch 1, interleaved in one process, median of ``--repeats`` after one
warm-up each (the warm-up pays the compile time, about 20 s per model and dtype on 2 cores).
Tokens/s counts new tokens over the whole call (prefill included). The bandwidth limit is the
memory bandwidth measured in the same run (a streaming read of a 512 MB buffer) divided by the
bytes a decode step must read (:func:`bytes_read_per_token`: every weight once, except the
embedding table, which is looked up, and only the top-k of the routed experts). The cache
column is the KV-cache elements per token per layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mff  # noqa: E402
from bench.configs import CONFIGS  # noqa: E402
from mff.generate import decode_layout, generate  # noqa: E402


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (``sum`` over a float32 buffer larger than the caches)."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return nbytes / min(times)


def bytes_read_per_token(params: dict, cfg) -> int:
    """Bytes of weights one decode step reads: all params but the (untied) embedding table, and
    of each stacked routed-expert weight [E, ...] only ``num_experts_per_tok`` of its E experts."""
    total = 0
    for k, t in params.items():
        b = t.numel() * t.element_size()
        if k == "model.embed_tokens.weight" and not getattr(cfg, "tie_word_embeddings", False):
            continue
        if ".mlp.experts." in k:
            b = b * cfg.num_experts_per_tok // t.shape[0]
        total += b
    return total


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_config(name: str, family: str, cfg, args, bandwidth: float) -> list[dict]:
    import transformers

    model = mff.build(family, cfg)
    params = {k: v.detach() for k, v in model.init(seed=0).items()}
    with tempfile.TemporaryDirectory() as d:
        mff.save_hf(model, params, Path(d) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(d) / "hf", dtype=torch.float32).eval()
    bf16 = model.cast(params, torch.bfloat16)
    eager32, eager16 = decode_layout(params), decode_layout(bf16)  # as the generate recipe lays out eager weights
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    n = args.new_tokens

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == args.prompt_len + n

    fp32_bytes = sum(t.numel() * t.element_size() for t in params.values())
    bf16_bytes = sum(t.numel() * t.element_size() for t in bf16.values())
    runs = {"HF fp32": run_hf,
            "mff fp32 eager": lambda: generate(model, eager32, ids, n),
            "mff fp32 compiled": lambda: generate(model, params, ids, n, compile=True),
            "mff bf16 eager": lambda: generate(model, eager16, ids, n),
            "mff bf16 compiled": lambda: generate(model, bf16, ids, n, compile=True)}
    weight_bytes = {k: (bf16_bytes if "bf16" in k else fp32_bytes) for k in runs}
    read_bytes = {k: bytes_read_per_token(bf16 if "bf16" in k else params, cfg) for k in runs}
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for k, fn in runs.items():
            times[k].append(timed(fn))
    # cache elements per token per layer
    with torch.no_grad():
        hf_cache = hf(ids, use_cache=True).past_key_values
    layer = hf_cache.layers[0]
    hf_elems = (layer.keys[0, :, 0].numel() + layer.values[0, :, 0].numel())
    mff_cache = model.init_cache(1, 1)
    mff_elems = sum(t[0, 0].numel() for t in mff_cache["layers"][0].values())
    rows = []
    hf_tps = n / statistics.median(times["HF fp32"])
    for k in runs:
        tps = n / statistics.median(times[k])
        limit = bandwidth / read_bytes[k]
        rows.append({"config": name, "run": k, "tok/s": tps, "x HF": tps / hf_tps, "% of BW limit": 100 * tps / limit,
                     "cache/token/layer": hf_elems if k.startswith("HF") else mff_elems, "weights MB": weight_bytes[k] / 1e6,
                     "read MB/token": read_bytes[k] / 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = read_bandwidth()
    print(f"threads {args.threads}, prompt {args.prompt_len}, new tokens {args.new_tokens}, median of {args.repeats}; "
          f"measured read bandwidth {bw / 1e9:.1f} GB/s")
    rows = []
    for name in args.configs:
        family, cfg = CONFIGS[name]
        rows += bench_config(name, family, cfg, args, bw)
    head = ["config", "run", "weights MB", "read MB/token", "tok/s", "x HF", "% of BW limit", "cache/token/layer"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join((f"{r[h]:.2f}" if h == "x HF" else f"{r[h]:.1f}") if isinstance(r[h], float) else str(r[h])
                                for h in head) + " |")


if __name__ == "__main__":
    main()
