"""Megatron-LM indexed datasets: the ``PREFIX.bin`` / ``PREFIX.idx`` pair, read and written.

Format (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter``/``_IndexReader``):

``PREFIX.bin``: the token ids of every sequence back to back, in the dataset's dtype, no header.

``PREFIX.idx``, all little-endian::

    b"MMIDIDX\\x00\\x00"              9-byte magic
    uint64  version                  1
    uint8   dtype code               1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                     7 float32, 8 uint16
    uint64  sequence count S
    uint64  document count D         number of documents + 1
    int32   sequence lengths [S]     in tokens
    int64   sequence pointers [S]    byte offsets into .bin
    int64   document indices [D]     document boundaries as sequence indices: 0, ..., S

mff writes one sequence per document (Megatron's preprocessing without sentence splitting), so
sequence i is document i.
"""

from __future__ import annotations

import functools
import os
import struct

import numpy as np

from .cache import file_sha1

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's ``DType`` enum: code -> numpy dtype."""

_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


def idx_path(prefix: str) -> str:
    """``PREFIX.idx``."""
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    """``PREFIX.bin``."""
    return prefix + ".bin"


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype (see `DTYPE_CODES`).

    Raises:
        ValueError: a dtype the format has no code for.
    """
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise ValueError(f"indexed dataset: dtype {dt} is big-endian; the format is little-endian")
    code = _CODE_OF.get(np.dtype(dt.type))
    if code is None:
        raise ValueError(f"indexed dataset: dtype {dt} has no Megatron code; use one of {sorted(str(d) for d in _CODE_OF)}")
    return code


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary (``DType.optimal_dtype``).

    Returns:
        uint16 when ``vocab_size < 65500``, else int32.
    """
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def open_indexed(path):
    """The token sequences at ``path``: a Megatron `IndexedDataset` for a ``PREFIX``, or for
    MindRecord data (a ``.mindrecord`` file, a folder or glob of them) its ``input_ids`` rows
    with the same interface (`mff.data.mindrecord_source.MindRecordTokens`).

    Raises:
        FileNotFoundError, ValueError: see `IndexedDataset` and `mff.data.mindrecord_source`.
    """
    from .mindrecord import is_mindrecord

    if is_mindrecord(str(path)):
        from .mindrecord_source import open_mindrecord_tokens

        return open_mindrecord_tokens(str(path))
    return IndexedDataset(path)


class IndexedDataset:
    """Read-only view of a Megatron ``PREFIX.bin``/``PREFIX.idx`` pair.

    Both files are memory-mapped; nothing is loaded up front, and any sequence is read in O(1).

    Args:
        prefix: path without the ``.bin``/``.idx`` suffix.

    Attributes:
        prefix: as given.
        dtype: numpy dtype of the tokens.
        sequence_lengths: int32 [S] (a view into the mapped .idx).
        sequence_pointers: int64 [S], byte offsets into .bin.
        document_indices: int64 [D], sequence indices of document boundaries (0 first, S last).

    Raises:
        FileNotFoundError: ``PREFIX.idx`` or ``PREFIX.bin`` is missing (names the file).
        ValueError: (each message names the file and the bad and expected values) a wrong
            magic, an unsupported version, an unknown dtype code, an .idx whose size differs from
            what its header describes, negative lengths, document indices that do not run from 0
            to S without decreasing, pointers outside .bin, or a .bin whose size is not the end of
            the last sequence (truncated, or the .bin of another .idx).
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset: {path} does not exist (prefix {self.prefix!r})")
        idx_size = os.path.getsize(ipath)
        if idx_size < _HEADER.size:
            raise ValueError(f"indexed dataset: {ipath} has {idx_size} bytes, fewer than the {_HEADER.size}-byte header")
        with open(ipath, "rb") as fh:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(fh.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"indexed dataset: {ipath} starts with {magic!r}, expected the magic {MAGIC!r} (not a Megatron .idx)")
        if version != VERSION:
            raise ValueError(f"indexed dataset: {ipath} has format version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise ValueError(f"indexed dataset: {ipath} has dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if idx_size != expected:
            raise ValueError(
                f"indexed dataset: {ipath} has {idx_size} bytes but its header ({n_seq} sequences, {n_doc} document "
                f"indices) describes {expected} bytes (truncated, or a multimodal .idx, which is not supported)"
            )
        idx = np.memmap(ipath, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths = idx[off : off + 4 * n_seq].view("<i4")
        off += 4 * n_seq
        self.sequence_pointers = idx[off : off + 8 * n_seq].view("<i8")
        off += 8 * n_seq
        self.document_indices = idx[off : off + 8 * n_doc].view("<i8")
        self._check(ipath, bpath, n_seq)
        self._bin = np.memmap(bpath, dtype=np.uint8, mode="r") if os.path.getsize(bpath) else np.zeros(0, np.uint8)

    def _check(self, ipath: str, bpath: str, n_seq: int) -> None:
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n_seq:
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise ValueError(
                f"indexed dataset: {ipath} document indices run from {first} to {last}, expected 0 to the sequence count {n_seq}"
            )
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            raise ValueError(f"indexed dataset: {ipath} document indices decrease at position {int(np.argmax(np.diff(docs) < 0)) + 1}")
        bin_size = os.path.getsize(bpath)
        if n_seq == 0:
            end = 0
        else:
            lengths = self.sequence_lengths
            if lengths.min() < 0:
                i = int(np.argmin(lengths))
                raise ValueError(f"indexed dataset: {ipath} gives sequence {i} the negative length {int(lengths[i])}")
            if self.sequence_pointers.min() < 0:
                i = int(np.argmin(self.sequence_pointers))
                raise ValueError(f"indexed dataset: {ipath} gives sequence {i} the negative byte offset {int(self.sequence_pointers[i])}")
            ends = self.sequence_pointers + lengths.astype(np.int64) * self.dtype.itemsize
            end = int(ends.max())
        if bin_size < end:
            i = int(np.argmax(ends > bin_size))
            raise ValueError(
                f"indexed dataset: {bpath} is truncated: it has {bin_size} bytes but {ipath} needs {end} "
                f"(sequence {i} ends at byte {int(ends[i])})"
            )
        if bin_size > end:
            raise ValueError(
                f"indexed dataset: {bpath} has {bin_size} bytes but {ipath} describes {end}; the .bin and .idx "
                f"are not a pair (rewritten separately?)"
            )

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-1 of the .idx bytes: names the index caches built over this dataset."""
        return file_sha1(idx_path(self.prefix))

    def __len__(self) -> int:
        """Number of sequences S."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length - 1`` of sequence `i` (Megatron's ``IndexedDataset.get``).

        Args:
            i: sequence index (negative counts from the end).
            offset: first token within the sequence.
            length: number of tokens; None reads to the end of the sequence.

        Returns:
            a read-only array [length] of `dtype`, a view into the mapped .bin.

        Raises:
            IndexError: `i` out of range, or the slice does not lie inside the sequence.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"indexed dataset: sequence {i} out of range for {n} sequences in {bin_path(self.prefix)}")
        i = int(i) % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"indexed dataset: tokens [{offset}, {offset + length}) are outside sequence {i} of length {size} "
                f"in {bin_path(self.prefix)}"
            )
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return self._bin[start : start + length * self.dtype.itemsize].view(self.dtype.newbyteorder("<"))

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence `i`: a read-only array of `dtype` (see `get`)."""
        return self.get(i)


