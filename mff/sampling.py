"""Next-token sampling for a decode loop: repetition penalty, temperature, top-k, top-p, min-p.

One call per generated token on the last position's logits (``[B, V]``). Every function here is
batched, pure torch and free of host synchronisation: no ``.item()``, ``.tolist()`` or Python
branching on tensor values, only on the (static) :class:`SamplingConfig` fields and shapes. So a
decode step that calls :func:`sample` can run under ``torch.compile(fullgraph=True)`` and on
CUDA/NPU without stalling the stream.

Rules and their sources (HF transformers, ``transformers.generation.logits_process``):

- repetition penalty: Keskar et al. 2019 (CTRL, arXiv 1909.05858), section 4.1; HF
  ``RepetitionPenaltyLogitsProcessor``: a seen token's logit is divided by the penalty when
  positive and multiplied by it when negative;
- temperature: HF ``TemperatureLogitsWarper`` (``logits / temperature``); 0 means greedy;
- top-k: HF ``TopKLogitsWarper``, except that ties at the k-th value keep exactly k tokens (the
  ``torch.topk`` indices; HF keeps every token tied with the k-th);
- top-p (nucleus): Holtzman et al. 2019 (arXiv 1904.09751), section 3.1; HF ``TopPLogitsWarper``:
  keep the smallest prefix of the descending-sorted distribution whose mass is >= p;
- min-p: Nguyen et al. 2024 (arXiv 2407.01082); HF ``MinPLogitsWarper``: keep tokens whose
  probability is >= ``min_p`` times the top token's.

:func:`filter_logits` applies them in HF's order (penalty, temperature, top-k, top-p, min-p), each
on the distribution the previous steps left (renormalised), and :func:`sample` draws from the
result. Every filter keeps the most probable token, so a row never ends up empty.

Typical loop::

    cfg = SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    cfg.validate()
    seen = seen_mask_from_ids(prompt_ids, vocab_size)
    gen = torch.Generator(device=logits.device).manual_seed(0)
    for _ in range(n):
        nxt = sample(logits[:, -1], cfg, generator=gen, seen_mask=seen)    # int64 [B]
        seen = mark_seen(seen, nxt)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "GREEDY_BELOW",
    "SamplingConfig",
    "apply_repetition_penalty",
    "top_k_mask",
    "top_p_mask",
    "min_p_mask",
    "filter_logits",
    "sample",
    "seen_mask_from_ids",
    "mark_seen",
]


@dataclass(frozen=True)
class SamplingConfig:
    """Static sampling parameters (one set for the whole batch).

    The defaults turn every filter off and sample from ``softmax(logits)`` at temperature 1.
    Construction does not check the values; :meth:`validate` does (and :func:`filter_logits` and
    :func:`sample` call it).
    """

    temperature: float = 1.0
    """Divides the logits before sampling; below :data:`GREEDY_BELOW` (1e-5, vLLM's rule; 0
    included) decoding is greedy (argmax of the penalised logits). >= 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off. >= 0."""
    top_p: float = 1.0
    """Nucleus mass: keep the smallest most-likely set with mass >= top_p. In (0, 1]; 1 = off."""
    min_p: float = 0.0
    """Keep tokens with probability >= min_p * (top probability). In [0, 1); 0 = off."""
    repetition_penalty: float = 1.0
    """CTRL penalty on already-seen tokens (needs a ``seen_mask``). In [1e-4, 1e4]; 1 = off, > 1
    discourages repeats (the bounds keep the penalised fp32 logits finite)."""

    def validate(self) -> None:
        """Check every field.

        Raises:
            ValueError: naming the field, its value and the allowed range, for: a non-finite
                (nan/inf) value in any field, ``temperature < 0``, ``top_k`` not an int or < 0,
                ``top_p`` outside (0, 1], ``min_p`` outside [0, 1), ``repetition_penalty`` outside
                [1e-4, 1e4].
        """
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"SamplingConfig.{name}={value!r} must be a finite real number")
            if not math.isfinite(value):
                raise ValueError(f"SamplingConfig.{name}={value!r} must be finite (not nan or inf)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"SamplingConfig.min_p={self.min_p!r} must be in [0, 1) (0 = off)")
        if not 1e-4 <= self.repetition_penalty <= 1e4:
            raise ValueError(f"SamplingConfig.repetition_penalty={self.repetition_penalty!r} must be in [1e-4, 1e4] (1 = off)")

    @property
    def greedy(self) -> bool:
        """True when ``temperature < GREEDY_BELOW`` (argmax decoding): dividing fp32 logits by a
        smaller temperature would overflow, and the distribution is a point mass anyway."""
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``)."""


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, V], got shape {tuple(t.shape)}")


