"""Pretraining data: corpus discovery and split, tokenizers, cached token streams, packing, loaders.

Entry point: `build_pretrain_data(DataConfig(...), seq_len)` -> `PretrainData` with the
tokenizer and packed train/val windows; `Loader` turns windows into deterministic, resumable,
data-parallel batches.
"""

from .config import DataConfig, resolve_cache_dir
from .corpus import (
    Document,
    SourceFile,
    discover_files,
    is_validation,
    read_documents,
    split_documents,
    stdlib_root,
)
from .loader import Loader, eval_batches, split_microbatches
from .packing import PackedTokens, document_ids, windows_to_examples
from .pretrain import PretrainData, build_pretrain_data
from .stats import unigram_entropy
from .tokenizer import (
    EOD_CANDIDATES,
    encode_documents,
    find_eod_id,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "DataConfig",
    "Document",
    "EOD_CANDIDATES",
    "Loader",
    "PackedTokens",
    "PretrainData",
    "SourceFile",
    "build_pretrain_data",
    "discover_files",
    "document_ids",
    "encode_documents",
    "eval_batches",
    "find_eod_id",
    "is_validation",
    "load_tokenizer",
    "read_documents",
    "resolve_cache_dir",
    "split_documents",
    "split_microbatches",
    "stdlib_root",
    "token_dtype",
    "train_bpe",
    "unigram_entropy",
    "windows_to_examples",
]
