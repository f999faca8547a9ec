"""The serving engine: continuous batching over a paged KV cache.

One :class:`Engine` holds a model, its params and a paged cache (:mod:`mff.nn.paged`). Requests
(:class:`mff.serve.request.EngineRequest`, token ids) come in from any thread; each
:meth:`Engine.step` asks the :class:`mff.serve.scheduler.Scheduler` for this step's chunks
(decodes and prefill chunks of several requests, under a token budget), runs them as **one**
packed forward (``model.forward(params, {"input_ids": [1, N]}, paged cache)``), samples the next
token of every sequence whose tokens are all computed (:func:`mff.sampling.sample`, each request
with its own ``torch.Generator``), and hands each request its :class:`RequestOutput`.

A request yields the tokens :func:`mff.generate.generate` gives for it alone with the same seed:
sampling draws from the request's own generator in the same order, the repetition-penalty mask is
its own, and attention sees only its own blocks. (Batched matmuls may round differently from the
batch-1 ones; on a near tie that can change a token, as in any batching server.)

:meth:`Engine.start` runs the steps on a background thread (what the HTTP layer uses);
:meth:`Engine.run` runs requests to completion on the calling thread (tests, benchmarks).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from mff.generate import inference_mode_applies, outside_inference_mode
from mff.model import Model
from mff.nn.paged import paged_batch
from mff.sampling import mark_seen, sample, seen_mask_from_ids
from mff.serve.blocks import BlockPool
from mff.serve.request import EngineRequest, QueueFullError, RequestOutput, TokenLogprob
from mff.serve.scheduler import ScheduledChunk, Scheduler
from mff.serve.scheduler import Sequence as Seq

__all__ = ["Engine", "EngineConfig", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20
"""Most alternatives per position a request may ask for (``logprobs`` / ``prompt_logprobs``; vLLM's default cap)."""


@dataclass(frozen=True)
class EngineConfig:
    """Cache and scheduling limits of the serving engine."""

    block_size: int = 16
    """Tokens per KV-cache block."""
    num_blocks: int | None = None
    """KV-cache blocks (block 0 is reserved); default: as many as --engine.cache-memory-gib holds."""
    cache_memory_gib: float = 1.0
    """KV-cache size in GiB when --engine.num-blocks is not given."""
    max_num_seqs: int = 16
    """Most requests running at once (decoding or in their prompt)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes (1 token each) plus prefill chunks."""
    max_waiting: int = 256
    """Most requests queued before new ones are refused (HTTP 429)."""
    prefix_caching: bool = True
    """Reuse the cached blocks of a prompt prefix seen before (hashes of full blocks)."""

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""
        for name, low in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_waiting", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"--engine.{name.replace('_', '-')} {v!r}: must be an integer >= {low}")
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 2):
            raise ValueError(f"--engine.num-blocks {self.num_blocks!r}: must be an integer >= 2 (block 0 is reserved)")
        if not (0 < self.cache_memory_gib < float("inf")):
            raise ValueError(f"--engine.cache-memory-gib {self.cache_memory_gib!r}: must be a finite number > 0")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Engine:
    """Continuous batching of :class:`EngineRequest` s over ``model`` with ``params``.

    The cache has the params' dtype and device. ``eos_token_ids``: the model's EOS ids (a request
    stops after emitting one unless ``ignore_eos``).

    Raises:
        ValueError: a bad :class:`EngineConfig` (named field), a cache too small for one block,
            an EOS id outside the vocabulary.
    """

    def __init__(self, model: Model, params: dict[str, torch.Tensor], config: EngineConfig = EngineConfig(),
                 eos_token_ids: Iterable[int] = ()):
        config.validate()
        self.model, self.params, self.config = model, params, config
        ref = params["model.embed_tokens.weight"]
        self.device, self.dtype = ref.device, ref.dtype
        # plain params on a CPU/CUDA device: steps run under inference mode (the cache is written in
        # place there; what a step leaves behind, such as a request's seen-token mask, is only read
        # or replaced by later steps)
        self._inference_mode = inference_mode_applies(params, self.device)
        self.vocab_size = int(model.config.vocab_size)
        self.max_model_len = int(model.config.max_position_embeddings)
        self.eos_token_ids = frozenset(eos_token_ids)
        bad = [i for i in self.eos_token_ids if not _is_int(i) or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad} outside the vocabulary [0, {self.vocab_size})")
        bs = config.block_size
        self.bytes_per_token = model.cache_bytes_per_token(self.dtype)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = int(config.cache_memory_gib * 2**30 // (self.bytes_per_token * bs))
            if num_blocks < 2:
                raise ValueError(f"--engine.cache-memory-gib {config.cache_memory_gib} holds {num_blocks} blocks of {bs} tokens "
                                 f"({self.bytes_per_token * bs} bytes each); give more (>= 2 blocks)")
        self.cache = model.init_paged_cache(num_blocks, bs, self.dtype, self.device)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(self.pool, bs, config.max_num_seqs, config.max_num_batched_tokens, config.prefix_caching)
        self._lock = threading.Condition()
        self._inbox: list[Seq] = []
        self._aborts: set[str] = set()
        self._live: dict[str, Seq] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        # requests without a seed draw one from here: seeded from the OS, so runs differ (as OpenAI's and vLLM's do)
        self._seed_gen = torch.Generator().manual_seed(secrets.randbits(63))
        self._stats_lock = threading.Lock()  # metrics() reads what the engine thread appends
        self._token_times: deque[tuple[float, int]] = deque()
        self._ttft: deque[float] = deque(maxlen=1000)
        self.generated_tokens = 0
        self.steps = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ requests
    def check(self, req: EngineRequest) -> None:
        """Raise ValueError naming the first bad field of ``req`` (nothing is queued)."""
        if not isinstance(req.request_id, str) or not req.request_id:
            raise ValueError(f"request_id {req.request_id!r}: must be a non-empty string")
        ids = req.prompt_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_ids: the prompt is empty; give at least one token")
        bad = next((t for t in ids if not _is_int(t) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token {bad!r} is not an id in [0, vocab_size={self.vocab_size})")
        if not _is_int(req.max_tokens) or req.max_tokens < 0:
            raise ValueError(f"max_tokens {req.max_tokens!r}: must be an integer >= 0")
        total = len(ids) + req.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = {total} exceeds the model's "
                             f"context of {self.max_model_len} tokens")
        need = self.scheduler.blocks_needed(total)
        if need > self.pool.usable:
            raise ValueError(f"the prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) needs {need} cache blocks of "
                             f"{self.config.block_size} tokens but the cache has {self.pool.usable} "
                             "(--engine.num-blocks / --engine.cache-memory-gib)")
        req.sampling.validate()
        if req.seed is not None and not (_is_int(req.seed) and 0 <= req.seed < 2**63):
            raise ValueError(f"seed {req.seed!r}: must be an integer in [0, 2**63)")
        bad = next((t for t in req.stop_token_ids if not _is_int(t) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad!r} is not an id in [0, vocab_size={self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(req, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} {k!r}: must be an integer in [0, {MAX_LOGPROBS}] (or absent)")

    def add_request(self, req: EngineRequest, on_output: Callable[[RequestOutput], None]) -> None:
        """Queue ``req``; ``on_output`` receives its outputs (called on the engine's thread: it must
        not block; from inside a step it runs under ``torch.no_grad`` outside the step's inference
        mode, see :func:`mff.generate.outside_inference_mode`). Thread-safe. :meth:`add_requests`
        with one request (same errors)."""
        self.add_requests([(req, on_output)])

    def add_requests(self, items: Sequence[tuple[EngineRequest, Callable[[RequestOutput], None]]]) -> None:
        """Queue several requests (the choices of one HTTP request) all at once or none of them.
        Each ``on_output`` is called on the engine's thread and must not block. Thread-safe.

        Raises:
            ValueError: a bad request (:meth:`check`), a ``request_id`` already in the engine or
                given twice, more requests than ``max_waiting`` (they could never wait together),
                an engine that is shutting down.
            QueueFullError: the requests do not fit beside the ones already waiting (``max_waiting``).
        """
        seqs = [self._new_seq(req, on_output) for req, on_output in items]
        n, cap = len(seqs), self.config.max_waiting
        if n > cap:
            raise ValueError(f"{n} choices in one request (prompts x n) is more than the {cap} requests the server lets wait "
                             "at once (--engine.max-waiting); send fewer choices per request")
        ids = [s.req.request_id for s in seqs]
        if len(set(ids)) != n:
            raise ValueError(f"request_ids {ids} are not all different")
        with self._lock:
            if self._stopping:
                raise ValueError("the engine is shutting down")
            dup = next((i for i in ids if i in self._live), None)
            if dup is not None:
                raise ValueError(f"request_id {dup!r} is already in the engine")
            queued = len(self.scheduler.waiting) + len(self._inbox)
            if queued + n > cap:
                raise QueueFullError(f"{queued} {'request is' if queued == 1 else 'requests are'} waiting and this one adds {n}, "
                                     f"more than --engine.max-waiting {cap}; retry later")
            for seq in seqs:
                self._live[seq.req.request_id] = seq
                self._inbox.append(seq)
            self._lock.notify()

    def _new_seq(self, req: EngineRequest, on_output: Callable[[RequestOutput], None]) -> Seq:
        """A checked request's sequence state (its sampling generator and seen-token mask)."""
        self.check(req)
        if req.sampling.greedy:
            gen = None
        else:
            seed = req.seed if req.seed is not None else int(torch.randint(0, 2**62, (), generator=self._seed_gen))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        seen = (seen_mask_from_ids(torch.tensor([list(req.prompt_ids)], device=self.device), self.vocab_size)
                if req.sampling.repetition_penalty != 1.0 else None)
        stop = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.eos_token_ids)
        return Seq(req=req, on_output=on_output, tokens=list(req.prompt_ids), stop_ids=stop, generator=gen, seen=seen,
                   num_prompt=len(req.prompt_ids), prompt_logprobs=[None] if req.prompt_logprobs is not None else None)

    def abort(self, request_id: str) -> None:
        """End the request (``finish_reason`` ``abort``) at the next step and free its blocks; an
        unknown or finished id is ignored. Thread-safe."""
        with self._lock:
            if request_id in self._live:
                self._aborts.add(request_id)
                self._lock.notify()

    # ------------------------------------------------------------------ stepping
    def has_work(self) -> bool:
        """Requests queued, running or to abort."""
        return bool(self._inbox or self._aborts or self.scheduler.waiting or self.scheduler.running)

    def step(self) -> bool:
        """One scheduling step: take new requests and aborts, run one packed forward, hand out the
        outputs. Returns False when there was nothing to run."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq in inbox:
            self.scheduler.waiting.append(seq)
            if seq.req.max_tokens == 0 and seq.req.prompt_logprobs is None:
                self._finish(seq, "length", [])
        for rid in aborts:
            seq = self._live.get(rid)
            if seq is not None:
                self._finish(seq, "abort", [])
        chunks = self.scheduler.schedule()
        if not chunks:
            return bool(aborts or inbox)
        try:
            self._run(chunks)
        except Exception as e:  # a failed forward ends the requests in it, not the engine
            self.last_error = f"{type(e).__name__}: {e}"
            for ch in chunks:
                if ch.seq.req.request_id in self._live:
                    self._finish(ch.seq, "abort", [])
        self.steps += 1
        return True

    def _run(self, chunks: list[ScheduledChunk]) -> None:
        with torch.inference_mode() if self._inference_mode else torch.no_grad():
            self._run_chunks(chunks)

    def _run_chunks(self, chunks: list[ScheduledChunk]) -> None:
        ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int]] = []  # per chunk: (first logits row, rows)
        for ch in chunks:
            seq, offset = ch.seq, len(ids)
            ids.extend(seq.tokens[ch.start:ch.start + ch.length])
            if seq.wants_prompt_logprobs and ch.start < seq.num_prompt:
                rows = list(range(offset, offset + ch.length))
            elif ch.start + ch.length == len(seq.tokens):
                rows = [offset + ch.length - 1]
            else:
                rows = []
            spans.append((len(positions), len(rows)))
            positions.extend(rows)
        pb = paged_batch([c.seq.blocks for c in chunks], [c.start for c in chunks], [c.length for c in chunks],
                         self.config.block_size, self.device)
        cache = {"paged": pb, "layers": self.cache["layers"]}
        out = self.model.forward(self.params, {"input_ids": torch.tensor([ids], device=self.device)}, cache, check=False,
                                 logits=torch.tensor(positions, dtype=torch.int64, device=self.device))
        logits = out.logits[0]  # [K, V]
        now = time.monotonic()
        ready: list[tuple[Seq, int]] = []  # sequences to sample, with their logits row
        for ch, (first, n) in zip(chunks, spans):
            seq = ch.seq
            seq.num_computed = ch.start + ch.length
            self.scheduler.register_full_blocks(seq)
            if seq.wants_prompt_logprobs and ch.start < seq.num_prompt:
                self._prompt_logprobs(seq, ch.start, logits[first:first + n])
            if seq.num_computed < len(seq.tokens):
                continue
            if seq.num_generated >= seq.req.max_tokens:  # max_tokens 0: the prompt was only scored
                self._finish(seq, "length", [])
                continue
            ready.append((seq, first + n - 1))
        # plain greedy rows (no repetition penalty): one argmax for all, what sample() gives each alone
        plain = [i for i, (seq, _) in enumerate(ready) if seq.req.sampling.greedy and seq.seen is None]
        greedy = logits[[ready[i][1] for i in plain]].float().argmax(-1).tolist() if plain else []
        picked = dict(zip(plain, greedy))
        for i, (seq, row) in enumerate(ready):
            self._sample(seq, logits[row:row + 1], now, picked.get(i))

    def _prompt_logprobs(self, seq: Seq, start: int, rows: torch.Tensor) -> None:
        """Row i holds the logits after position ``start + i``: the log-probability of prompt token
        ``start + i + 1``."""
        lsm = rows.float().log_softmax(-1)
        k = seq.req.prompt_logprobs
        for i in range(rows.shape[0]):
            nxt = start + i + 1
            if nxt >= seq.num_prompt or nxt != len(seq.prompt_logprobs):
                continue
            seq.prompt_logprobs.append(_logprob(lsm[i], seq.tokens[nxt], k))

    def _sample(self, seq: Seq, row: torch.Tensor, now: float, tok: int | None = None) -> None:
        """Sample ``seq``'s next token from ``row`` (logits [1, V]) unless ``tok`` is given, then
        hand it out and stop the request when it should."""
        req = seq.req
        if tok is None:
            tok = int(sample(row.float(), req.sampling, seq.generator, seq.seen)[0])
        seq.tokens.append(tok)
        if seq.seen is not None:
            seq.seen = mark_seen(seq.seen, torch.tensor([tok], device=self.device))
        lp = [_logprob(row[0].float().log_softmax(-1), tok, req.logprobs)] if req.logprobs is not None else None
        with self._stats_lock:
            if seq.first_token_time is None:
                seq.first_token_time = now
                self._ttft.append(now - seq.arrival)
            self.generated_tokens += 1
            self._token_times.append((now, 1))
        reason = None
        if tok in seq.stop_ids:
            reason = "stop"
        elif req.stop_check is not None and self._stop_check(seq):
            reason = "stop"
        elif seq.num_generated >= req.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, [tok], lp)
        else:
            self._emit(seq, RequestOutput(req.request_id, [tok], lp, num_prompt_tokens=seq.num_prompt,
                                          num_generated_tokens=seq.num_generated, num_cached_tokens=seq.num_cached))

    def _stop_check(self, seq: Seq) -> bool:
        """The request's ``stop_check``; one that raises ends its own request (as a stop), not the batch."""
        try:
            with outside_inference_mode():
                return bool(seq.req.stop_check(seq.tokens[seq.num_prompt:]))
        except Exception as e:
            self.last_error = f"stop_check of {seq.req.request_id!r}: {type(e).__name__}: {e}"
            return True

    def _emit(self, seq: Seq, out: RequestOutput) -> None:
        if seq.prompt_logprobs is not None and not seq.sent_prompt_logprobs:
            out.prompt_logprobs = list(seq.prompt_logprobs)
            seq.sent_prompt_logprobs = True
        try:
            with outside_inference_mode():
                seq.on_output(out)
        except Exception as e:  # a consumer that fails ends its own request only
            self.last_error = f"on_output of {seq.req.request_id!r}: {type(e).__name__}: {e}"
            if not out.finished:
                self.abort(seq.req.request_id)

    def _finish(self, seq: Seq, reason: str, new: list[int], lp: list[TokenLogprob] | None = None) -> None:
        self.scheduler.finish(seq)
        with self._lock:
            self._live.pop(seq.req.request_id, None)
            self._aborts.discard(seq.req.request_id)
        self._emit(seq, RequestOutput(seq.req.request_id, new, lp, finished=True, finish_reason=reason,
                                      num_prompt_tokens=seq.num_prompt, num_generated_tokens=seq.num_generated,
                                      num_cached_tokens=seq.num_cached))

    # ------------------------------------------------------------------ driving
    def run(self, requests: Sequence[EngineRequest]) -> dict[str, list[RequestOutput]]:
        """Add ``requests`` and step on this thread until every one has finished (no background
        thread may be running). Returns each request's outputs in order. Raises as :meth:`add_request`."""
        if self._thread is not None:
            raise RuntimeError("Engine.run steps on the calling thread; this engine runs on its own (start() was called)")
        outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r, outs[r.request_id].append)
        while self.has_work():
            self.step()
        return outs

    def start(self) -> None:
        """Run steps on a background thread until :meth:`shutdown`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mff-serve-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.has_work():
                    self._lock.wait()
                if self._stopping:
                    break
            self.step()
        for seq in list(self._live.values()):
            self._finish(seq, "abort", [])

    def shutdown(self) -> None:
        """Stop the background thread; requests still in the engine end with ``abort``."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """``running``, ``waiting`` (requests), ``blocks_total``, ``blocks_used``,
        ``cache_tokens_per_block``, ``cache_bytes_per_token``, ``prefix_cache_hit_tokens``,
        ``preemptions``, ``generated_tokens`` (since start), ``tokens_per_s`` (generated, last
        10 s), ``ttft_s_p50`` / ``ttft_s_p99`` (arrival to first token, last 1000 requests; 0 when none),
        ``steps``."""
        now = time.monotonic()
        with self._stats_lock:
            while self._token_times and self._token_times[0][0] < now - 10:
                self._token_times.popleft()
            window = now - self._token_times[0][0] if self._token_times else 0.0
            recent = sum(n for _, n in self._token_times)
            ttft = sorted(self._ttft)
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._inbox),
            "blocks_total": self.pool.usable,
            "blocks_used": self.pool.num_used(),
            "cache_tokens_per_block": self.config.block_size,
            "cache_bytes_per_token": self.bytes_per_token,
            "prefix_cache_hit_tokens": self.pool.hit_tokens,
            "preemptions": self.scheduler.preemptions,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": recent / window if window > 0 else 0.0,
            "ttft_s_p50": ttft[len(ttft) // 2] if ttft else 0.0,
            "ttft_s_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else 0.0,
            "steps": self.steps,
        }


def _logprob(lsm_V: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability in ``lsm_V`` (log_softmax [V]) and the ``k`` most likely ids."""
    top = {}
    if k:
        vals, idx = lsm_V.topk(k)
        top = {int(i): float(v) for i, v in zip(idx.tolist(), vals.tolist())}
    return TokenLogprob(token, float(lsm_V[token]), top)
