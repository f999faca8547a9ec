"""A paged KV cache: the second cache layout behind the same attention code.

The dense cache of :meth:`mff.model.Model.init_cache` gives every row its own ``[S]`` slots. A
paged cache (vLLM's PagedAttention layout, Kwon et al. 2023, arXiv 2309.06180 section 4) is one
pool of fixed-size blocks per layer, ``[num_blocks, block_size, ...]`` (GQA ``k``/``v``
``[.., Hkv, Dh]``, MLA ``c`` ``[.., C]`` and ``k_rot`` ``[.., R]``), shared by every sequence;
a sequence owns a list of blocks (its *block table*), position ``p`` lives in slot ``p %
block_size`` of block ``table[p // block_size]``.

A forward over a paged cache takes the new tokens of several sequences *packed* into one row,
``input_ids [1, N]`` (a decode step gives 1 token per sequence, a prefill chunk many), described
by a :class:`PagedBatch`. Per attention layer (:func:`cache_update`): the new keys are written to
their slots of the pool, each sequence's keys are gathered back as ``[B, S, ...]`` (``S`` = the
longest table times ``block_size``), the packed queries are placed in a ``[B, Tq]`` grid
(:func:`to_rows`), attention runs through :func:`mff.nn.attention.causal_attention` with the
mask of :attr:`PagedBatch.mask`, and the outputs go back to the packed row (:func:`from_rows`).
Everything else (projections, MoE, norms) runs on the N real tokens only. The gather is plain
torch indexing: a fused paged-attention kernel (CUDA / NPU) can replace it.

Block 0 of every pool is never handed to a sequence: padding writes nothing (the grid's empty
cells are not written) and unused table entries point at it (masked out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PagedBatch", "paged_batch", "cache_update", "to_rows", "from_rows"]


@dataclass
class PagedBatch:
    """Where the packed tokens of one forward go in a paged cache.

    ``N`` packed tokens of ``B`` sequences, ``Tq`` = the most new tokens of one sequence,
    ``S`` = the longest block table times the block size.
    """

    position_ids: torch.Tensor
    """int64 [1, N]: each token's position in its sequence."""
    write_slots: torch.Tensor
    """int64 [N]: each token's slot in the flattened pool (block * block_size + offset)."""
    read_slots: torch.Tensor
    """int64 [B, S]: slot of position j of sequence b (0, a masked slot, past its table)."""
    rows: torch.Tensor
    """int64 [N]: the sequence of each packed token."""
    cols: torch.Tensor
    """int64 [N]: its index among that sequence's new tokens."""
    mask: torch.Tensor
    """bool [B, 1, Tq, S]: query i of sequence b sees key j iff j <= its position (padding
    queries see nothing and give 0)."""
    q_len: int
    """Tq."""


def paged_batch(block_tables: Sequence[Sequence[int]], context_lens: Sequence[int], new_lens: Sequence[int], block_size: int,
                device: torch.device | str = "cpu") -> PagedBatch:
    """The :class:`PagedBatch` for ``B`` sequences, sequence b holding ``context_lens[b]`` cached
    tokens and bringing ``new_lens[b]`` (>= 1) new ones, which are packed in that order.

    Raises:
        ValueError: a sequence with no new token, or a table too short for its positions
            (the message names the sequence, its length and its table's capacity).
    """
    B = len(block_tables)
    if not (B == len(context_lens) == len(new_lens)) or B == 0:
        raise ValueError(f"paged_batch: {B} block tables, {len(context_lens)} context lengths, {len(new_lens)} new lengths; "
                         "expected as many of each, at least one")
    for b in range(B):
        need = context_lens[b] + new_lens[b]
        if new_lens[b] < 1 or need > len(block_tables[b]) * block_size:
            raise ValueError(f"paged_batch: sequence {b} has {context_lens[b]} cached + {new_lens[b]} new tokens but its block "
                             f"table holds {len(block_tables[b]) * block_size} (needs >= 1 new token and room for all)")
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(B, width, dtype=torch.int64)
    for b, t in enumerate(block_tables):
        tables[b, :len(t)] = torch.tensor(list(t), dtype=torch.int64)
    ctx = torch.tensor(list(context_lens), dtype=torch.int64)
    new = torch.tensor(list(new_lens), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(B), new)
    starts = torch.cumsum(new, 0) - new
    cols = torch.arange(int(new.sum())) - starts[rows]
    pos = ctx[rows] + cols
    write = tables[rows, pos // block_size] * block_size + pos % block_size
    S = width * block_size
    j = torch.arange(S)
    read = tables[:, j // block_size] * block_size + j % block_size  # [B, S]
    Tq = int(new.max())
    q_pos = ctx[:, None] + torch.arange(Tq)[None, :]  # [B, Tq]
    q_real = torch.arange(Tq)[None, :] < new[:, None]
    mask = (j[None, None, :] <= q_pos[:, :, None]) & q_real[:, :, None]
    dev = torch.device(device)
    return PagedBatch(position_ids=pos[None].to(dev), write_slots=write.to(dev), read_slots=read.to(dev), rows=rows.to(dev),
                      cols=cols.to(dev), mask=mask[:, None].to(dev), q_len=Tq)


def cache_update(kv: dict[str, torch.Tensor], slots, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Write this step's new cache entries and return each entry's full per-sequence tensor.

    ``kv``: one layer's cache. ``new``: name -> the step's values ``[B, T, ...]`` (dense) or
    ``[1, N, ...]`` (paged). With ``slots`` an int64 [T] tensor (the dense cache of
    :meth:`mff.model.Model.init_cache`): written at those slots of ``kv[name]`` ``[B, S, ...]``
    in place, which is returned. With a :class:`PagedBatch`: written to the pool ``kv[name]``
    ``[num_blocks, block_size, ...]`` at ``write_slots``, and ``[B, S, ...]`` gathered at
    ``read_slots`` is returned. Values are cast to the cache dtype.
    """
    out = []
    for name, x in new.items():
        cache = kv[name]
        if isinstance(slots, PagedBatch):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, slots.write_slots, x.reshape(-1, *x.shape[2:]).to(cache.dtype))
            out.append(flat[slots.read_slots])
        else:
            cache.index_copy_(1, slots, x.to(cache.dtype))
            out.append(cache)
    return tuple(out)


def to_rows(x: torch.Tensor, slots) -> torch.Tensor:
    """Packed queries ``[1, N, ...]`` -> the ``[B, Tq, ...]`` grid of a :class:`PagedBatch`
    (zeros at padding); anything else (a dense cache's ``[B, T, ...]``) unchanged."""
    if not isinstance(slots, PagedBatch):
        return x
    B = slots.read_slots.shape[0]
    grid = x.new_zeros(B, slots.q_len, *x.shape[2:])
    grid[slots.rows, slots.cols] = x[0]
    return grid


def from_rows(y: torch.Tensor, slots) -> torch.Tensor:
    """The inverse of :func:`to_rows`: ``[B, Tq, ...]`` -> packed ``[1, N, ...]``."""
    if not isinstance(slots, PagedBatch):
        return y
    return y[slots.rows, slots.cols][None]
