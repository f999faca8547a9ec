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

The pieces: :mod:`mff.serve.protocol` (request bodies), :mod:`mff.serve.errors` (error objects),
:mod:`mff.serve.text` (tokenizer, stop strings, streamed text), :mod:`mff.serve.logprobs`
(log-probability shapes); this module holds the routes and the engine jobs.

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
from starlette.requests import ClientDisconnect

from mff.serve.errors import ERROR_TYPES, ApiError, engine_error, error_response, validation_error
from mff.serve.logprobs import chat_logprobs, completion_logprobs
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
from mff.serve.request import QueueFullError, RequestOutput
from mff.serve.text import Choice, Codec, StopCheck

__all__ = ["build_app", "prometheus_text"]

POLL_S = 0.5
"""How often a non-streaming request checks that its client is still connected."""


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
        """Add every choice's request to the engine, all or none (:meth:`Engine.add_requests`).

        Raises:
            ApiError: 400 (the engine's ValueError), 429 (QueueFullError), 503 (shutting down).
        """
        def sink(i: int) -> Callable[[RequestOutput], None]:
            return lambda out: self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))

        try:
            self.engine.add_requests([(c.req, sink(c.index)) for c in self.choices])
        except QueueFullError as e:
            raise ApiError(429, str(e)) from None
        except ValueError as e:
            raise engine_error(e) from None
        self.added = list(self.choices)

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
def build_app(engine, text, model_name: str, *, request_timeout_s: float | None = 600.0,
              max_body_bytes: int = 32_000_000) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`mff.serve.engine.Engine`, started by the
    caller, who also shuts it down) as ``model_name``.

    ``text``: the checkpoint's :class:`mff.ckpt.tokenizer_files.TextAssets` (``tokenizer`` not
    None). ``request_timeout_s``: a request still generating after this many seconds is aborted
    (504; None: no limit). ``max_body_bytes``: a larger request body gets 413. Set
    ``app.state.closing = True`` when the server starts shutting down: new requests then get 503
    (the app's lifespan shutdown sets it too).

    Raises:
        ValueError: ``text`` has no tokenizer, an empty ``model_name``, a ``request_timeout_s`` <= 0,
            a ``max_body_bytes`` < 1.
    """
    if text.tokenizer is None:
        raise ValueError("build_app: the checkpoint has no tokenizer (TextAssets.tokenizer is None)")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"build_app: model_name {model_name!r} must be a non-empty string")
    if request_timeout_s is not None and not (0 < request_timeout_s < math.inf):
        raise ValueError(f"build_app: request_timeout_s {request_timeout_s!r} must be a finite number > 0 (or None)")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"build_app: max_body_bytes {max_body_bytes!r} must be an int >= 1")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.closing = True

    app = FastAPI(title="mff", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.codec, app.state.model_name = engine, Codec(text, engine.vocab_size), model_name
    app.state.request_timeout_s, app.state.closing, app.state.created = request_timeout_s, False, int(time.time())
    app.state.max_body_bytes = max_body_bytes
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
        response = error_response(e.status_code, message)
        response.headers.update(e.headers or {})  # 405's Allow
        return response


OFF_LOOP_BYTES = 64_000
"""Bodies (and texts) larger than this are parsed and tokenized on a worker thread, so that a big
request does not hold up the event loop (other streams, /health)."""


async def parse_body(request: Request, model: type[BaseModel]):
    """The request body validated as ``model``.

    Raises:
        ApiError: 413 for a body over ``app.state.max_body_bytes`` (by its Content-Length, or
            counted while reading), 400 naming the first bad field, 400 when the client went
            away before sending the whole body.
    """
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {int(declared)} bytes is larger than the server's limit of {limit} bytes (--max-body-mb)")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than the server's limit of {limit} bytes (--max-body-mb)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected before sending the whole request body") from None
    raw = b"".join(chunks)
    try:
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(model.model_validate_json, raw)
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def _off_loop(request: Request, fn: Callable, *args):
    """``fn(*args)``, on a worker thread when the request body is large (:data:`OFF_LOOP_BYTES`)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


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
_HELP = {
    "running": "Requests running (holding cache blocks).",
    "waiting": "Requests waiting to be scheduled.",
    "blocks_total": "KV-cache blocks in the pool.",
    "blocks_used": "KV-cache blocks held by requests.",
    "cache_tokens_per_block": "Tokens per KV-cache block.",
    "cache_bytes_per_token": "KV-cache bytes per token over all layers.",
    "prefix_cache_hit_tokens": "Prompt tokens served from reused prefix blocks.",
    "preemptions": "Requests preempted (recomputed later) for lack of cache blocks.",
    "generated_tokens": "Tokens generated.",
    "tokens_per_s": "Tokens generated per second over the last 10 s.",
    "ttft_s_p50": "Median time to first token, seconds (last 1000 requests).",
    "ttft_s_p99": "99th percentile time to first token, seconds (last 1000 requests).",
    "steps": "Engine steps (packed forwards).",
}


def prometheus_text(metrics: dict) -> str:
    """``metrics`` (name -> number) in the Prometheus exposition format: ``mff_serve_<name>``
    gauges, and counters (``_total``) for the running totals, each with ``# HELP`` and ``# TYPE``."""
    lines = []
    for k, v in metrics.items():
        name = f"mff_serve_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}"
        kind = "counter" if k in _COUNTERS else "gauge"
        if kind == "counter":
            name += "_total"
        lines += [f"# HELP {name} {_HELP.get(k, k)}", f"# TYPE {name} {kind}", f"{name} {float(v)!r}"]
    return "\n".join(lines) + "\n"


def _install_token_routes(app: FastAPI) -> None:
    codec: Codec = app.state.codec

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        body = await parse_body(request, TokenizeRequest)
        _start(app, body.model)

        def work() -> dict:
            if body.prompt is not None:
                ids = codec.encode(body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
            else:
                rendered = codec.render_chat([m.for_template() for m in body.messages], body.add_generation_prompt)
                ids = codec.encode(rendered, bool(body.add_special_tokens))
            return {"count": len(ids), "max_model_len": app.state.engine.max_model_len, "tokens": ids,
                    "token_strs": [codec.token_str(i) for i in ids] if body.return_token_strs else None}

        return JSONResponse(await _off_loop(request, work))

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
        prompts = await _off_loop(request, _completion_prompts, body, codec)
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
        # on a worker thread: echo with logprobs can make a response of many MB
        return await asyncio.to_thread(lambda: JSONResponse(dict(head, choices=[_completion_choice(codec, body, c) for c in choices],
                                                                  usage=_usage(prompt_tokens, choices))))


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
            "finish_reason": c.final_reason(codec), "stop_reason": c.stop_reason(codec)}


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
              "stop_reason": c.stop_reason(codec)}
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

        def render() -> tuple[str, list[int]]:
            text = codec.render_chat(body.template_messages(), body.add_generation_prompt)
            return text, codec.encode(text, add_special_tokens=False)

        rendered, ids = await _off_loop(request, render)
        if not ids:
            raise ApiError(400, "messages render to an empty prompt", "messages")
        max_len = app.state.engine.max_model_len

        def limit(p: int, n: int) -> int:
            try:
                return check_context(n, body.token_limit(), max_len, "the rendered conversation")
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
        return await asyncio.to_thread(lambda: JSONResponse(dict(head, choices=[_chat_choice(codec, body, c) for c in choices],
                                                                  usage=_usage(len(ids), choices))))


def _chat_choice(codec: Codec, body: ChatRequest, c: Choice) -> dict:
    text, _ = c.text(codec)
    return {"index": c.index, "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(codec, c.logprobs) if body.logprobs else None, "finish_reason": c.final_reason(codec),
            "stop_reason": c.stop_reason(codec)}


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
              "finish_reason": c.final_reason(codec) if c.finished else None, "stop_reason": c.stop_reason(codec)}
    out = dict(head, choices=[choice])
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        out["usage"] = _usage(prompt_tokens, job.choices)
    return out