class IndexedDatasetBuilder:
    """Write a Megatron ``PREFIX.bin``/``PREFIX.idx`` pair, one sequence per document.

    Tokens stream to a temporary file beside the target as documents are added; `finalize`
    writes the .idx to a temporary file too, then swaps both in: it removes an old ``PREFIX.idx``
    first, renames the .bin into place and renames the .idx last. The .idx is thus the commit
    marker: at every moment a reader finds either the old complete pair, or no .idx (the prefix
    reads as missing), or the new complete pair, and never a .idx beside a .bin it does not
    describe. A builder that is dropped (or used as a context manager that exits with an
    error) removes its temporary files.

    Args:
        prefix: output path without suffix.
        dtype: token dtype (see `best_dtype`); must have a Megatron code.

    Raises:
        ValueError: a dtype without a Megatron code.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._tmp_bin = f"{bin_path(self.prefix)}.tmp-{os.getpid()}"
        self._tmp_idx = f"{idx_path(self.prefix)}.tmp-{os.getpid()}"
        self._fh = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._done = False

    def add_document(self, tokens) -> None:
        """Append one document (one sequence) of token ids.

        Args:
            tokens: 1-D integer sequence; it is cast to the builder's dtype.

        Raises:
            ValueError: not 1-D, ids outside the dtype's range, or the builder is finalized.
        """
        if self._done:
            raise ValueError(f"indexed dataset: builder for {self.prefix!r} is already finalized")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"indexed dataset: a document must be 1-D, got shape {arr.shape}")
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise ValueError(f"indexed dataset: token id {lo if lo < info.min else hi} does not fit {self.dtype} for {self.prefix!r}")
        self._fh.write(np.ascontiguousarray(arr, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._lengths.append(int(arr.size))

    def finalize(self) -> None:
        """Write the .idx and move both files into place (see the class docstring)."""
        if self._done:
            raise ValueError(f"indexed dataset: builder for {self.prefix!r} is already finalized")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        n = len(lengths)
        pointers = np.zeros(n, dtype=np.int64)
        if n:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.arange(n + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as fh:
            fh.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), n, n + 1))
            fh.write(lengths.astype("<i4").tobytes())
            fh.write(pointers.astype("<i8").tobytes())
            fh.write(docs.astype("<i8").tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far (nothing at PREFIX changes)."""
        if not self._fh.closed:
            self._fh.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Finalize on a clean exit, `abort` on an error."""
        if self._done:
            return
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.abort()
            except Exception:  # interpreter shutdown: best effort only
                pass
