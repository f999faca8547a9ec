"""Pretraining data: corpus discovery and split, tokenizers, cached token streams, packing,
loaders; Megatron indexed datasets, GPT samples and blending.

Raw text: `build_pretrain_data(DataConfig(...), seq_len)` -> `PretrainData` with the tokenizer
and packed train/val windows; `Loader` turns windows into deterministic, resumable,
data-parallel batches. Megatron data: `IndexedDataset` / `IndexedDatasetBuilder` (.bin/.idx),
`build_gpt_datasets` / `build_blended_gpt_datasets` (Megatron's samples), and
`build_megatron_data` + `SampleLoader` for pretraining. MindRecord: `MindRecordDataset` /
`write_mindrecord` (no MindSpore needed); as ``--data.path`` it feeds the same pipeline.
"""

from .blend import Blend, BlendedDataset, build_blended_gpt_datasets, build_blending_indices, parse_blend
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
from .gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets
from .indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from .loader import Loader, eval_batches, split_microbatches
from .megatron_source import MegatronData, SampleLoader, as_blend, build_megatron_data
from .mindrecord import MindRecordDataset
from .mindrecord_writer import write_mindrecord
from .packing import PackedTokens, document_ids, windows_to_examples
from .pretrain import PretrainData, build_pretrain_data
from .stats import unigram_entropy
from .tiktoken_bpe import TiktokenEncoder, is_tiktoken_file, load_tiktoken
from .tokenizer import (
    EOD_CANDIDATES,
    encode_documents,
    find_eod_id,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "Blend",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronData",
    "MindRecordDataset",
    "SampleLoader",
    "TiktokenEncoder",
    "as_blend",
    "best_dtype",
    "build_blended_gpt_datasets",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_megatron_data",
    "is_tiktoken_file",
    "load_tiktoken",
    "parse_blend",
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
    "write_mindrecord",
]
