"""Megatron-LM GPT samples over an indexed dataset: split, document, sample and shuffle indices.

Same indices as Megatron-LM (``megatron/core/datasets/gpt_dataset.py``: ``GPTDataset``,
``_build_document_sample_shuffle_indices``, ``_build_document_index``, ``_build_shuffle_index``,
``_get_num_epochs``; ``helpers.cpp``: ``build_sample_idx``; ``blended_megatron_dataset_config.py``:
``parse_and_normalize_split``, ``convert_split_vector_to_split_matrix``;
``blended_megatron_dataset_builder.py``: ``_build_megatron_dataset_splits``) for the same files,
seed, sequence length, split and sample count, so a Megatron user sees the same samples in the
same order. Megatron's defaults are assumed: ``add_extra_token_to_sequence=True`` (a sample is
``seq_len + 1`` tokens and consecutive samples share one) and dropping the last partial sample.

The stream: the split's documents repeated for ``num_epochs`` and shuffled (document index);
sample ``j`` covers stream tokens ``[j * seq_len, (j + 1) * seq_len]`` and is stored as the
(document-index position, offset) of its first token (sample index); the samples are read in a
shuffled order (shuffle index).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import dataclass

import numpy as np

from .cache import cache_key, save_json, save_npy
from .indexed import IndexedDataset, open_indexed
from .packing import document_ids as _document_ids

SPLIT_NAMES = ("train", "valid", "test")
_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron: separate the last epoch when it is less than 80% used


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How samples are cut and what each sample carries (Megatron's ``GPTDatasetConfig`` names).

    Args:
        seq_len: tokens per sample input (``--seq-length``); a sample reads ``seq_len + 1``.
        seed: seed of the numpy ``RandomState`` that shuffles (``--seed``, default 1234).
        split: train/valid/test weights, e.g. ``"969,30,1"`` (``--split``).
        eod_id: end-of-document token id; needed by the three options below.
        reset_position_ids: positions restart at 0 after each EOD input token.
        reset_attention_mask: tokens after an EOD belong to the next document (``document_ids``).
        eod_mask_loss: no loss where the input token is EOD (its label becomes -100).
        shuffle: False (mff only; Megatron always shuffles) keeps documents and samples in order.
        cache_dir: where the indices are cached; None is Megatron's default,
            ``PREFIX/cache/GPTDataset_indices``.
        cache: False never reads or writes cached indices.
    """

    seq_len: int
    seed: int = 1234
    split: str = "969,30,1"
    eod_id: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    shuffle: bool = True
    cache_dir: str | None = None
    cache: bool = True


def parse_split(split: str) -> list[float]:
    """Normalised train/valid/test weights (Megatron's ``parse_and_normalize_split``).

    ``"969,30,1"`` -> ``[0.969, 0.03, 0.001]``; missing trailing weights are 0. Separators may be
    commas, slashes or spaces.

    Raises:
        ValueError: a token that is not a non-negative number, more than 3 weights, or all zero
            (the message names the string and the token).
    """
    tokens = [t for t in re.split(r"[,/\s]+", str(split).strip()) if t]
    values = []
    for tok in tokens:
        if not re.fullmatch(r"[.0-9]+", tok):
            raise ValueError(f"split {split!r}: {tok!r} is not a non-negative number (expected e.g. '969,30,1')")
        try:
            values.append(float(tok))
        except ValueError:
            raise ValueError(f"split {split!r}: {tok!r} is not a number (expected e.g. '969,30,1')") from None
    if not 1 <= len(values) <= 3:
        raise ValueError(f"split {split!r}: expected 1 to 3 weights (train, valid, test), got {len(values)}")
    values += [0.0] * (3 - len(values))
    w = np.array(values, dtype=np.float64)
    total = np.sum(w)
    if not total > 0:
        raise ValueError(f"split {split!r}: the weights sum to 0")
    return (w / total).tolist()


