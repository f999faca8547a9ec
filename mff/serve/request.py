"""What a client asks the serving engine for, and what the engine hands back, in token ids.

The engine (:mod:`mff.serve.engine`) knows nothing of text or HTTP: a request is a prompt of
token ids with sampling parameters, and each scheduler step reports, per request, the tokens it
produced (with log-probabilities when asked). Text, stop strings and the OpenAI shapes live in
:mod:`mff.serve.api`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mff.sampling import SamplingConfig

__all__ = ["EngineRequest", "TokenLogprob", "RequestOutput", "QueueFullError", "FINISH_REASONS"]

FINISH_REASONS = ("stop", "length", "abort")
"""``stop``: an EOS / stop id was emitted or ``stop_check`` said so; ``length``: ``max_tokens``
were produced (or the context is full); ``abort``: :meth:`Engine.abort` or the engine shut down."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue holds its maximum; retry later (HTTP 429)."""


@dataclass
class EngineRequest:
    """One generation request in token ids.

    The tokens it yields equal ``mff.generate.generate(model, params, [prompt_ids],
    max_tokens, sampling=..., seed=..., eos_token_id=<eos + stop_token_ids>)`` for the request
    alone (float rounding of batched matmuls aside), whatever else the engine runs beside it.
    """

    request_id: str
    """Unique among the requests in the engine."""
    prompt_ids: Sequence[int]
    """The prompt, >= 1 token id in [0, vocab_size)."""
    max_tokens: int
    """Most tokens to generate, >= 0 (0: only the prompt is scored, for ``prompt_logprobs``)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Temperature / top-k / top-p / min-p / repetition penalty; default greedy."""
    seed: int | None = None
    """Seeds this request's own ``torch.Generator`` (sampling only); None: an engine-drawn seed."""
    stop_token_ids: Sequence[int] = ()
    """Ids that end the request once emitted (kept in the output), besides the model's EOS ids."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS ids (``stop_token_ids`` still stop)."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each generated token's log-probability and the k most
    likely alternatives (log_softmax of the raw logits, before any sampling filter)."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's log-probability given the tokens before it (the
    first prompt token has none) and the k most likely alternatives. Such a request does not reuse
    cached prefix blocks (every prompt position is computed)."""
    stop_check: Callable[[list[int]], bool] | None = None
    """Called in the engine thread after each generated token with all tokens generated so far;
    True ends the request with ``finish_reason`` ``stop`` (stop strings)."""


@dataclass
class TokenLogprob:
    """A token's log-probability and the ``top`` alternatives (id -> log-probability, most likely first)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What one scheduler step produced for one request (delivered to its ``on_output``)."""

    request_id: str
    new_token_ids: list[int]
    """Tokens generated in this step (0 or 1)."""
    new_logprobs: list[TokenLogprob] | None = None
    """Per new token, when the request asked for ``logprobs``."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Once, with the first output, when the request asked for ``prompt_logprobs``: one entry per
    prompt token, the first None."""
    finished: bool = False
    finish_reason: str | None = None
    """One of :data:`FINISH_REASONS` when ``finished``."""
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    """Tokens generated so far, this step's included."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not computed for this request)."""