def _check_seen(logits: torch.Tensor, seen_mask: torch.Tensor) -> None:
    if seen_mask.dtype != torch.bool or seen_mask.shape != logits.shape:
        raise ValueError(f"seen_mask must be bool with the logits' shape {tuple(logits.shape)}, got {seen_mask.dtype} {tuple(seen_mask.shape)}")


def seen_mask_from_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[B, vocab_size]`` mask of the ids present in each row of ``ids`` (int ``[B, T]``).

    Ids outside ``[0, vocab_size)`` (padding such as -1, or ids of an embedding larger than the
    LM head, which HF's ``RepetitionPenaltyLogitsProcessor`` also drops) are ignored.
    """
    _check_2d("ids", ids)
    ids = ids.long()
    valid = (ids >= 0) & (ids < vocab_size)
    ids = torch.where(valid, ids, torch.full_like(ids, vocab_size))
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def mark_seen(seen_mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Return ``seen_mask`` (bool ``[B, V]``) with ``tokens`` (int ``[B]``, in range) also marked seen (out of place)."""
    return seen_mask.scatter(1, tokens.long().view(-1, 1), True)


def apply_repetition_penalty(logits: torch.Tensor, seen_mask: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``).

    For tokens with ``seen_mask`` True, a positive logit is divided by ``penalty`` and a negative
    one multiplied by it (zero stays zero); other tokens are unchanged. ``penalty > 1`` makes seen
    tokens less likely, ``penalty < 1`` more likely, 1 is the identity.

    Args:
        logits: float ``[B, V]``.
        seen_mask: bool ``[B, V]``, True for tokens already in the row's context.
        penalty: > 0.

    Returns:
        A new tensor, same shape and dtype as ``logits``.

    Raises:
        ValueError: ``penalty <= 0`` or non-finite, or shapes/dtypes that do not match.
    """
    _check_2d("logits", logits)
    _check_seen(logits, seen_mask)
    if not (math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"repetition penalty={penalty!r} must be finite and > 0")
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen_mask, penalised, logits)


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[B, V]`` mask of the ``k`` highest logits in each row (HF ``TopKLogitsWarper``).

    Exactly ``min(k, V)`` tokens are kept per row: ties at the k-th value are broken by
    ``torch.topk``'s choice of indices (HF would keep every tied token). ``k == 0`` (off) or
    ``k >= V`` keeps everything. Also works on probabilities (same order).

    Raises:
        ValueError: ``k`` negative or not an int.
    """
    _check_2d("logits", logits)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"top_k={k!r} must be an int >= 0 (0 = off)")
    vocab = logits.shape[-1]
    if k == 0 or k >= vocab:
        return torch.ones_like(logits, dtype=torch.bool)
    idx = torch.topk(logits, k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Bool ``[B, V]`` nucleus mask (Holtzman et al. 2019; HF ``TopPLogitsWarper``).

    Keeps the smallest prefix of each row's descending-sorted distribution whose mass is >= ``p``:
    the token whose mass crosses ``p`` is kept, and the top token always is, so the set is never
    empty. Token ``i`` (in sorted order) is kept when the mass strictly before it is < ``p``; this
    compares the exclusive cumulative sum, whose first entry is exactly 0 and whose entries are
    exact for dyadic probabilities, so boundaries such as ``[0.5, 0.25, ...]`` with ``p=0.75``
    are not disturbed by rounding. Ties in probability are ordered by index (stable sort), lower
    index first. ``p == 1`` (off) keeps everything.

    Args:
        probs: ``[B, V]`` probabilities (any float dtype; each row should sum to 1).
        p: in (0, 1].

    Raises:
        ValueError: ``p`` outside (0, 1] or non-finite.
    """
    _check_2d("probs", probs)
    if not (math.isfinite(p) and 0 < p <= 1):
        raise ValueError(f"top_p={p!r} must be in (0, 1] (1 = off)")
    if p >= 1:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass strictly before each token
    keep_sorted = before < p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def min_p_mask(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Bool ``[B, V]`` min-p mask (Nguyen et al. 2024; HF ``MinPLogitsWarper``).

    Keeps tokens with ``prob >= min_p * max(prob)`` in their row; the top token always passes.
    The rule is scale-free, so ``probs`` need not be normalised (e.g. probabilities with filtered
    tokens zeroed). ``min_p == 0`` (off) keeps everything.

    Args:
        probs: ``[B, V]`` non-negative, any float dtype.
        min_p: in [0, 1).

    Raises:
        ValueError: ``min_p`` outside [0, 1) or non-finite.
    """
    _check_2d("probs", probs)
    if not (math.isfinite(min_p) and 0 <= min_p < 1):
        raise ValueError(f"min_p={min_p!r} must be in [0, 1) (0 = off)")
    if min_p == 0:
        return torch.ones_like(probs, dtype=torch.bool)
    return probs >= min_p * probs.amax(dim=-1, keepdim=True)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 logits, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig, seen_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Penalise, scale and filter next-token logits; removed tokens become ``-inf``.

    Order (HF ``generate``'s): repetition penalty (only with a ``seen_mask``), temperature, top-k,
    then top-p on the distribution renormalised after top-k, then min-p (scale-free, so it does not
    matter that it sees the distribution after top-p). ``softmax`` of the result is the sampling
    distribution. With ``temperature == 0`` the result keeps only the argmax of the penalised
    logits (the point mass greedy decoding draws from), unscaled.

    Args:
        logits: float ``[B, V]`` (any float dtype); each row needs at least one finite logit.
        cfg: the parameters; validated here.
        seen_mask: bool ``[B, V]`` of tokens already in each row's context, or None (no penalty).

    Returns:
        ``[B, V]`` in float32 (float64 for float64 input): kept tokens hold their penalised,
        temperature-scaled logits, removed ones ``-inf``. At least one token per row is kept.

    Raises:
        ValueError: an invalid ``cfg`` (see :meth:`SamplingConfig.validate`), non-2-D ``logits``
            or a ``seen_mask`` of another shape or dtype.
    """
    cfg.validate()
    _check_2d("logits", logits)
    x = logits.to(_work_dtype(logits.dtype))
    if seen_mask is not None:
        _check_seen(x, seen_mask)
        if cfg.repetition_penalty != 1:
            x = apply_repetition_penalty(x, seen_mask, cfg.repetition_penalty)
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if cfg.greedy:
        top = x.argmax(dim=-1, keepdim=True)
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top, True)
        return torch.where(keep, x, neg_inf)
    if cfg.temperature != 1:
        x = x / cfg.temperature
    if cfg.top_k:
        x = torch.where(top_k_mask(x, cfg.top_k), x, neg_inf)
    if cfg.top_p < 1 or cfg.min_p > 0:
        probs = torch.softmax(x, dim=-1)  # renormalised over what top-k kept
        keep = top_p_mask(probs, cfg.top_p)
        if cfg.min_p > 0:
            keep = keep & min_p_mask(torch.where(keep, probs, torch.zeros_like(probs)), cfg.min_p)
        x = torch.where(keep, x, neg_inf)
    return x


def sample(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None = None,
    seen_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from the filtered distribution; int64 ``[B]`` on ``logits.device``.

    ``temperature == 0``: the argmax of the (repetition-penalised, in float32) logits, lowest
    index on ties; ``generator`` is not touched. Otherwise: ``softmax`` in float32 (float64 for float64 logits)
    of :func:`filter_logits`, sampled with the exponential race ``argmax(probs / E)``,
    ``E ~ Exponential(1)`` i.i.d. per token, drawn from ``generator`` (torch's default generator
    when None). The race picks token ``i`` with probability ``probs[i]`` exactly (the minimum of
    independent ``Exp(rate=probs[i])`` variables is ``i`` with that probability), like
    ``torch.multinomial(probs, 1)``, but without a device-to-host sync; filtered tokens have
    probability 0 and are never drawn. The same seed on the same device gives the same tokens.

    Under ``torch.compile(fullgraph=True)`` pass ``generator=None``: dynamo cannot trace a
    ``torch.Generator`` argument (it graph-breaks), while torch's default generator works and is
    seeded by ``torch.manual_seed``.

    Args:
        logits: float ``[B, V]``, the last position's logits.
        cfg: the parameters; validated here.
        generator: a ``torch.Generator`` on ``logits.device``, or None.
        seen_mask: bool ``[B, V]`` of tokens already in each row's context (for the penalty), or None.

    Raises:
        ValueError: as :func:`filter_logits`.
    """
    x = filter_logits(logits, cfg, seen_mask)
    if cfg.greedy:
        return x.argmax(dim=-1)  # only the penalised argmax is finite
    probs = torch.softmax(x, dim=-1)
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # E == 0 has probability ~0 but would turn 0 / 0 into nan; the floor keeps kept tokens finite
    # (p / tiny <= 1 / 1.2e-38 fits in float32) and filtered ones at exactly 0.
    e = e.clamp_min(torch.finfo(probs.dtype).tiny)
    return (probs / e).argmax(dim=-1)
