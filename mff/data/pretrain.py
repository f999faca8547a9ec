"""`build_pretrain_data`: corpus -> tokenizer -> token streams (cached) -> packed windows."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from .cache import atomic_dir, cache_key, file_sha1, save_json, save_npy
from .config import DataConfig, resolve_cache_dir
from .corpus import discover_files, read_documents, split_documents
from .packing import PackedTokens
from .tokenizer import (
    DEFAULT_EOD_TOKEN,
    encode_documents,
    find_eod_id,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

CACHE_FORMAT = 2
"""Bumped whenever the cached content for the same inputs would change."""


@dataclass
class PretrainData:
    """Everything the pretraining recipe needs from the data side.

    Attributes:
        tokenizer: the tokenizer (trained or loaded), padding and truncation off.
        eod_id: end-of-document token id, appended after every document.
        vocab_size: ``tokenizer.get_vocab_size()`` (added tokens included).
        train: packed training windows (name "train").
        val: packed validation windows (name "val").
        stats: ``files``, ``skipped_non_utf8``, ``documents_train``, ``documents_val``,
            ``tokens_train``, ``tokens_val`` (EODs included), ``bytes_train``, ``bytes_val``,
            ``bytes`` (UTF-8 bytes of the documents), all ints.
        cache_path: the cache folder the token streams were read from.
        from_cache: True when nothing had to be built.
    """

    tokenizer: Tokenizer
    eod_id: int
    vocab_size: int
    train: PackedTokens
    val: PackedTokens
    stats: dict[str, int] = field(default_factory=dict)
    cache_path: str = ""
    from_cache: bool = False


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"data: {msg}", flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _key_parts(cfg: DataConfig, files, roots) -> dict[str, Any]:
    if cfg.tokenizer is None:
        tok: dict[str, Any] = {
            "bpe_vocab_size": cfg.vocab_size,
            "eod_token": cfg.eod_token or DEFAULT_EOD_TOKEN,
            "tokenizers_version": tokenizers.__version__,
        }
    else:
        path = os.path.abspath(os.path.expanduser(cfg.tokenizer))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data: tokenizer file not found: {cfg.tokenizer!r}")
        tok = {"file_sha1": file_sha1(path), "eod_token": cfg.eod_token}
        if os.path.isfile(path + ".json"):  # a tiktoken file's sidecar (regex, special tokens) changes the ids too
            tok["sidecar_sha1"] = file_sha1(path + ".json")
    return {
        "format": CACHE_FORMAT,
        "roots": roots,
        "files": [[f.rel, f.size, f.mtime_ns] for f in files],
        "tokenizer": tok,
        "val_permille": cfg.val_permille,
        "text_field": cfg.text_field,
    }


def _read_cache(path: str) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict[str, Any]] | None:
    """The cache entry at `path`, or None when it is absent or not of this format."""
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        if meta.get("format") != CACHE_FORMAT:
            return None
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        train = np.load(os.path.join(path, "train.npy"), mmap_mode="r", allow_pickle=False)
        val = np.load(os.path.join(path, "val.npy"), mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, json.JSONDecodeError):
        return None
    except Exception:  # tokenizers raises a bare Exception on a bad file
        return None
    return tok, train, val, meta


def _build(cfg: DataConfig, files, roots, final: str, quiet: bool) -> None:
    """Read, split, tokenize and write one cache entry at `final` (atomically)."""
    t0 = time.perf_counter()
    docs, skipped = read_documents(files, cfg.text_field)
    where = "the Python standard library" if not cfg.path else ", ".join(cfg.path)
    _say(quiet, f"read {len(docs)} documents from {len(files)} files in {where}"
         + f" ({skipped} non-UTF-8 files skipped, empty documents dropped)")
    if not docs:
        raise ValueError(f"data: empty corpus: no non-empty documents in {len(files)} files of {where}"
                         + (f" ({skipped} of them not UTF-8, skipped)" if skipped else ""))
    train_docs, val_docs = split_documents(docs, cfg.val_permille)
    train_texts = [d.text for d in train_docs]
    val_texts = [d.text for d in val_docs]
    del docs, train_docs, val_docs
    bytes_train = sum(len(t.encode("utf-8")) for t in train_texts)
    bytes_val = sum(len(t.encode("utf-8")) for t in val_texts)

    if cfg.tokenizer is None:
        eod_token = cfg.eod_token or DEFAULT_EOD_TOKEN
        _say(quiet, f"training BPE tokenizer (vocab {cfg.vocab_size}) on {_mb(bytes_train)} ...")
        t1 = time.perf_counter()
        tok = train_bpe(train_texts, cfg.vocab_size, eod_token)
        got = tok.get_vocab_size()
        _say(quiet, f"trained BPE tokenizer in {time.perf_counter() - t1:.1f} s"
             + (f"; the corpus gave only {got} of the {cfg.vocab_size} tokens asked for" if got < cfg.vocab_size else ""))
        eod_id = find_eod_id(tok, eod_token)
    else:
        tok = load_tokenizer(os.path.abspath(os.path.expanduser(cfg.tokenizer)))
        eod_id = find_eod_id(tok, cfg.eod_token)
    dtype = token_dtype(tok.get_vocab_size())

    _say(quiet, f"tokenizing {len(train_texts)} train + {len(val_texts)} val documents "
         f"({_mb(bytes_train + bytes_val)}) ...")
    t1 = time.perf_counter()
    train = encode_documents(tok, train_texts, eod_id, dtype)
    val = encode_documents(tok, val_texts, eod_id, dtype)
    _say(quiet, f"tokenized into {len(train):,} train + {len(val):,} val tokens in "
         f"{time.perf_counter() - t1:.1f} s")

    stats = {
        "files": len(files),
        "skipped_non_utf8": skipped,
        "documents_train": len(train_texts),
        "documents_val": len(val_texts),
        "tokens_train": int(len(train)),
        "tokens_val": int(len(val)),
        "bytes_train": bytes_train,
        "bytes_val": bytes_val,
        "bytes": bytes_train + bytes_val,
    }
    meta = {
        "format": CACHE_FORMAT,
        "eod_id": eod_id,
        "dtype": dtype.name,
        "stats": stats,
        "config": {"path": list(cfg.path), "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size,
                   "eod_token": cfg.eod_token, "text_field": cfg.text_field,
                   "val_permille": cfg.val_permille},
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    with atomic_dir(final) as tmp:
        tmp_tok = os.path.join(tmp, ".tokenizer.json.tmp")
        tok.save(tmp_tok)
        os.replace(tmp_tok, os.path.join(tmp, "tokenizer.json"))
        save_npy(tmp, "train.npy", train)
        save_npy(tmp, "val.npy", val)
        save_json(tmp, "meta.json", meta)  # written last: marks the entry complete
    _say(quiet, f"cached at {final} ({time.perf_counter() - t0:.1f} s)")


def _load_or_build(cfg: DataConfig, quiet: bool) -> tuple[str, bool]:
    """Make sure the cache entry for `cfg` exists; return ``(its path, was it already there)``."""
    files, roots = discover_files(cfg.path)
    key = cache_key(_key_parts(cfg, files, roots))
    final = os.path.join(resolve_cache_dir(cfg), key)
    if _read_cache(final) is not None:
        return final, True
    if os.path.isdir(final):  # an entry of another format or damaged by hand: rebuild it
        shutil.rmtree(final)
    if not files:
        raise ValueError(f"data: empty corpus: no .txt or .jsonl files found in {list(cfg.path)}")
    _build(cfg, files, roots, final, quiet)
    return final, False


def _rank_zero_first(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 first, then on the other ranks, when torch.distributed is up.

    Rank 0 builds the cache; the others wait for its verdict (a broadcast, so an error on
    rank 0 stops them instead of leaving them in a barrier) and then load it, building their own
    copy only if rank 0's is not visible to them (e.g. a node-local cache folder).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    status: list[Any] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except BaseException as e:
            status[0] = f"{type(e).__name__}: {e}"
            dist.broadcast_object_list(status, src=0)
            raise
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None and dist.get_rank() != 0:
        raise RuntimeError(f"data: rank 0 failed to build the dataset: {status[0]}")
    if dist.get_rank() != 0:
        result = fn()
    return result


def build_pretrain_data(cfg: DataConfig, seq_len: int, *, quiet: bool = False) -> PretrainData:
    """Build (or load from cache) the tokenizer and the packed train/val token streams.

    On a cache miss: read the corpus (`discover_files`, `read_documents`), split it by document
    (`split_documents`), train a byte-level BPE on the train split or load ``cfg.tokenizer``,
    encode each split (documents in order, EOD after each) and store tokenizer.json,
    train.npy, val.npy and meta.json under ``<cache_dir>/<key>/``. The key hashes the input
    files' (relative path, size, mtime_ns), their roots, the tokenizer (file SHA-1, or BPE
    settings and tokenizers version), val_permille, text_field and `CACHE_FORMAT`. A hit only
    lists and stats the input files. Under torch.distributed, rank 0 builds first.

    Args:
        cfg: the data config.
        seq_len: training sequence length T; windows hold T + 1 tokens.
        quiet: no progress lines (rank != 0 is always quiet).

    Returns:
        `PretrainData`; its token arrays are read-only memmaps of uint16 (vocab <= 65536) or
        uint32.

    Raises:
        FileNotFoundError: a corpus path or the tokenizer file is missing.
        ValueError: empty corpus, a bad .jsonl line (file:line), an unknown EOD token, a bad
            tokenizer file, a split shorter than ``seq_len + 1`` tokens, or a bad setting.
    """
    if seq_len < 1:
        raise ValueError(f"data: seq_len must be >= 1, got {seq_len}")
    t0 = time.perf_counter()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            quiet = True
    except ImportError:  # pragma: no cover
        pass
    path, hit = _rank_zero_first(lambda: _load_or_build(cfg, quiet))
    loaded = _read_cache(path)
    if loaded is None:
        raise RuntimeError(f"data: the cache entry {path} could not be read back")
    tok, train, val, meta = loaded
    eod_id = int(meta["eod_id"])
    if hit:
        s = meta["stats"]
        _say(quiet, f"loaded cached tokens from {path} ({s['tokens_train']:,} train + "
             f"{s['tokens_val']:,} val) in {time.perf_counter() - t0:.2f} s")
    return PretrainData(
        tokenizer=tok,
        eod_id=eod_id,
        vocab_size=tok.get_vocab_size(),
        train=PackedTokens(train, seq_len, eod_id, name="train"),
        val=PackedTokens(val, seq_len, eod_id, name="val"),
        stats=dict(meta["stats"]),
        cache_path=path,
        from_cache=hit,
    )
