"""The OpenAI-compatible HTTP layer over the serving engine (FastAPI; ``pip install mff[serve]``).

:func:`build_app` serves one :class:`mff.serve.engine.Engine` (already started) under one model
name:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the OpenAI shapes (``usage``,
  ``finish_reason`` ``stop`` / ``length``, server-sent events with ``stream``, a last
  ``data: [DONE]``), with vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
  ``stop_token_ids``, ``ignore_eos``, ``echo`` with prompt log-probabilities, ``max_tokens: 0``);
- ``GET /v1/models`` (and ``/v1/models/{name}``), ``GET /health``;
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's shapes, which
  lm-eval's remote tokenizer reads);
- ``GET /metrics``: :meth:`Engine.metrics` in the Prometheus text format (``mff_serve_*``
  gauges and counters); ``GET /metrics?format=json`` gives the same dict as JSON.

Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad request (bad JSON, wrong types, unknown fields, values out of range, a prompt longer than the
context, token ids outside the vocabulary; the message names the field), 404 for another model
name or an unknown path, 429 when the engine's queue is full, 503 while the server shuts down,
504 when a request runs past ``request_timeout_s``, 500 only when the engine itself failed.
Request bodies are read as JSON whatever their content type (``curl -d`` sends a form type) and
validated by :mod:`mff.serve.protocol`; FastAPI's own validation errors (its 422) are answered as
400 in the same shape.

Text: generated ids are decoded with ``skip_special_tokens=True``; a final EOS or stop id is not
shown. A stop string ends the choice (``finish_reason`` ``stop``) and the text ends before it;
while streaming, the last ``len(longest stop string) - 1`` characters are held back until it is
known whether they start a stop string, and text is held back while it ends in an incomplete
UTF-8 character (``\\ufffd``). A streamed text only grows: the decoding of more tokens is
assumed to extend the decoding of fewer (true of byte-level BPE and of SentencePiece-style
tokenizers past their first token).

Log-probability token strings come from one function (:meth:`Codec.token_str`): the token's own
decoding, or ``bytes:<token>`` for a token that is part of a UTF-8 character, or
``<|id:N|>`` for an id the tokenizer does not know (the model's vocabulary may be larger), so
``tokens[i]`` and the keys of ``top_logprobs[i]`` always agree.

A client that disconnects has its requests aborted: streaming responses are cancelled by the
server (ASGI spec 2.3 servers such as uvicorn cancel the stream on ``http.disconnect``);
non-streaming ones poll :meth:`starlette.requests.Request.is_disconnected` twice a second.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mff.data.chat import render_chat_template
from mff.serve.protocol import (
    MAX_CHOICES,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_context,
    engine_requests,
    stop_strings,
)
from mff.serve.request import EngineRequest, QueueFullError, RequestOutput, TokenLogprob

__all__ = ["build_app", "ApiError", "Codec", "StopCheck", "find_stop", "prometheus_text"]

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}
MIN_LOGPROB = -9999.0
"""Log-probabilities below this (``-inf`` included) are reported as this (JSON has no infinity; vLLM's convention)."""
POLL_S = 0.5
"""How often a non-streaming request checks that its client is still connected."""


class ApiError(Exception):
    """An HTTP error with an OpenAI error object: ``status``, ``message``, the request field ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status`` (``code`` is the status)."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------- errors
_TYPE_NAMES = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|constrained-.*|function-.*|TextPart|ChatMessage|"
                         r"StreamOptions|tagged-union\[.*\])$")
_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids (integers >= 0) or a list of lists of token ids",
    "stop": "expected a non-empty string of at most 1000 characters or a list of at most 16 of them",
    "content": "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}
_FIELD = re.compile(r"^([a-z_]+)\b")


def _loc_name(loc: Sequence) -> str:
    """``("messages", 0, "content", "str")`` -> ``messages[0].content`` (union branch names dropped)."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_NAMES.match(str(part)):
            out += ("." if out else "") + str(part)
    return out


def validation_error(errors: Sequence[dict]) -> ApiError:
    """A 400 :class:`ApiError` for pydantic / FastAPI validation ``errors`` (the first one)."""
    e = errors[0]
    kind, msg = e.get("type", ""), str(e.get("msg", "invalid"))
    field = _loc_name(e.get("loc", ()))
    if kind == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', msg)}")
    if kind in ("model_type", "model_attributes_type", "dict_type") and not field:
        return ApiError(400, "the request body must be a JSON object")
    if kind == "missing" and not field:
        return ApiError(400, "the request body is missing; send a JSON object")
    if kind == "value_error" and not field:  # a model validator: its message starts with the field
        text = msg.removeprefix("Value error, ")
        m = _FIELD.match(text)
        return ApiError(400, text, m.group(1) if m else None)
    top = field.split(".")[0].split("[")[0] or None
    if kind == "extra_forbidden":
        return ApiError(400, f"{field}: unknown field (this server does not accept it)", top)
    leaf = field.split(".")[-1].split("[")[0]
    in_union = any(isinstance(p, str) and _TYPE_NAMES.match(p) for p in e.get("loc", ()))
    hint = _UNION_HINTS.get(leaf) if in_union else None
    got = e.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
    return ApiError(400, f"{field}: {hint or msg} (got {shown})", top)


def _engine_error(e: ValueError) -> ApiError:
    """An engine ``ValueError`` (its message starts with the field it names) as an ApiError."""
    text = str(e)
    if "shutting down" in text:
        return ApiError(503, "the server is shutting down")
    m = _FIELD.match(text)
    return ApiError(400, text, m.group(1) if m and m.group(1) not in ("the",) else None)


# ---------------------------------------------------------------------------------------- text
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


# ---------------------------------------------------------------------------------------- logprobs
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


# ---------------------------------------------------------------------------------------- engine jobs
class Job:
    """The engine requests of one HTTP request, their outputs delivered to an asyncio queue as
    ``(choice index, RequestOutput)``."""

    def __init__(self, engine, choices: list[Choice]):
        self.engine, self.choices = engine, choices
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.added: list[Choice] = []

    def submit(self) -> None:
        """Add every choice's request to the engine; on a refusal the ones added are aborted.

        Raises:
            ApiError: 400 (the engine's ValueError), 429 (QueueFullError), 503 (shutting down).
        """
        for c in self.choices:
            def on_output(out: RequestOutput, i: int = c.index) -> None:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))
            try:
                self.engine.add_request(c.req, on_output)
            except QueueFullError as e:
                self.abort()
                raise ApiError(429, str(e)) from None
            except ValueError as e:
                self.abort()
                raise _engine_error(e) from None
            self.added.append(c)

    def abort(self) -> None:
        """Abort every added request that has not finished (thread-safe, idempotent)."""
        for c in self.added:
            if not c.finished:
                self.engine.abort(c.req.request_id)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def next(self, timeout: float) -> Choice:
        """Wait at most ``timeout`` s for the next output; returns its choice (the output taken).
        Raises TimeoutError."""
        i, out = await asyncio.wait_for(self.queue.get(), timeout=max(timeout, 0.0) if math.isfinite(timeout) else None)
        c = self.choices[i]
        c.add(out)
        return c


