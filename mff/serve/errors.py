"""OpenAI-style error objects of the HTTP layer, and the 400 messages of validation errors.

An error is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``;
a pydantic / FastAPI validation error becomes a 400 whose message names the field (``messages[0].content``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from fastapi.responses import JSONResponse

__all__ = ["ApiError", "ERROR_TYPES", "error_response", "validation_error", "engine_error"]

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_error", 503: "service_unavailable", 504: "timeout_error"}
class ApiError(Exception):
    """An HTTP error with an OpenAI error object: ``status``, ``message``, the request field ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status`` (``code`` is the status)."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


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


def engine_error(e: ValueError) -> ApiError:
    """An engine ``ValueError`` (its message starts with the field it names) as an ApiError."""
    text = str(e)
    if "shutting down" in text:
        return ApiError(503, "the server is shutting down")
    if "cache blocks" in text:  # the prompt + max_tokens do not fit the KV cache
        return ApiError(400, text, "max_tokens")
    m = _FIELD.match(text)
    return ApiError(400, text, m.group(1) if m and m.group(1) not in ("the",) else None)
