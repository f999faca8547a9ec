"""Pretraining from MindRecord: a MindRecord dataset's ``input_ids`` rows seen as a Megatron indexed dataset.

``--data.path X.mindrecord`` (any shard of a multi-shard dataset, a folder of ``.mindrecord``
files or a glob pattern; also inside a Megatron blend, ``0.7 A.mindrecord 0.3 PREFIX_B``) feeds
pretraining through the same GPT-sample, blend, split and resume machinery as ``.bin/.idx`` data
(:mod:`mff.data.megatron_source`): :class:`MindRecordTokens` offers what
:class:`mff.data.indexed.IndexedDataset` offers (``sequence_lengths``, ``get``, ``prefix``,
``fingerprint``), one row = one sequence = one document. Only ``input_ids`` is read; a ``labels``
field is ignored (labels are the next tokens, as in MindFormers pretraining).

How rows become samples (chosen from the row lengths of the whole dataset):

- Every row holds ``seq_len + 1`` tokens (MindFormers' pretraining MindRecord: documents already
  packed into rows of ``seq_length + 1``, read by ``MindDataset`` one row per sample): each row is
  one sample, ``input_ids = row[:-1]``, ``labels = row[1:]`` (:class:`PackedRows`), so the model
  sees exactly the sequences MindFormers trains on. Rows are shuffled per epoch with the run seed
  (``--data.shuffle``), and repeated in new epochs when more samples are needed.
- Otherwise rows are variable-length documents: Megatron's GPT samples are cut across them
  (:class:`mff.data.gpt_dataset.GPTDataset`: document, sample and shuffle indices), as for a
  ``.bin/.idx`` dataset holding the same documents.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections import OrderedDict

import numpy as np

from .gpt_dataset import GPTDataset, GPTDatasetConfig, sample_fields
from .mindrecord import MindRecordDataset, MindRecordError, find_shards

__all__ = ["MindRecordTokens", "PackedRows", "open_mindrecord_tokens"]

TOKEN_FIELD = "input_ids"


class MindRecordTokens:
    """The ``input_ids`` rows of a MindRecord dataset with the interface of
    :class:`mff.data.indexed.IndexedDataset` (one sequence per document).

    Args:
        path: see :class:`mff.data.mindrecord.MindRecordDataset`.
        field: the token field (an int32/int64 array field).

    Attributes:
        prefix: ``path`` as given. dataset: the rows. dtype: the field's numpy dtype.
        sequence_lengths: int32 [rows], tokens per row. document_indices: int64 [rows + 1].

    Raises:
        FileNotFoundError: see :func:`mff.data.mindrecord.find_shards`.
        MindRecordError: a bad file, or a schema without ``field`` as an integer array (the
            message lists the schema's fields).
    """

    def __init__(self, path: str, field: str = TOKEN_FIELD):
        self.prefix = str(path)
        self.field = field
        self.dataset = MindRecordDataset(path)
        first = self.dataset.shards[0]
        first.check_fields([field])
        spec = self.dataset.schema[field]
        if spec["type"] not in ("int32", "int64") or field not in first.blob_fields:
            raise MindRecordError(f"{first.path}: field {field!r} is {spec}, expected an int32/int64 array of token ids")
        self.dtype = np.dtype(np.int32 if spec["type"] == "int32" else np.int64)
        self.sequence_lengths = self.dataset.array_lengths(field).astype(np.int32)
        self.document_indices = np.arange(len(self.sequence_lengths) + 1, dtype=np.int64)
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-1 over every shard's header and the row lengths: names the index caches built over
        this dataset (the indices depend on the lengths only)."""
        h = hashlib.sha1()
        for s in self.dataset.shards:
            h.update(s.header_bytes)
        h.update(self.sequence_lengths.tobytes())
        return h.hexdigest()

    @property
    def cache_folder(self) -> str:
        """Where the GPT indices over this dataset are cached: ``cache/GPTDataset_indices`` in the
        folder given, or beside the first shard (Megatron's place is inside the prefix)."""
        base = self.prefix if os.path.isdir(self.prefix) else os.path.dirname(os.path.abspath(self.dataset.shards[0].path))
        return os.path.join(base, "cache", "GPTDataset_indices")

    def __len__(self) -> int:
        """Rows (sequences)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Rows (each is a document)."""
        return len(self)

    def _row(self, i: int) -> np.ndarray:
        row = self._rows.get(i)
        if row is None:
            row = self.dataset.read(i, [self.field])[self.field].reshape(-1)
            self._rows[i] = row
            if len(self._rows) > 64:  # consecutive samples share rows: keep the last few decoded
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(i)
        return row

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length - 1`` of row ``i`` (as ``IndexedDataset.get``).

        Raises:
            IndexError: ``i`` out of range or the slice outside the row.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"MindRecord: row {i} out of range for {n} rows in {self.prefix}")
        i = int(i) % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"MindRecord: tokens [{offset}, {offset + length}) are outside row {i} of length {size} in {self.prefix}")
        return self._row(i)[offset:offset + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def rows_are_samples(self, seq_len: int, documents: np.ndarray | None = None) -> bool:
        """Whether every row (of ``documents``, default all) holds ``seq_len + 1`` tokens: packed
        MindFormers rows, read one per sample."""
        lengths = self.sequence_lengths if documents is None else self.sequence_lengths[np.asarray(documents, dtype=np.int64)]
        return bool(len(lengths)) and bool(np.all(lengths == seq_len + 1))

    def build_samples(self, documents: np.ndarray, num_samples: int | None, config: GPTDatasetConfig, split_name: str):
        """The samples of one split: :class:`PackedRows` when all rows of the dataset hold
        ``seq_len + 1`` tokens, else Megatron's :class:`GPTDataset` over the rows as documents."""
        if self.rows_are_samples(config.seq_len):
            return PackedRows(self, documents, num_samples, config, split_name)
        return GPTDataset(self, documents, num_samples, config, split_name)


class PackedRows:
    """One sample per row, for rows of exactly ``seq_len + 1`` tokens (MindFormers' packed
    pretraining rows, read as its ``MindDataset`` reads them).

    The sample stream is the split's rows in ``E = ceil(num_samples / rows)`` epochs (at least one),
    each epoch a fresh permutation from ``numpy.random.RandomState(config.seed)`` (rows in order
    when ``config.shuffle`` is False). ``len`` counts whole epochs.

    Raises:
        ValueError: an option that needs ``eod_id`` without it, rows of another length, or samples
            asked of a split with no rows.
    """

    def __init__(self, tokens: MindRecordTokens, documents: np.ndarray, num_samples: int | None, config: GPTDatasetConfig,
                 split_name: str = "train"):
        if (config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss) and config.eod_id is None:
            raise ValueError("gpt dataset: reset_position_ids, reset_attention_mask and eod_mask_loss need eod_id")
        docs = np.asarray(documents, dtype=np.int64)
        if num_samples and not len(docs):
            raise ValueError(f"MindRecord: the {split_name} split of {tokens.prefix} has no rows (--split {config.split!r}), "
                             f"but {num_samples} samples are asked of it")
        if len(docs) and not tokens.rows_are_samples(config.seq_len, docs):
            raise ValueError(f"MindRecord: {tokens.prefix} rows are not all {config.seq_len + 1} tokens long")
        self.indexed, self.config, self.split_name = tokens, config, split_name
        epochs = max(1, -(-int(num_samples) // len(docs))) if num_samples and len(docs) else 1
        rng = np.random.RandomState(config.seed) if config.shuffle else None
        self.rows = np.concatenate([rng.permutation(docs) if rng is not None else docs for _ in range(epochs)]) if len(docs) else docs

    def __len__(self) -> int:
        """Samples (whole epochs of the split's rows)."""
        return len(self.rows)

    def tokens(self, i: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``i`` (a whole row), int64."""
        if not 0 <= i < len(self):
            raise IndexError(f"MindRecord: sample {i} out of range for {len(self)} {self.split_name} samples of {self.indexed.prefix}")
        return np.asarray(self.indexed.get(int(self.rows[i])), dtype=np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Sample ``i`` as a training example (see :func:`mff.data.gpt_dataset.sample_fields`)."""
        return sample_fields(self.tokens(i), self.config)


def _signature(path: str) -> tuple:
    files = [f for shards in find_shards(path) for f in shards]
    return tuple((os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files)


@functools.lru_cache(maxsize=8)
def _open(path: str, field: str, signature: tuple) -> MindRecordTokens:
    return MindRecordTokens(path, field)


def open_mindrecord_tokens(path: str, field: str = TOKEN_FIELD) -> MindRecordTokens:
    """:class:`MindRecordTokens` of ``path``, reused while its files are unchanged (opening scans
    every row's length once; a run opens each dataset several times)."""
    return _open(str(path), field, _signature(str(path)))
