"""The block pool of a paged KV cache: a free list, reference counts, and prefix reuse.

Block 0 is reserved (:mod:`mff.nn.paged` points unused table entries at it); blocks
``1 .. num_blocks - 1`` are handed out. A block that is full of known tokens can be registered
under the hash of its tokens *and of every token before it* (a chain hash, as vLLM's automatic
prefix caching: block i's key is ``sha256(key of block i-1, tokens of block i)``), so a later
request whose prompt starts with the same tokens takes the block instead of computing it again.
A registered block whose last user is gone stays in the pool, evictable in least-recently-used
order, until a new allocation needs it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

__all__ = ["BlockPool", "chain_hashes"]


def chain_hashes(tokens: Sequence[int], block_size: int, count: int, start: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hashes of the first ``count`` full blocks of ``tokens`` (``start``: the hashes of
    the first blocks, already known; they are extended, not recomputed)."""
    out = list(start[:count])
    prev = out[-1] if out else b""
    for i in range(len(out), count):
        block = tokens[i * block_size:(i + 1) * block_size]
        prev = hashlib.sha256(prev + b"|" + ",".join(map(str, block)).encode()).digest()
        out.append(prev)
    return out


class BlockPool:
    """``num_blocks`` blocks (block 0 reserved), each with a reference count.

    Raises:
        ValueError: ``num_blocks`` < 2 (no usable block).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: a paged cache needs >= 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, registered; oldest first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.hit_tokens = 0

    @property
    def usable(self) -> int:
        """Blocks a sequence can get (all but block 0)."""
        return self.num_blocks - 1

    def num_free(self) -> int:
        """Blocks an allocation can take now (free + evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.usable - self.num_free()

    def allocate(self) -> int | None:
        """A block with reference count 1, or None when every block is held. Evicts the least
        recently used cached block when no never-registered block is free."""
        if self._free:
            b = self._free.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(b)]
        else:
            return None
        self._refs[b] = 1
        return b

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes back to the pool (kept for
        reuse when registered). Raises RuntimeError on a block not held (a bookkeeping bug)."""
        for b in blocks:
            if self._refs[b] < 1:
                raise RuntimeError(f"block {b} released but not held")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, key: bytes) -> None:
        """Record that ``block`` (held, full) holds the tokens hashed as ``key``. A key already held
        by another block keeps that block."""
        if key in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = key
        self._block_of[key] = block

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest run of ``keys`` from the first, each now held once more."""
        out = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            if self._refs[b] == 0:
                self._evictable.pop(b)
            self._refs[b] += 1
            out.append(b)
        return out
