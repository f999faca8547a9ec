"""Configuration of the pretraining data pipeline (parsed by tyro as ``--data.*`` flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_CACHE_DIR = "~/.cache/mff"
"""The `DataConfig.cache_dir` default; the ``MFF_CACHE_DIR`` environment variable replaces it."""

CACHE_DIR_ENV = "MFF_CACHE_DIR"


@dataclass(frozen=True)
class DataConfig:
    """Where the pretraining text comes from, how it is tokenized, split and cached."""

    path: tuple[str, ...] = ()
    """Corpus inputs: .txt files (one document each), .jsonl files (one document per line) or folders (every .txt and .jsonl inside, recursively); or Megatron indexed datasets in Megatron's blend syntax: PREFIX, or "0.7 PREFIX_A 0.3 PREFIX_B" (PREFIX.bin/.idx files, e.g. from mff.recipes.preprocess); a PREFIX may also be MindRecord data (X.mindrecord, any shard of a multi-shard dataset, or a folder of .mindrecord files) whose input_ids rows are the documents (rows of exactly seq-len + 1 tokens are one sample each, as MindFormers reads them). Empty: the .py files of the running Python's standard library, one document per file."""

    tokenizer: str | None = None
    """A Hugging Face tokenizer.json or a tiktoken rank file (*.tiktoken, regex and special tokens from a <file>.json sidecar or its known name, see mff.data.tiktoken_bpe) to use. None: train a byte-level BPE on the train split."""

    vocab_size: int = 8192
    """Vocabulary size of the trained byte-level BPE, special tokens included (at least 257).
    Ignored when --data.tokenizer is given."""

    eod_token: str | None = None
    """End-of-document token appended after every document. None: "<|endoftext|>" for the
    trained BPE; for a given tokenizer the first of its special tokens among "<|endoftext|>",
    "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>" (error if it has none)."""

    text_field: str = "text"
    """Field of each .jsonl record that holds the document text."""

    val_permille: int = 20
    """Share of documents in the validation split, per mille (0..1000), chosen by a stable
    SHA-1 hash of each document's key (relative path, plus ":<line>" for .jsonl lines). The
    validation split is never empty (it then takes the last document) and never holds every
    document (the first one then goes back to training)."""

    cache_dir: str = DEFAULT_CACHE_DIR
    """Folder for the tokenizer and tokenized corpus cache. When left at the default, the
    MFF_CACHE_DIR environment variable (if set) is used instead."""

    shuffle: bool = True
    """Shuffle training samples (a fresh permutation per epoch, seeded by the run seed). Megatron data: False keeps documents and samples in order (Megatron itself always shuffles)."""

    split: str = "969,30,1"
    """Megatron data: train,valid,test weights splitting the documents of each prefix (Megatron's --split)."""

    reset_position_ids: bool = False
    """Megatron data: positions restart at 0 after each EOD token (Megatron's --reset-position-ids)."""

    reset_attention_mask: bool = False
    """Megatron data: tokens attend only within their document (Megatron's --reset-attention-mask)."""

    eod_mask_loss: bool = False
    """Megatron data: no loss on targets of EOD input tokens (Megatron's --eod-mask-loss)."""

    eod_id: int | None = None
    """Megatron data: the EOD token id, when no --data.tokenizer gives it (needed by the three options above)."""


def resolve_cache_dir(cfg: DataConfig) -> str:
    """The absolute cache folder for `cfg`.

    Returns ``$MFF_CACHE_DIR`` when ``cfg.cache_dir`` is the default and the variable is set,
    else ``cfg.cache_dir``; ``~`` is expanded and the result made absolute. Nothing is created.
    """
    raw = cfg.cache_dir
    if raw == DEFAULT_CACHE_DIR and os.environ.get(CACHE_DIR_ENV):
        raw = os.environ[CACHE_DIR_ENV]
    return os.path.abspath(os.path.expanduser(raw))
