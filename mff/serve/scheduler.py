"""Which sequences run in the next engine step, and how many of their tokens.

Continuous batching with chunked prefill (the scheduling of vLLM's V1 engine and of Sarathi,
Agrawal et al. 2024, arXiv 2403.02310): every step has a budget of ``max_num_batched_tokens``
tokens. Running sequences come first, oldest first: a decoding one takes 1 token, one still in its
prompt takes the next chunk of it that fits. Waiting sequences are then admitted in arrival order
while the budget and ``max_num_seqs`` allow, taking the longest prefix of their prompt that the
block pool already holds (:class:`mff.serve.blocks.BlockPool`). When a running sequence needs a
block and none is free, the newest running sequence is preempted: its blocks are released and it
goes back to the front of the queue, to be computed again (prompt and generated tokens) when
there is room; its sampling state is kept, so its tokens are unchanged.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mff.serve.blocks import BlockPool, chain_hashes
from mff.serve.request import EngineRequest, RequestOutput, TokenLogprob

__all__ = ["Sequence", "Scheduler", "ScheduledChunk"]


@dataclass(eq=False)
class Sequence:
    """One request's state in the engine."""

    req: EngineRequest
    on_output: Callable[[RequestOutput], None]
    tokens: list[int]
    """Prompt, then the generated tokens."""
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    seen: torch.Tensor | None
    """bool [1, V]: tokens seen (repetition penalty), or None."""
    arrival: float = field(default_factory=time.monotonic)
    num_prompt: int = 0
    num_computed: int = 0
    """Tokens whose keys and values are in this sequence's blocks."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of the full blocks registered so far."""
    num_cached: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    sent_prompt_logprobs: bool = False
    preemptions: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes prompt log-probabilities (prompt positions after the first)."""
        return self.req.prompt_logprobs is not None and len(self.prompt_logprobs or [None]) < self.num_prompt


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int
    """The first token fed (== ``seq.num_computed`` before the step)."""
    length: int


class Scheduler:
    """The waiting queue, the running set and the block pool of one engine."""

    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens; False (nothing taken) when the pool is short."""
        need = self.blocks_needed(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if self.pool.num_free() < need:
            return False
        seq.blocks.extend(self.pool.allocate() for _ in range(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (the registered ones stay reusable)."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks (at least one when any sequence can run)."""
        budget = self.budget
        out: list[ScheduledChunk] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below for an older sequence
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                break
            out.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.blocks and self.prefix_caching and seq.req.prompt_logprobs is None:
                self._reuse_prefix(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._grow(seq, seq.num_computed + n):
                self.release(seq)  # the reused prefix too: it waits whole (alone it always fits, see Engine.add_request)
                break
            self.waiting.popleft()
            self.running.append(seq)
            if seq.preemptions == 0 and seq.num_computed:
                seq.num_cached = seq.num_computed
                self.pool.hit_tokens += seq.num_computed
            out.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return out

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Take the cached blocks of ``seq``'s longest known prefix (at least one token is left to
        compute: the step that samples needs its logits)."""
        full = (len(seq.tokens) - 1) // self.block_size
        keys = chain_hashes(seq.tokens, self.block_size, full)
        blocks = self.pool.lookup(keys)
        if blocks:
            seq.blocks = blocks
            seq.hashes = keys[:len(blocks)]
            seq.num_computed = len(blocks) * self.block_size

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full of computed tokens (prefix reuse)."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full > len(seq.hashes):
            seq.hashes = chain_hashes(seq.tokens, self.block_size, full, seq.hashes)
            for b, key in zip(seq.blocks[:full], seq.hashes):
                self.pool.register(b, key)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out (running or waiting) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
