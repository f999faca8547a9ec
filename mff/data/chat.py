"""Chat templates: rendering a conversation to the prompt text a chat model was trained on.

A chat template is a Jinja2 template shipped with a model (``chat_template`` in HF's
``tokenizer_config.json``, ``tokenizer.chat_template`` in a GGUF file). It is rendered with
``messages`` (a list of ``{"role": ..., "content": ...}`` dicts), ``add_generation_prompt`` and
any extra variables (``bos_token``, ``eos_token``, ``tools``, ...).

The rendering environment follows HF's chat templating docs
(https://huggingface.co/docs/transformers/main/en/chat_templating and its "writing templates"
page): a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape, and the globals
``raise_exception(message)`` and ``strftime_now(format)``. The ``{% generation %}`` block some
templates use to mark assistant text renders its body unchanged here.

A template is rendered in :class:`mff.data.jinja_sandbox.BoundedSandbox`: it cannot reach Python
internals, and a render stops with one error line past 4,000,000 rendered characters,
1,000,000 loop iterations, 1,000,000 calls or 10 s (the module's limits).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from mff.data.jinja_sandbox import BoundedSandbox, TemplateRenderError, render_bounded, syntax_message

__all__ = ["render_chat_template", "read_chat_template_file", "TemplateRenderError"]


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         what: str = "the chat template", **kwargs: Any) -> str:
    """Render a chat template for `messages`, the way HF's ``apply_chat_template(tokenize=False)`` does.

    Args:
        template: the Jinja2 chat template source.
        messages: the conversation, a list of dicts with at least ``role`` and ``content``.
        add_generation_prompt: append the text that opens the assistant's turn (templates read
            the ``add_generation_prompt`` variable).
        what: the template's name in an error, e.g. ``"the chat template of run/tokenizer_config.json"``.
        **kwargs: further template variables, e.g. ``bos_token``, ``eos_token``, ``tools``.

    Returns:
        The rendered prompt text (not tokenized; special tokens appear as text).

    Raises:
        TemplateRenderError: (a ValueError) one line naming ``what`` and the reason: the template
            does not parse, called ``raise_exception(message)`` (the message is the template's),
            tried something the sandbox forbids, went past a limit of
            :mod:`mff.data.jinja_sandbox`, or its expressions raised.
        TypeError: `messages` is not a list.
    """
    if not isinstance(messages, list):
        raise TypeError(f"render_chat_template: messages must be a list of dicts, got {type(messages).__name__}")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateRenderError(syntax_message(e, what)) from None
    return render_bounded(compiled, dict(kwargs, messages=messages, add_generation_prompt=add_generation_prompt), what)


@lru_cache(maxsize=16)
def _compile(template: str):
    """The compiled template. Raises jinja2.TemplateSyntaxError when it does not parse."""
    from jinja2.ext import Extension

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _Generation])
    env.set_tojson(tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.compile_bounded(template)


def read_chat_template_file(path: str | os.PathLike, flag: str = "--chat-template") -> str:
    """The text of a Jinja chat template file given as ``flag``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a file, not UTF-8 text, or empty (the message names it).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {p} is not a file (a Jinja chat template file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {p} is not UTF-8 text: {e}") from None
    if not text.strip():
        raise ValueError(f"{flag} {p} is empty")
    return text
