"""Log-probabilities in the OpenAI shapes: the completions ``logprobs`` object (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat ``logprobs.content`` list."""

from __future__ import annotations

from collections.abc import Sequence

from mff.serve.request import TokenLogprob
from mff.serve.text import Codec

__all__ = ["MIN_LOGPROB", "completion_logprobs", "chat_logprobs"]

MIN_LOGPROB = -9999.0
"""Log-probabilities below this (``-inf`` included) are reported as this (JSON has no infinity; vLLM's convention)."""
def _lp(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB  # nan fails both comparisons: reported as the minimum too


def _top_dict(codec: Codec, entry: TokenLogprob) -> dict[str, float]:
    """The alternatives of one position by token string, the chosen token added when not among them (vLLM)."""
    out = {codec.token_str(t): _lp(v) for t, v in entry.top.items()}
    out.setdefault(codec.token_str(entry.token_id), _lp(entry.logprob))
    return out


def completion_logprobs(codec: Codec, ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0) -> dict:
    """The completions ``logprobs`` object of ``ids``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (null where ``entries`` has None: the first prompt token) and ``text_offset``
    (running sum of the token strings' lengths, from ``offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, e in zip(ids, entries):
        s = codec.token_str(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        lps.append(None if e is None else _lp(e.logprob))
        tops.append(None if e is None else _top_dict(codec, e))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(codec: Codec, entries: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    def one(t: int, v: float) -> dict:
        return {"token": codec.token_str(t), "logprob": _lp(v), "bytes": codec.token_bytes(t)}

    return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top.items()]) for e in entries]}
