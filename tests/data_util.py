"""Test helper: write small Megatron indexed datasets."""

from __future__ import annotations

import numpy as np

from mff.data.indexed import IndexedDataset, IndexedDatasetBuilder


def write_indexed(prefix, docs, dtype=np.uint16) -> IndexedDataset:
    """Write ``docs`` (lists of token ids, one sequence each) as ``PREFIX.bin``/``.idx`` and open it."""
    b = IndexedDatasetBuilder(str(prefix), dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()
    return IndexedDataset(str(prefix))
