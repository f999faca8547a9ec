"""Deterministic, resumable, multi-epoch batches over packed windows, data-parallel aware.

The global sample stream is the concatenation of per-epoch orders: epoch e is
``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))`` (identity without
shuffling), and stream position p is window ``perm_{p // n}[p % n]``. A global batch is the
next `batch_size` positions; data-parallel rank r takes rows ``[r*b, (r+1)*b)`` of it with
``b = batch_size // dp_size``. The only state is the global position, so a run resumes exactly,
even on a different number of ranks.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .packing import PackedTokens, windows_to_examples

MAX_POSITION = 2**62
"""Past the largest loader position mff accepts on resume (samples; int64 index arithmetic stays exact below it)."""


def _to_torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def check_batch_split(batch_size: int, dp_rank: int, dp_size: int) -> None:
    """Raise ValueError unless ``batch_size`` >= 1 divides evenly over ``dp_size`` >= 1 ranks and
    ``0 <= dp_rank < dp_size`` (the message names the bad values)."""
    if batch_size < 1:
        raise ValueError(f"data: batch_size must be >= 1, got {batch_size}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    if batch_size % dp_size:
        raise ValueError(f"data: batch_size {batch_size} is not divisible by dp_size {dp_size}")


def eval_bounds(n: int, batch_size: int, n_batches: int) -> list[tuple[int, int]]:
    """Row ranges of the first `n_batches` whole batches of `n` items in order, at most
    ``n // batch_size`` of them; fewer than `batch_size` items give one batch of all of them.

    Raises:
        ValueError: `batch_size` or `n_batches` < 1.
    """
    if batch_size < 1 or n_batches < 1:
        raise ValueError(f"data: batch_size and n_batches must be >= 1, got {batch_size} and {n_batches}")
    if n < batch_size:
        return [(0, n)]
    return [(i * batch_size, (i + 1) * batch_size) for i in range(min(n_batches, n // batch_size))]


class Loader:
    """Global batches of training examples in a seeded, epoch-wrapping order.

    Args:
        data: the packed windows.
        batch_size: global batch size (samples per step across all data-parallel ranks).
        seed: base seed; epoch e's permutation uses ``seed + e``.
        shuffle: False gives windows in stream order every epoch.
        dp_rank: this rank's index in the data-parallel group.
        dp_size: number of data-parallel ranks.

    Raises:
        ValueError: `batch_size` or `dp_size` < 1, `dp_rank` outside ``0..dp_size-1``, or
            `batch_size` not divisible by `dp_size` (the message gives both).
    """

    def __init__(
        self,
        data: PackedTokens,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        check_batch_split(batch_size, dp_rank, dp_size)
        self.data = data
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.local_batch_size = self.batch_size // self.dp_size
        self.position = 0
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            n = len(self.data)
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(n, generator=gen).numpy()
            else:
                perm = np.arange(n, dtype=np.int64)
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = perm
        return perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Window indices at global stream positions ``start .. start + count - 1``: int64 [count]."""
        n = len(self.data)
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(pos, n)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's slice of the next global batch, and advance by `batch_size` positions.

        Returns:
            ``input_ids``, ``labels``, ``document_ids``: int64 tensors [batch_size // dp_size,
            seq_len] (see `windows_to_examples`).
        """
        start = self.position + self.dp_rank * self.local_batch_size
        idx = self.indices(start, self.local_batch_size)
        self.position += self.batch_size
        return _to_torch(windows_to_examples(self.data.windows(idx), self.data.eod_id))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless `next_batch` calls."""
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> float:
        """Epochs consumed so far (fractional): position / number of windows."""
        return self.position / len(self.data)

    def state_dict(self) -> dict:
        """Resumable state (ints only, msgpack-serialisable).

        Returns:
            ``{"position": samples consumed globally, "seed": int, "num_samples": windows per
            epoch, "shuffle": 0 or 1}``.
        """
        return {
            "position": self.position,
            "seed": self.seed,
            "num_samples": len(self.data),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream saved by `state_dict` (batch size and dp_size may differ).

        Raises:
            KeyError: no ``"position"``.
            ValueError: a position outside ``[0, 2**62)``, or a seed, window count or shuffle flag that
                differs from this loader's (the stream would not be the same).
        """
        if state.get("kind") == "megatron":
            raise ValueError("data: the checkpoint was trained on Megatron indexed data, this run reads raw corpus files "
                             "(the sample stream would differ; use another --ckpt-dir)")
        position = int(state["position"])
        if not 0 <= position < MAX_POSITION:
            raise ValueError(f"data: loader position must be in [0, 2**62), got {position}")
        mine = self.state_dict()
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"data: cannot resume the loader: saved {key}={state[key]} but this loader has "
                    f"{key}={mine[key]} (the sample stream would differ)"
                )
        self.position = position


def split_microbatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch along dim 0 into `n` equal micro-batches (views, in order).

    Args:
        batch: tensors sharing the leading batch size B.
        n: number of micro-batches.

    Returns:
        `n` dicts with the same keys, each value [B // n, ...].

    Raises:
        ValueError: `n` < 1, the tensors disagree on B, or B is not divisible by `n`.
    """
    if n < 1:
        raise ValueError(f"data: number of micro-batches must be >= 1, got {n}")
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"data: batch tensors have different leading sizes {sizes}")
    b = next(iter(sizes.values()), 0)
    if b % n:
        raise ValueError(f"data: batch size {b} is not divisible into {n} micro-batches")
    m = b // n
    return [{k: v[i * m : (i + 1) * m] for k, v in batch.items()} for i in range(n)]


def eval_batches(data: PackedTokens, batch_size: int, n_batches: int) -> list[dict[str, torch.Tensor]]:
    """The first `n_batches` batches of windows in stream order (no shuffling).

    Only whole batches are returned, at most ``len(data) // batch_size`` of them; a split with
    fewer than `batch_size` windows gives one batch holding all of them, so there is always at
    least one.

    Returns:
        list of dicts like `Loader.next_batch`, each value int64 [rows, seq_len].

    Raises:
        ValueError: `batch_size` or `n_batches` < 1.
    """
    bounds = eval_bounds(len(data), batch_size, n_batches)
    return [
        _to_torch(windows_to_examples(data.windows(np.arange(a, b)), data.eod_id)) for a, b in bounds
    ]
