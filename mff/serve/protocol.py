"""The request bodies of the OpenAI-compatible endpoints, and their conversion to engine requests.

Every model here is strict (a string is not a number, ``1.0`` is not an integer, ``true`` is not
a number), forbids fields it does not know (a misspelt ``max_token`` is an error, not a silent
default) and checks ranges; the HTTP layer (:mod:`mff.serve.api`) turns a
:class:`pydantic.ValidationError` into an HTTP 400 naming the field. What depends on the model
(the context length, the vocabulary, the tokenizer) is checked by :func:`engine_requests` and the
HTTP layer, again as ValueError / 400.

Shapes and defaults follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``) and vLLM's extensions to it (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``/tokenize``, ``/detokenize``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mff.sampling import SamplingConfig
from mff.serve.engine import MAX_LOGPROBS  # most alternatives per position the engine returns
from mff.serve.request import EngineRequest

__all__ = ["MAX_N", "MAX_STOP", "MAX_STOP_CHARS", "MAX_LOGPROBS", "MAX_CHOICES", "StreamOptions", "CompletionRequest",
           "ChatMessage", "ChatRequest", "TokenizeRequest", "DetokenizeRequest", "sampling_config", "engine_requests",
           "check_context", "stop_strings"]

MAX_N = 16
"""Most choices (``n``) one request may ask for."""
MAX_STOP = 16
"""Most stop strings one request may give."""
MAX_STOP_CHARS = 1000
"""Longest stop string, in characters."""
MAX_CHOICES = 256
"""Most choices (prompts x ``n``) one request may ask for."""
MAX_SEED = 2**63
"""Seeds are in ``[0, MAX_SEED)`` (the engine's ``torch.Generator`` range)."""

NonNegInt = Annotated[int, Field(ge=0)]
StopField = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options`` of a streaming request."""

    include_usage: bool = False
    """Send a last chunk with ``usage`` (and empty ``choices``) before ``[DONE]``."""
    continuous_usage_stats: bool = False
    """Also put ``usage`` so far in every chunk (vLLM's extension)."""


class _Sampling(_Strict):
    """The sampling and stopping fields both endpoints share."""

    model: str | None = None
    """The served model's name (``GET /v1/models``); another name is a 404. Optional."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; below 1e-5 (0 included) greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass in (0, 1]; 1 = off."""
    top_k: int = Field(0, ge=-1)
    """Keep the k most likely tokens; 0 or -1 (vLLM's spelling) = off."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    """Drop tokens below min_p x the top probability; 0 = off."""
    repetition_penalty: float = Field(1.0, ge=1e-4, le=1e4)
    """CTRL penalty on tokens already seen (prompt included); 1 = off."""
    presence_penalty: float = 0.0
    """Accepted for client compatibility; only 0 (off) is served."""
    frequency_penalty: float = 0.0
    """Accepted for client compatibility; only 0 (off) is served."""
    stop: StopField | Annotated[list[StopField], Field(max_length=MAX_STOP)] | None = None
    """Stop strings: the text ends before the first one generated (it is not returned)."""
    stop_token_ids: Annotated[list[NonNegInt], Field(max_length=256)] | None = None
    """Token ids that end the generation (besides the model's EOS ids); the id is not shown in the text."""
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    """Sampling seed; choice i of ``n`` uses ``seed + i``. None: the engine draws one."""
    n: int = Field(1, ge=1, le=MAX_N)
    """Choices per prompt."""
    stream: bool = False
    """Answer with server-sent events (``data: {...}`` chunks, then ``data: [DONE]``)."""
    stream_options: StreamOptions | None = None
    """Only with ``stream``."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS ids."""
    user: str | None = None
    """Accepted for client compatibility; unused."""

    @model_validator(mode="after")
    def _check_shared(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported (only 0); use repetition_penalty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionRequest(_Sampling):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    """A text, several texts, a prompt of token ids, or several prompts of token ids."""
    max_tokens: int | None = Field(16, ge=0)
    """Most tokens to generate per choice (OpenAI's default 16); None: up to the context length.
    0 with ``echo``: only the prompt (and its log-probabilities)."""
    echo: bool = False
    """Return the prompt before the completion (and, with ``logprobs``, the prompt tokens'
    log-probabilities, the first one null)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Per token: its log-probability and the ``logprobs`` most likely alternatives."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Accepted when equal to ``n`` (or absent): the server returns every choice it generates."""
    logit_bias: dict[str, float] | None = None
    """Accepted when empty; biasing logits is not supported."""
    suffix: str | None = None
    """Accepted when absent or empty; insertion is not supported."""

    @model_validator(mode="before")
    @classmethod
    def _check_prompt_items(cls, data):
        """Name the first bad element of a list prompt (``prompt[1]``, ``prompt[0][3]``), which the
        union type alone reports only as "not one of the forms"."""
        p = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(p, list) or not p:
            return data

        def token_id(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        def bad(where: str, x, expected: str):
            raise ValueError(f"{where}: expected {expected} (got {json.dumps(x)[:80]})")

        if isinstance(p[0], str):
            for i, x in enumerate(p):
                if not isinstance(x, str):
                    bad(f"prompt[{i}]", x, "a string, as prompt[0] is")
        elif isinstance(p[0], list):
            for i, row in enumerate(p):
                if not isinstance(row, list):
                    bad(f"prompt[{i}]", row, "a list of token ids, as prompt[0] is")
                for j, x in enumerate(row):
                    if not token_id(x):
                        bad(f"prompt[{i}][{j}]", x, "a token id (an integer >= 0)")
        else:
            for i, x in enumerate(p):
                if not token_id(x):
                    bad(f"prompt[{i}]", x, "a token id (an integer >= 0)")
        return data

    @model_validator(mode="after")
    def _check_completion(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; give a string, a list of strings, token ids or lists of token ids")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], list) and any(not p for p in self.prompt):
            raise ValueError("prompt: a prompt of token ids is empty; give at least one token id")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} differs from n={self.n}; only best_of == n is supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported (give {} or leave it out)")
        if self.suffix:
            raise ValueError("suffix is not supported (leave it out)")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    """The text, or a list of text parts (joined with no separator)."""
    name: str | None = None

    def text(self) -> str:
        """The content as one string ("" for None)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The dict a chat template reads: ``role``, ``content`` (a string), ``name`` when given."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Sampling):
    """The body of ``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    """The conversation, rendered with the checkpoint's chat template."""
    max_tokens: int | None = Field(None, ge=0)
    """Most tokens per choice (deprecated OpenAI name of ``max_completion_tokens``); None: up to the context length."""
    max_completion_tokens: int | None = Field(None, ge=0)
    """Most tokens per choice; None: up to the context length."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """With ``logprobs``: the most likely alternatives per token."""
    add_generation_prompt: bool = True
    """Render the template's opening of the assistant's turn (vLLM's extension)."""

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} differ; give one")
        return self

    def token_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: up to the context length)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as the dicts a chat template reads."""
        return [m.for_template() for m in self.messages]


class TokenizeRequest(_Strict):
    """The body of ``POST /tokenize``: a ``prompt`` or chat ``messages`` (one of the two)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS); default True for ``prompt``, False for ``messages``
    (the template writes them)."""
    add_generation_prompt: bool = True
    """With ``messages``: open the assistant's turn."""
    return_token_strs: bool = False
    """Also return each token's string."""

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty; give at least one message")
        return self


class DetokenizeRequest(_Strict):
    """The body of ``POST /detokenize``."""

    model: str | None = None
    tokens: list[NonNegInt]


def sampling_config(req: _Sampling) -> SamplingConfig:
    """The :class:`SamplingConfig` of a request (``top_k`` -1 read as 0, off). Raises ValueError as
    :meth:`SamplingConfig.validate`."""
    cfg = SamplingConfig(temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                         repetition_penalty=req.repetition_penalty)
    cfg.validate()
    return cfg


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of strings (empty for None)."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, where: str = "the prompt") -> int:
    """The tokens to generate: ``max_tokens``, or what is left of the context when None.

    Raises:
        ValueError: naming both numbers, when ``prompt_len + max_tokens`` exceeds ``max_model_len``
            (or the prompt alone fills it and no ``max_tokens`` is given).
    """
    def tokens(n: int) -> str:
        return f"{n} token" if n == 1 else f"{n} tokens"

    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise ValueError(f"{where} has {tokens(prompt_len)} but the model's context is {max_model_len} tokens; "
                             "shorten the prompt")
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(f"{where} has {tokens(prompt_len)} and max_tokens is {max_tokens}: {prompt_len + max_tokens} tokens, "
                         f"more than the model's context of {max_model_len} tokens; shorten the prompt or lower max_tokens")
    return max_tokens


def engine_requests(base_id: str, prompt_ids: Sequence[int], max_tokens: int, req: _Sampling, *, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    stop_check: Callable[[], Callable[[list[int]], bool] | None] = lambda: None) -> list[EngineRequest]:
    """The ``req.n`` engine requests of one prompt: ids ``{base_id}-{i}``, choice ``i`` seeded with
    ``seed + i`` (modulo 2**63) when ``req.seed`` is given. ``stop_check`` makes each choice's own
    stop-string check (or None).

    Raises:
        ValueError: bad sampling values (:func:`sampling_config`), ``stop_token_ids`` given as
            something else than ids (the engine checks their range).
    """
    sampling = sampling_config(req)
    out = []
    for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i) % MAX_SEED
        out.append(EngineRequest(request_id=f"{base_id}-{i}", prompt_ids=list(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                                 seed=seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop_check=stop_check()))
    return out
