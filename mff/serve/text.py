"""The text side of the server: the tokenizer (:class:`Codec`), stop strings, and each choice's
streamed text (:class:`Choice`), as :mod:`mff.serve.api` describes them."""

from __future__ import annotations

from collections.abc import Sequence

from mff.data.chat import render_chat_template
from mff.serve.errors import ApiError
from mff.serve.request import EngineRequest, RequestOutput, TokenLogprob

__all__ = ["Codec", "find_stop", "StopCheck", "Choice"]


class Codec:
    """The tokenizer side of the server: encoding, decoding and token strings.

    ``text``: a :class:`mff.ckpt.tokenizer_files.TextAssets` (``tokenizer``, ``chat_template``,
    ``bos_token``, ``eos_token``, ``eos_ids``); ``model_vocab``: the model's vocabulary size
    (prompt ids must be below it; it may exceed the tokenizer's).
    """

    def __init__(self, text, model_vocab: int):
        self.text, self.tokenizer, self.model_vocab = text, text.tokenizer, model_vocab
        self.size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._strs: dict[int, tuple[str, bool]] = {}

    def encode(self, s: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``s`` (with the tokenizer's BOS etc. when ``add_special_tokens``)."""
        return self.tokenizer.encode(s, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not know decode to nothing."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _token(self, i: int) -> tuple[str, bool]:
        if i not in self._strs:
            piece = self.decode([i], skip_special_tokens=False)
            tok = self.tokenizer.id_to_token(i)
            if tok is None:
                self._strs[i] = (f"<|id:{i}|>", False)
            elif not piece or "\ufffd" in piece:
                self._strs[i] = (f"bytes:{tok}", False)
            else:
                self._strs[i] = (piece, True)
        return self._strs[i]

    def token_str(self, i: int) -> str:
        """The string of token ``i`` in log-probability listings (see the module docstring)."""
        return self._token(i)[0]

    def token_bytes(self, i: int) -> list[int] | None:
        """The UTF-8 bytes of :meth:`token_str`, or None when it is not the token's text."""
        s, is_text = self._token(i)
        return list(s.encode("utf-8")) if is_text else None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template applied to ``messages``.

        Raises:
            ApiError: 400 when the checkpoint has no chat template or the template refuses the
                messages (its ``raise_exception`` message is passed on).
        """
        if not self.text.chat_template:
            raise ApiError(400, "the served model has no chat template; use /v1/completions with a prompt", "messages")
        try:
            return render_chat_template(self.text.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        what="the chat template", bos_token=self.text.bos_token or "",
                                        eos_token=self.text.eos_token or "")
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"messages: {e}", "messages") from None

    def check_ids(self, ids: Sequence[int], where: str, limit: int | None = None) -> None:
        """Raise a 400 ApiError naming ``where`` when an id is not in ``[0, limit)`` (default: the model's vocabulary)."""
        limit = self.model_vocab if limit is None else limit
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < limit), None)
        if bad is not None:
            raise ApiError(400, f"{where}[{bad}]: token id {ids[bad]} is not in the vocabulary [0, {limit})", where.split("[")[0])


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """The index in ``text`` of the earliest occurrence of any of ``stops`` (None: none occurs)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class StopCheck:
    """``EngineRequest.stop_check`` for stop strings: called in the engine thread with all the ids
    generated so far, True once the decoded text (``skip_special_tokens``) holds any of ``stops``.
    Only the text that can hold a new occurrence is searched (each call decodes all the ids)."""

    def __init__(self, codec: Codec, stops: Sequence[str]):
        self.codec, self.stops = codec, tuple(stops)
        self.longest = max(len(s) for s in self.stops)
        self._searched = 0

    def __call__(self, ids: list[int]) -> bool:
        text = self.codec.decode(ids)
        start = max(0, min(self._searched, len(text)) - self.longest + 1)
        self._searched = len(text)
        return find_stop(text[start:], self.stops) is not None


class Choice:
    """One choice (one engine request) seen from the HTTP side: its tokens, log-probabilities and
    the text already streamed."""

    def __init__(self, index: int, req: EngineRequest, eos_ids: Sequence[int], stops: Sequence[str], prompt_text: str):
        self.index, self.req, self.stops, self.prompt_text = index, req, tuple(stops), prompt_text
        self.stop_ids = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else frozenset(eos_ids))
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.started = False
        self.offset = 0  # text_offset of the next streamed log-probability entry

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: RequestOutput) -> None:
        """Take one engine output."""
        self.ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason

    def _visible(self) -> list[int]:
        if self.finish_reason == "stop" and self.ids and self.ids[-1] in self.stop_ids:
            return self.ids[:-1]
        return self.ids

    def text(self, codec: Codec) -> tuple[str, bool]:
        """``(text, stopped)``: the generated text, cut before the first stop string when one occurs."""
        text = codec.decode(self._visible())
        cut = find_stop(text, self.stops) if self.stops else None
        return (text, False) if cut is None else (text[:cut], True)

    def final_reason(self, codec: Codec) -> str:
        """``stop`` or ``length`` (a stop string found in the text counts as ``stop``)."""
        return "stop" if self.finish_reason == "stop" or self.text(codec)[1] else self.finish_reason

    def stop_reason(self, codec: Codec) -> str | int | None:
        """vLLM's ``stop_reason`` of a finished choice: the stop string that ended the text (the
        earliest in the text; the first listed among those starting there), else the id from
        ``stop_token_ids`` it emitted last, else None (an EOS, ``length``, or not finished)."""
        if not self.finished:
            return None
        if self.stops:
            text = codec.decode(self._visible())
            cut = find_stop(text, self.stops)
            if cut is not None:
                return next(s for s in self.stops if text.startswith(s, cut))
        if self.finish_reason == "stop" and self.ids and self.ids[-1] in self.req.stop_token_ids:
            return self.ids[-1]
        return None

    def delta(self, codec: Codec) -> str:
        """The text not streamed yet that may be streamed now (see the module docstring)."""
        text, stopped = self.text(codec)
        end = len(text)
        if not self.finished and not stopped:
            end -= self.hold
            stripped = text.rstrip("\ufffd")
            if len(stripped) < len(text):
                end = min(end, len(stripped))
        end = max(end, self.sent_chars)
        out, self.sent_chars = text[self.sent_chars:end], end
        return out

    def usage_tokens(self) -> int:
        return len(self.ids)