def _check_aborted(app: FastAPI, job: Job) -> None:
    """Raise 503 / 500 when the engine ended a choice with ``abort`` (shutdown or a failed step)."""
    if any(c.finish_reason == "abort" for c in job.choices):
        job.abort()
        if app.state.closing:
            raise ApiError(503, "the server is shutting down")
        raise ApiError(500, f"the engine ended the request: {getattr(job.engine, 'last_error', None) or 'aborted'}")


async def _collect(app: FastAPI, job: Job, request: Request, deadline: float) -> bool:
    """Wait until every choice finished. Returns False when the client disconnected (checked every
    :data:`POLL_S` s; its requests are aborted). Raises ApiError 504 past ``deadline`` (requests
    aborted), as :func:`_check_aborted`."""
    try:
        checked = time.monotonic()
        while not job.done:
            now = time.monotonic()
            if now >= deadline:
                raise ApiError(504, f"the request ran past the server's timeout of {app.state.request_timeout_s} s")
            if now - checked >= POLL_S:
                checked = now
                if await request.is_disconnected():
                    return False
            try:
                await job.next(min(POLL_S, deadline - now))
            except TimeoutError:
                pass
        _check_aborted(app, job)
        return True
    finally:
        job.abort()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict:
    completion = sum(c.usage_tokens() for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def _stream(app: FastAPI, job: Job, deadline: float, first: list[dict], chunk: Callable[[Choice], dict | None],
                  tail: Callable[[], list[dict]]) -> AsyncIterator[str]:
    """Server-sent events: ``first`` chunks, one chunk per output (``chunk(choice)``; None: nothing
    to send yet), ``tail()`` chunks, then ``[DONE]``. A timeout or an engine abort is sent as an
    error event; the requests are aborted whenever the stream ends (a client gone included: the
    server cancels the stream)."""
    try:
        for obj in first:
            yield _sse(obj)
        while not job.done:
            left = deadline - time.monotonic()
            try:
                c = await job.next(left)
            except TimeoutError:
                err = ApiError(504, f"the request ran past the server's timeout of {app.state.request_timeout_s} s")
                yield _sse({"error": _error_body(err)})
                break
            if c.finish_reason == "abort":
                try:
                    _check_aborted(app, job)
                except ApiError as err:
                    yield _sse({"error": _error_body(err)})
                break
            obj = chunk(c)
            if obj is not None:
                yield _sse(obj)
        else:
            for obj in tail():
                yield _sse(obj)
        yield "data: [DONE]\n\n"
    finally:
        job.abort()


def _error_body(e: ApiError) -> dict:
    return {"message": e.message, "type": ERROR_TYPES.get(e.status, "invalid_request_error"), "param": e.param, "code": e.status}


# ---------------------------------------------------------------------------------------- app
def build_app(engine, text, model_name: str, *, request_timeout_s: float | None = 600.0) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`mff.serve.engine.Engine`, started by the
    caller, who also shuts it down) as ``model_name``.

    ``text``: the checkpoint's :class:`mff.ckpt.tokenizer_files.TextAssets` (``tokenizer`` not
    None). ``request_timeout_s``: a request still generating after this many seconds is aborted
    (504; None: no limit). Set ``app.state.closing = True`` when the server starts shutting down:
    new requests then get 503 (the app's lifespan shutdown sets it too).

    Raises:
        ValueError: ``text`` has no tokenizer, an empty ``model_name``, a ``request_timeout_s`` <= 0.
    """
    if text.tokenizer is None:
        raise ValueError("build_app: the checkpoint has no tokenizer (TextAssets.tokenizer is None)")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"build_app: model_name {model_name!r} must be a non-empty string")
    if request_timeout_s is not None and not (0 < request_timeout_s < math.inf):
        raise ValueError(f"build_app: request_timeout_s {request_timeout_s!r} must be a finite number > 0 (or None)")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.closing = True

    app = FastAPI(title="mff", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.codec, app.state.model_name = engine, Codec(text, engine.vocab_size), model_name
    app.state.request_timeout_s, app.state.closing, app.state.created = request_timeout_s, False, int(time.time())
    _install_error_handlers(app)
    _install_info_routes(app)
    _install_token_routes(app)
    _install_completions(app)
    _install_chat(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        err = validation_error(e.errors())
        return error_response(err.status, err.message, err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(e.status_code, message)


async def parse_body(request: Request, model: type[BaseModel]):
    """The request body validated as ``model``. Raises a 400 ApiError naming the first bad field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _start(app: FastAPI, model: str | None) -> float:
    """Refuse while closing (503) and another model name (404); returns the request's deadline."""
    if app.state.closing:
        raise ApiError(503, "the server is shutting down")
    if model is not None and model != app.state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {app.state.model_name!r}", "model")
    t = app.state.request_timeout_s
    return time.monotonic() + (t if t is not None else math.inf)


def _install_info_routes(app: FastAPI) -> None:
    def card() -> dict:
        return {"id": app.state.model_name, "object": "model", "created": app.state.created, "owned_by": "mff",
                "root": app.state.model_name, "max_model_len": app.state.engine.max_model_len}

    @app.get("/health")
    async def health():
        """200 while serving, 503 while shutting down."""
        if app.state.closing:
            raise ApiError(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != app.state.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {app.state.model_name!r}", "model")
        return card()

    @app.get("/metrics")
    async def metrics(format: str = "prometheus"):
        """Engine metrics: the Prometheus text format (default) or ``?format=json``."""
        m = app.state.engine.metrics()
        if format == "json":
            return m
        if format != "prometheus":
            raise ApiError(400, f"format={format!r}: expected prometheus or json", "format")
        return PlainTextResponse(prometheus_text(m), media_type="text/plain; version=0.0.4")


_COUNTERS = {"generated_tokens", "prefix_cache_hit_tokens", "preemptions", "steps"}


def prometheus_text(metrics: dict) -> str:
    """``metrics`` (name -> number) in the Prometheus exposition format: ``mff_serve_<name>``
    gauges, and counters (``_total``) for the running totals."""
    lines = []
    for k, v in metrics.items():
        name = f"mff_serve_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}"
        kind = "counter" if k in _COUNTERS else "gauge"
        if kind == "counter":
            name += "_total"
        lines += [f"# TYPE {name} {kind}", f"{name} {float(v)!r}"]
    return "\n".join(lines) + "\n"


def _install_token_routes(app: FastAPI) -> None:
    codec: Codec = app.state.codec

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        body = await parse_body(request, TokenizeRequest)
        _start(app, body.model)
        if body.prompt is not None:
            ids = codec.encode(body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
        else:
            rendered = codec.render_chat([m.for_template() for m in body.messages], body.add_generation_prompt)
            ids = codec.encode(rendered, bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": app.state.engine.max_model_len, "tokens": ids,
                "token_strs": [codec.token_str(i) for i in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens kept); ids the tokenizer does not know are a 400."""
        body = await parse_body(request, DetokenizeRequest)
        _start(app, body.model)
        unknown = next((t for t in body.tokens if t >= codec.size or codec.tokenizer.id_to_token(t) is None), None)
        if unknown is not None:
            raise ApiError(400, f"tokens: id {unknown} is not in the tokenizer's vocabulary of {codec.size} tokens", "tokens")
        return {"prompt": codec.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        t = codec.text
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token, "eos_token": t.eos_token,
                "pad_token": getattr(t, "pad_token", None), "eos_token_ids": list(t.eos_ids), "chat_template": t.chat_template,
                "vocab_size": codec.size, "model_max_length": app.state.engine.max_model_len}


# ---------------------------------------------------------------------------------------- completions
def _completion_prompts(body: CompletionRequest, codec: Codec) -> list[tuple[list[int], str]]:
    """``(ids, prompt text)`` per prompt. Raises a 400 ApiError for an empty prompt or ids outside the vocabulary."""
    out = []
    prompts = body.prompts()
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={body.n} = {len(prompts) * body.n} choices; at most {MAX_CHOICES} per request",
                       "prompt")
    for p, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        if isinstance(prompt, str):
            ids = codec.encode(prompt)
            if not ids:
                raise ApiError(400, f"{where} encodes to no tokens; give a non-empty prompt", "prompt")
            out.append((ids, prompt))
        else:
            codec.check_ids(prompt, where)
            out.append((list(prompt), codec.decode(prompt, skip_special_tokens=False)))
    return out


def _choices(app: FastAPI, rid: str, prompts: list[tuple[list[int], str]], body, max_tokens: Callable[[int, int], int], *,
             logprobs: int | None, prompt_logprobs: int | None) -> list[Choice]:
    """The choices of all prompts (index ``p * n + i``), their engine requests built."""
    codec: Codec = app.state.codec
    stops = stop_strings(body.stop)
    if body.stop_token_ids:
        codec.check_ids(body.stop_token_ids, "stop_token_ids")
    out = []
    for p, (ids, ptext) in enumerate(prompts):
        try:
            reqs = engine_requests(f"{rid}-{p}", ids, max_tokens(p, len(ids)), body, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                   stop_check=(lambda: StopCheck(codec, stops)) if stops else (lambda: None))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        out += [Choice(len(out) + i, r, codec.text.eos_ids, stops, ptext) for i, r in enumerate(reqs)]
    return out


def _install_completions(app: FastAPI) -> None:
    codec: Codec = app.state.codec

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        deadline = _start(app, body.model)
        prompts = _completion_prompts(body, codec)
        max_len = app.state.engine.max_model_len

        def limit(p: int, n: int) -> int:
            try:
                return check_context(n, body.max_tokens, max_len, "the prompt" if len(prompts) == 1 else f"prompt[{p}]")
            except ValueError as e:
                raise ApiError(400, str(e), "prompt" if n >= max_len else "max_tokens") from None

        lp = body.logprobs
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = _choices(app, rid, prompts, body, limit, logprobs=lp,
                           prompt_logprobs=lp if body.echo and lp is not None else None)
        job = Job(app.state.engine, choices)
        job.submit()
        head = {"id": rid, "object": "text_completion", "created": created, "model": app.state.model_name}
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if body.stream:
            return StreamingResponse(_stream(app, job, deadline, [], lambda c: _completion_chunk(head, codec, body, c, job, prompt_tokens),
                                             lambda: _usage_tail(head, body, prompt_tokens, job)), media_type="text/event-stream")
        if not await _collect(app, job, request, deadline):
            return Response(status_code=499)
        return JSONResponse(dict(head, choices=[_completion_choice(codec, body, c) for c in choices], usage=_usage(prompt_tokens, choices)))


def _completion_choice(codec: Codec, body: CompletionRequest, c: Choice) -> dict:
    """One finished choice of a non-streaming completion."""
    text, _ = c.text(codec)
    logprobs = None
    if body.logprobs is not None:
        ids, entries = list(c.ids), list(c.logprobs)
        if body.echo:
            ids, entries = list(c.req.prompt_ids) + ids, list(c.prompt_logprobs or [None] * len(c.req.prompt_ids)) + entries
        logprobs = completion_logprobs(codec, ids, entries)
    return {"index": c.index, "text": (c.prompt_text if body.echo else "") + text, "logprobs": logprobs,
            "finish_reason": c.final_reason(codec), "stop_reason": None}


def _completion_chunk(head: dict, codec: Codec, body: CompletionRequest, c: Choice, job: Job, prompt_tokens: int) -> dict | None:
    """The chunk for choice ``c`` after an output (None: nothing to send yet)."""
    text, ids, entries = "", [], []
    if body.echo and not c.started:
        text, ids = c.prompt_text, list(c.req.prompt_ids)
        entries = list(c.prompt_logprobs or [None] * len(ids))
    c.started = True
    text += c.delta(codec)
    if body.logprobs is not None:
        new = c.logprobs[c.sent_logprobs:]
        c.sent_logprobs = len(c.logprobs)
        ids, entries = ids + c.ids[len(c.ids) - len(new):], entries + list(new)
    if not text and not ids and not c.finished:
        return None
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(codec, ids, entries, c.offset)
        c.offset += sum(len(t) for t in logprobs["tokens"])
    choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.final_reason(codec) if c.finished else None,
              "stop_reason": None}
    out = dict(head, choices=[choice])
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        out["usage"] = _usage(prompt_tokens, job.choices)
    return out


def _usage_tail(head: dict, body, prompt_tokens: int, job: Job) -> list[dict]:
    """The last chunk with ``usage`` when ``stream_options.include_usage``."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return []
    return [dict(head, choices=[], usage=_usage(prompt_tokens, job.choices))]


# ---------------------------------------------------------------------------------------- chat
def _install_chat(app: FastAPI) -> None:
    codec: Codec = app.state.codec

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body: ChatRequest = await parse_body(request, ChatRequest)
        deadline = _start(app, body.model)
        rendered = codec.render_chat(body.template_messages(), body.add_generation_prompt)
        ids = codec.encode(rendered, add_special_tokens=False)
        if not ids:
            raise ApiError(400, "messages render to an empty prompt", "messages")
        max_len = app.state.engine.max_model_len

        def limit(p: int, n: int) -> int:
            try:
                return check_context(n, body.token_limit(), max_len, "the rendered messages")
            except ValueError as e:
                limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
                raise ApiError(400, str(e), "messages" if n >= max_len else limit_field) from None

        k = (body.top_logprobs or 0) if body.logprobs else None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = _choices(app, rid, [(ids, rendered)], body, limit, logprobs=k, prompt_logprobs=None)
        job = Job(app.state.engine, choices)
        job.submit()
        if body.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": app.state.model_name}
            first = [dict(head, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None}]) for c in choices]
            return StreamingResponse(_stream(app, job, deadline, first, lambda c: _chat_chunk(head, codec, body, c, job, len(ids)),
                                             lambda: _usage_tail(head, body, len(ids), job)), media_type="text/event-stream")
        if not await _collect(app, job, request, deadline):
            return Response(status_code=499)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": app.state.model_name}
        return JSONResponse(dict(head, choices=[_chat_choice(codec, body, c) for c in choices], usage=_usage(len(ids), choices)))


def _chat_choice(codec: Codec, body: ChatRequest, c: Choice) -> dict:
    text, _ = c.text(codec)
    return {"index": c.index, "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(codec, c.logprobs) if body.logprobs else None, "finish_reason": c.final_reason(codec),
            "stop_reason": None}


def _chat_chunk(head: dict, codec: Codec, body: ChatRequest, c: Choice, job: Job, prompt_tokens: int) -> dict | None:
    text = c.delta(codec)
    new = []
    if body.logprobs:
        new = c.logprobs[c.sent_logprobs:]
        c.sent_logprobs = len(c.logprobs)
    if not text and not new and not c.finished:
        return None
    choice = {"index": c.index, "delta": {"content": text} if text else {},
              "logprobs": chat_logprobs(codec, new) if body.logprobs else None,
              "finish_reason": c.final_reason(codec) if c.finished else None, "stop_reason": None}
    out = dict(head, choices=[choice])
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        out["usage"] = _usage(prompt_tokens, job.choices)
    return out