def split_ranges(split: str, num_elements: int) -> list[tuple[int, int] | None]:
    """Sequence-index ranges ``[begin, end)`` of train, valid and test; None for an empty weight.

    Megatron's rule: bookends are the running sums of the normalised weights, and split i is
    ``int(round(start_i * n)) .. int(round(end_i * n))`` (Python's round: half to even).

    Raises:
        ValueError: see `parse_split`.
    """
    bookends = [0.0]
    for w in parse_split(split):
        bookends.append(bookends[-1] + w)
    out: list[tuple[int, int] | None] = []
    for a, b in zip(bookends[:-1], bookends[1:]):
        if b <= a:
            out.append(None)
        else:
            out.append((int(round(a * float(num_elements))), int(round(b * float(num_elements)))))
    return out


def num_epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: int | None) -> int:
    """Epochs needed to cut `num_samples` samples (Megatron's ``_get_num_epochs``); 1 for None or 0.

    A request for n samples needs ``n * seq_len + 1`` tokens.

    Raises:
        ValueError: `tokens_per_epoch` < 1 while samples are requested (Megatron loops forever).
    """
    if not num_samples:
        return 1
    needed = int(num_samples) * seq_len + 1
    if tokens_per_epoch < 1:
        raise ValueError(f"gpt dataset: the documents hold no tokens, cannot cut {num_samples} samples")
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState | None,
                         separate_final_epoch: bool) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled (Megatron's ``_build_document_index``).

    With `separate_final_epoch` (and more than one epoch) the first ``num_epochs - 1`` epochs are
    shuffled together and the last one separately after them. `rng` None: no shuffle.

    Returns:
        int32 [num_epochs * len(documents)].
    """
    docs = np.asarray(documents)
    if not separate_final_epoch or num_epochs == 1:
        out = np.tile(docs, num_epochs).astype(np.int32)
        if rng is not None:
            rng.shuffle(out)
        return out
    first = build_document_index(docs, num_epochs - 1, rng, False)
    last = build_document_index(docs, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_len: int,
                       num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """Start of every sample in the document-index stream (Megatron's ``helpers.cpp:build_sample_idx``).

    Row j is ``(p, o)``: sample j starts at token o of document ``document_index[p]``, the
    document holding stream token ``j * seq_len`` (empty documents hold none); row 0 is (0, 0).
    There are ``num_samples = (num_epochs * tokens_per_epoch - 1) // seq_len`` samples and
    ``num_samples + 1`` rows: sample j ends (inclusive) where sample j + 1 starts.

    Returns:
        int32 [num_samples + 1, 2], int64 when a value could exceed int32 (as Megatron).
    """
    lengths = np.asarray(sequence_lengths)[np.asarray(document_index)].astype(np.int64)
    ends = np.cumsum(lengths)
    n = (num_epochs * tokens_per_epoch - 1) // seq_len
    if n < 0:
        n = 0
    pos = np.arange(n + 1, dtype=np.int64) * seq_len
    d = np.searchsorted(ends, pos, side="right") if len(ends) else np.zeros(n + 1, np.int64)
    d = np.minimum(d, max(len(ends) - 1, 0))
    off = pos - (ends[d] - lengths[d]) if len(ends) else pos
    limit = max(len(document_index), int(np.max(sequence_lengths)) if len(sequence_lengths) else 0)
    dtype = np.int32 if limit <= np.iinfo(np.int32).max else np.int64
    out = np.stack([d, off], axis=1).astype(dtype)
    out[0] = 0
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState | None) -> np.ndarray:
    """A permutation of ``range(total_size)`` (Megatron's ``_build_shuffle_index``).

    ``[0, num_samples)`` is shuffled, then ``[num_samples, total_size)`` separately after it.
    `rng` None: the identity.

    Returns:
        uint32 [total_size] (int64 when total_size >= 2**32 - 2).
    """
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    if rng is not None:
        rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    if rng is not None:
        rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sequence_lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int | None,
                  seed: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle indices (Megatron's ``_build_document_sample_shuffle_indices``).

    Args:
        sequence_lengths: int [S], tokens per sequence of the indexed dataset.
        documents: the split's sequence indices.
        seq_len: sample length (without the extra token).
        num_samples: samples wanted; None builds one epoch. The result may hold more (whole
            epochs are cut).
        seed: numpy ``RandomState`` seed, drawn first for the document index, then for the
            shuffle index.
        shuffle: False gives documents and samples in order.

    Returns:
        document index int32 [E * len(documents)], sample index [N + 1, 2], shuffle index [N].

    Raises:
        ValueError: `seq_len` < 1, or samples requested from documents without tokens.
    """
    if seq_len < 1:
        raise ValueError(f"gpt dataset: seq_len must be >= 1, got {seq_len}")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"gpt dataset: num_samples must be >= 0, got {num_samples}")
    lengths = np.asarray(sequence_lengths)
    docs = np.asarray(documents)
    tokens_per_epoch = int(np.sum(lengths[docs], dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate = num_samples - sans_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed) if shuffle else None
    document_index = build_document_index(docs, epochs, rng, separate)
    sample_index = build_sample_index(lengths, document_index, seq_len, epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


def _index_problem(document_index: np.ndarray, sample_index: np.ndarray, shuffle_index: np.ndarray,
                   sequence_lengths: np.ndarray) -> str | None:
    """What makes cached indices unusable for this data (None: they are consistent): document ids
    outside the dataset, sample starts outside the document index or their documents, a shuffle
    index that is not a permutation of the samples. One vectorised pass over each array."""
    n_docs, n_samples = len(sequence_lengths), len(shuffle_index)
    if len(document_index) and (int(document_index.min()) < 0 or int(document_index.max()) >= n_docs):
        return f"document ids outside [0, {n_docs})"
    if len(sample_index):
        pos, off = sample_index[:, 0].astype(np.int64), sample_index[:, 1].astype(np.int64)
        if int(pos.min()) < 0 or int(pos.max()) >= max(len(document_index), 1):
            return f"sample starts outside the {len(document_index)} document-index entries"
        if len(document_index):
            if int(off.min()) < 0 or bool(np.any(off > np.asarray(sequence_lengths)[np.asarray(document_index)[pos]])):
                return "sample offsets outside their documents"
        if np.any(np.diff(pos) < 0):
            return "sample starts that go backwards"
    if n_samples:
        if int(shuffle_index.min()) < 0 or int(shuffle_index.max()) >= n_samples:
            return f"shuffle entries outside [0, {n_samples})"
        if int(np.bincount(np.asarray(shuffle_index, dtype=np.int64), minlength=n_samples).max()) != 1:
            return "a shuffle index that repeats samples"
    return None


def _reset_positions(input_ids: np.ndarray, eod_id: int) -> np.ndarray:
    t = np.arange(len(input_ids), dtype=np.int64)
    start = np.zeros(len(input_ids), dtype=np.int64)
    after_eod = np.flatnonzero(input_ids[:-1] == eod_id) + 1
    start[after_eod] = after_eod
    return t - np.maximum.accumulate(start)


class GPTDataset:
    """Samples of ``seq_len + 1`` tokens over some documents of an indexed dataset.

    Args:
        indexed: the tokens.
        documents: sequence indices of this split (e.g. ``np.arange(begin, end)``).
        num_samples: samples wanted (None: one epoch); ``len(self)`` may be larger.
        config: see `GPTDatasetConfig`.
        split_name: "train", "valid" or "test" (names the cache files, as Megatron).

    Indices are read from the cache when a complete entry for the same .idx content, documents,
    seq_len, seed, shuffle flag, sample count and split exists, else built and written there
    (each file through a temp name; the description file last, so an entry is complete once it
    exists). A cache folder that cannot be written is warned about and skipped.

    Raises:
        ValueError: bad `config` (see `build_indices`), an option that needs ``eod_id`` without
            it, documents outside the indexed dataset, or samples asked of documents without
            tokens (Megatron would loop forever there).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int | None,
                 config: GPTDatasetConfig, split_name: str = "train"):
        if (config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss) and config.eod_id is None:
            raise ValueError("gpt dataset: reset_position_ids, reset_attention_mask and eod_mask_loss need eod_id")
        docs = np.asarray(documents, dtype=np.int64)
        if docs.size and (docs.min() < 0 or docs.max() >= len(indexed)):
            raise ValueError(
                f"gpt dataset: documents must be in 0..{len(indexed) - 1} for {indexed.prefix}, got {docs.min()}..{docs.max()}"
            )
        if num_samples and not np.any(indexed.sequence_lengths[docs]):
            raise ValueError(
                f"gpt dataset: the {split_name} split of {indexed.prefix} ({len(docs)} of {len(indexed)} documents, "
                f"--split {config.split!r}) holds no token, but {num_samples} samples are asked of it; give the split "
                f"weight 0, ask 0 samples or use more documents"
            )
        self.indexed = indexed
        self.documents = docs.astype(np.int32)
        self.num_samples = num_samples
        self.config = config
        self.split_name = split_name
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build()

    # -- index cache ---------------------------------------------------------------------
    def _description(self) -> dict:
        return {
            "class": "GPTDataset",
            "format": 1,
            "idx_sha1": self.indexed.fingerprint,
            "documents_sha1": hashlib.sha1(self.documents.tobytes()).hexdigest(),
            "num_documents": int(len(self.documents)),
            "num_samples": self.num_samples,
            "seq_len": self.config.seq_len,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "split": self.split_name,
        }

    def cache_paths(self) -> dict[str, str]:
        """The cache files of this dataset: keys description, document_index, sample_index, shuffle_index."""
        folder = (self.config.cache_dir or getattr(self.indexed, "cache_folder", None)
                  or os.path.join(self.indexed.prefix, "cache", "GPTDataset_indices"))
        base = f"{cache_key(self._description())}-GPTDataset-{self.split_name}"
        names = {"description": "description.json", "document_index": "document_index.npy",
                 "sample_index": "sample_index.npy", "shuffle_index": "shuffle_index.npy"}
        return {k: os.path.join(folder, f"{base}-{v}") for k, v in names.items()}

    def _load_or_build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cfg = self.config
        paths = self.cache_paths() if cfg.cache else None
        if paths and all(os.path.isfile(p) for p in paths.values()):
            try:
                arrays = tuple(np.load(paths[k], mmap_mode="r") for k in ("document_index", "sample_index", "shuffle_index"))
                d, s, p = arrays
                if d.ndim == 1 and s.ndim == 2 and s.shape[1] == 2 and p.shape == (s.shape[0] - 1,):
                    bad = _index_problem(d, s, p, self.indexed.sequence_lengths)
                    if bad is None:
                        return d, s, p
                    warnings.warn(f"gpt dataset: the cached indices {paths['sample_index']} (and its siblings) do not fit the data "
                                  f"({bad}); rebuilding them", stacklevel=3)
            except (OSError, ValueError):
                pass
        arrays = build_indices(self.indexed.sequence_lengths, self.documents, cfg.seq_len, self.num_samples,
                               cfg.seed, cfg.shuffle)
        if paths:
            try:
                folder = os.path.dirname(paths["description"])
                os.makedirs(folder, exist_ok=True)
                for key, arr in zip(("document_index", "sample_index", "shuffle_index"), arrays):
                    save_npy(folder, os.path.basename(paths[key]), arr)
                save_json(folder, os.path.basename(paths["description"]), self._description())
            except OSError as err:
                warnings.warn(f"gpt dataset: could not cache the indices in {folder}: {err}", stacklevel=3)
        return arrays

    # -- samples -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of samples (``sample_index`` rows - 1)."""
        return int(self.sample_index.shape[0]) - 1

    def tokens(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` token ids of sample `i` (after the shuffle): int64 [seq_len + 1].

        Raises:
            IndexError: `i` outside ``0 .. len(self) - 1``.
        """
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"gpt dataset: sample {i} out of range for {n} {self.split_name} samples of {self.indexed.prefix}")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, doc = self.indexed.get, self.document_index
        if d0 == d1:
            return np.asarray(get(int(doc[d0]), o0, o1 - o0 + 1), dtype=np.int64)
        parts = [get(int(doc[d0]), o0)]
        parts += [get(int(doc[k])) for k in range(d0 + 1, d1)]
        parts.append(get(int(doc[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample `i` as a training example (see `sample_fields`)."""
        return sample_fields(self.tokens(i), self.config)


def sample_fields(tokens: np.ndarray, cfg: GPTDatasetConfig) -> dict[str, np.ndarray]:
    """The training example of one sample's ``seq_len + 1`` tokens, each value int64 [seq_len].

    ``input_ids`` = tokens[:-1]; ``labels`` = tokens[1:] (-100 where the input token is EOD
    when ``eod_mask_loss``); ``position_ids``: 0..seq_len-1, restarting after each EOD input
    when ``reset_position_ids``; ``document_ids``: +1 after each EOD input when
    ``reset_attention_mask`` (see `mff.data.packing.document_ids`), else all 0.
    """
    w = np.asarray(tokens, dtype=np.int64)
    input_ids, labels = w[:-1].copy(), w[1:].copy()
    if cfg.eod_mask_loss:
        labels[input_ids == cfg.eod_id] = -100
    if cfg.reset_position_ids:
        position_ids = _reset_positions(input_ids, cfg.eod_id)
    else:
        position_ids = np.arange(len(input_ids), dtype=np.int64)
    if cfg.reset_attention_mask:
        doc_ids = _document_ids(input_ids, cfg.eod_id)
    else:
        doc_ids = np.zeros(len(input_ids), dtype=np.int64)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": doc_ids}


def make_dataset(indexed, documents: np.ndarray, num_samples: int | None, config: GPTDatasetConfig, split_name: str):
    """The samples of one split of ``indexed``: a `GPTDataset`, or what the dataset builds itself
    when it has a ``build_samples`` method (MindRecord rows that are already packed samples, see
    `mff.data.mindrecord_source`)."""
    build = getattr(indexed, "build_samples", None)
    if build is not None:
        return build(documents, num_samples, config, split_name)
    return GPTDataset(indexed, documents, num_samples, config, split_name)


def build_gpt_datasets(prefix: str | IndexedDataset, num_samples: tuple[int | None, int | None, int | None],
                       config: GPTDatasetConfig) -> list[GPTDataset | None]:
    """Train, valid and test `GPTDataset` of one indexed dataset, split by ``config.split``.

    Args:
        prefix: the indexed dataset or its path prefix.
        num_samples: samples wanted per split (None: one epoch of that split).
        config: see `GPTDatasetConfig`.

    Returns:
        three datasets; None for a split of weight 0.

    Raises:
        ValueError: a bad split string, or samples asked of a split that holds no token (the
            message names the prefix, the split and the document count). A split without
            tokens asked for 0 samples or None is an empty dataset, as in Megatron.
        FileNotFoundError: see `IndexedDataset`.
    """
    indexed = open_indexed(prefix) if isinstance(prefix, (str, os.PathLike)) else prefix
    out: list[GPTDataset | None] = []
    for name, rng, n in zip(SPLIT_NAMES, split_ranges(config.split, len(indexed)), num_samples):
        if rng is None:
            out.append(None)
            continue
        out.append(make_dataset(indexed, np.arange(rng[0], rng[1], dtype=np.int32), n, config, name))
    return out

