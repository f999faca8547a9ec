"""Tokenising evaluation requests: (context, continuation) pairs and rolling windows.

The conventions are lm-evaluation-harness's (``lm_eval/api/model.py`` ``TemplateLM._encode_pair``
and ``lm_eval/utils.py`` ``get_rolling_token_windows``), so that mff and lm-eval score the same
tokens:

- trailing whitespace of a context moves to the start of its continuation;
- the pair is encoded whole and the continuation is what follows the context's own encoding;
- an empty context becomes the prefix token (BOS, else EOS).

One case lm-eval leaves unscored is handled: when the context's last token merges with the
continuation into one token, the whole-encoding split leaves an empty continuation; mff then
encodes the continuation alone (and counts the case in :class:`EncodeStats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["EncodeStats", "encode_pair", "rolling_windows", "window_requests"]


@dataclass
class EncodeStats:
    """Counts of the special cases met while tokenising requests.

    ``merged``: continuations that merged with the context's last token (scored alone instead);
    ``truncated``: requests longer than the model's length (their context cut from the left)."""

    merged: int = 0
    truncated: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"merged_continuations": self.merged, "truncated_requests": self.truncated}


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str, prefix_id: int | None,
                stats: EncodeStats | None = None) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` of one log-likelihood request.

    Args:
        encode: text -> token ids (the checkpoint's tokenizer, with its special-token rule).
        prefix_id: the id that stands in for an empty context (BOS, else EOS); None when the
            tokenizer has neither (an empty context is then an error).
    Returns:
        Two lists of ints; the continuation list is never empty.
    Raises:
        ValueError: an empty continuation, an empty context without a prefix id, a continuation
            that encodes to no tokens.
    """
    if not continuation:
        raise ValueError(f"empty continuation for the context {context[-60:]!r}: nothing to score")
    if not context:
        cont = encode(continuation)
        if not cont:
            raise ValueError(f"the continuation {continuation[:60]!r} encodes to no tokens")
        if prefix_id is None:
            if len(cont) < 2:
                raise ValueError("an empty context needs a BOS or EOS token to condition on; the tokenizer has neither")
            return cont[:1], cont[1:]
        return ([prefix_id], cont) if cont[0] != prefix_id else (cont[:1], cont[1:] or cont)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:  # the context was all whitespace
        return encode_pair(encode, "", continuation, prefix_id, stats)
    whole = encode(context + continuation)
    ctx = encode(context)
    cont = whole[len(ctx):]
    if not cont:  # the continuation merged into the context's last token: score it encoded alone
        if stats is not None:
            stats.merged += 1
        cont = encode(continuation)
        if not cont:
            raise ValueError(f"the continuation {continuation[:60]!r} encodes to no tokens")
    if not ctx:
        if prefix_id is None:
            raise ValueError(f"the context {context!r} encodes to no tokens and the tokenizer has no BOS or EOS to stand for it")
        ctx = [prefix_id]
    return ctx, cont


def rolling_windows(n: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Windows that score positions ``1 .. n-1`` of an ``n``-token sequence exactly once.

    The targets are cut into chunks: positions ``1 .. window`` first, then ``stride`` positions
    at a time. Each chunk is fed with as much context as fits in ``window`` tokens, ending just
    before its last target. With ``stride == window`` on a sequence that starts with the prefix
    token this is lm-eval's rolling log-likelihood (``get_rolling_token_windows`` with
    ``context_len=1`` then ``make_disjoint_window``, its last window included); a smaller stride
    gives every scored token at least ``window - stride`` tokens of context (the strided
    perplexity of the HF perplexity guide).

    Args:
        n: sequence length (tokens, the prefix token included).
        window: tokens fed per forward (the model's length at most), >= 1.
        stride: positions scored per window after the first, 1 <= stride <= window (default
            ``window``).
    Returns:
        ``[(begin, last, first)]``: feed ``ids[begin:last]``, score the targets at positions
        ``first .. last`` (each position of ``1 .. n-1`` in exactly one window).
    Raises:
        ValueError: ``window`` < 1, ``stride`` outside ``[1, window]``.
    """
    stride = window if stride is None else stride
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride={stride!r} must be an int in [1, window={window}]")
    out, first, last = [], 1, min(window, n - 1)
    while first <= n - 1:
        out.append((max(0, last - window), last, first))
        first, last = last + 1, min(last + stride, n - 1)
    return out


def window_requests(ids: Sequence[int], window: int, stride: int | None = None) -> list[tuple[list[int], list[int]]]:
    """The windows of :func:`rolling_windows` as ``(context ids, continuation ids)`` requests:
    the context is what the window feeds before its first scored target, the continuation the
    targets it scores. Their log-likelihoods sum to the sequence's rolling log-likelihood."""
    out = []
    for begin, last, first in rolling_windows(len(ids), window, stride):
        out.append((list(ids[begin:first]), list(ids[first:last + 1])))
    return out
