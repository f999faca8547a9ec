"""A bounded Jinja2 sandbox: templates that come with a file (chat templates, task files) can
neither escape nor exhaust memory or time.

Jinja2's ``ImmutableSandboxedEnvironment`` already refuses unsafe attribute access (``__class__``,
``mro``, ...), mutation of containers and ``range`` longer than 100,000 items. A template can
still loop (nested loops, recursive macros) or multiply strings until the machine runs out of
memory or time. :class:`BoundedSandbox` adds, per render (the limits are module constants):

- the rendered text is at most :data:`MAX_RENDERED_CHARS` characters;
- all ``{% for %}`` loops together run at most :data:`MAX_LOOP_ITERATIONS` iterations;
- at most :data:`MAX_CALLS` calls (macros, filters' callables, methods);
- no value (string or list) made by an expression, a filter or a call is longer than
  :data:`MAX_RENDERED_CHARS`; the operations that multiply sizes (``*``, ``%`` and
  ``str.format`` widths, ``replace``, ``join``, ``center``/``ljust``/``rjust``/``zfill``,
  ``expandtabs``, the ``format``, ``center`` and ``indent`` filters) are refused before they
  run, the others (``~``, ``+``, every filter and call) checked on their result, so a template
  cannot double a string until memory runs out; ``**`` makes at most :data:`MAX_POWER_BITS` bits;
- the render stops after :data:`MAX_RENDER_SECONDS` seconds of wall-clock time (checked at every
  loop iteration, call and piece of output).

Past a limit the render raises :class:`TemplateLimitError` (a ``jinja2.TemplateError``) that
names the limit. :func:`render_bounded` turns every failure of a render (the template's own
``raise_exception``, the sandbox's ``SecurityError``, a limit, an error in the template's
expressions) into :class:`TemplateRenderError`, a ``ValueError`` with one line.

The guards are put in at parse time: every ``For`` node's iterable goes through the filter
``mff_guard_loop`` and every ``~``, ``+``, filter and call through ``mff_guard_size`` (filters are
the environment's: a template cannot rebind them, and naming them itself only adds checks).
"""

from __future__ import annotations

import contextvars
import re
import time
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "MAX_RENDERED_CHARS", "MAX_LOOP_ITERATIONS", "MAX_CALLS", "MAX_RENDER_SECONDS", "MAX_POWER_BITS",
    "BoundedSandbox", "TemplateLimitError", "TemplateRenderError", "render_bounded", "syntax_message",
]

MAX_RENDERED_CHARS = 4_000_000
"""Most characters a render may produce (about a million tokens: past any context mff trains or decodes)."""
MAX_LOOP_ITERATIONS = 1_000_000
"""Most ``{% for %}`` iterations per render, all loops together."""
MAX_CALLS = 1_000_000
"""Most calls (macros, methods, callables) per render."""
MAX_RENDER_SECONDS = 10.0
"""Most wall-clock seconds per render."""
MAX_POWER_BITS = 4096
"""Largest integer ``**`` may make, in bits."""

_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)(?:\.(\d+))?")
_NUMBER = re.compile(r"\d+")
_GROWING_FILTERS = ("format", "center", "indent")


def _too_long(n: int, what: str):
    if n > MAX_RENDERED_CHARS:
        raise TemplateLimitError(f"{what} would make {n:,} characters, past {MAX_RENDERED_CHARS:,}")


def _int(x) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict):
    """Refuse a ``str`` method call whose result would pass the size limit (estimated before it runs)."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _too_long(_int(args[0]), f"str.{name}({args[0]})")
    elif name == "expandtabs":
        size = _int(args[0] if args else kwargs.get("tabsize", 8))
        _too_long(len(s) + s.count("\t") * size, f"str.expandtabs({size})")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        hits = len(s) + 1 if not old else s.count(old)
        if len(args) > 2 and _int(args[2]) >= 0:
            hits = min(hits, _int(args[2]))
        _too_long(len(s) + hits * max(0, len(new) - len(old)), "str.replace")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        items = args[0]
        _too_long(len(s) * max(0, len(items) - 1) + sum(len(x) for x in items if isinstance(x, str)), "str.join")
    elif name in ("format", "format_map"):
        import string

        specs = [spec for _, _, spec, _ in string.Formatter().parse(s) if spec]
        numbers = [int(n) for spec in specs for n in _NUMBER.findall(spec)]
        if any("{" in spec for spec in specs):  # a width given as an argument
            numbers += [_int(a) for a in (*args, *kwargs.values())]
        if numbers:
            _too_long(max(numbers), f"str.{name} width {max(numbers)}")


def _check_percent(fmt: str):
    widths = [int(w) for m in _FORMAT_WIDTH.finditer(fmt) for w in m.groups() if w]
    if widths:
        _too_long(max(widths), f"format width {max(widths)}")


class _Budget:
    """What one render has used so far."""

    __slots__ = ("loops", "calls", "deadline")

    def __init__(self):
        self.loops = 0
        self.calls = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick_time(self):
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the render ran past {MAX_RENDER_SECONDS:g} s")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("mff_template_budget", default=None)


class TemplateLimitError(jinja2.TemplateError):
    """A render went past one of the limits of :mod:`mff.data.jinja_sandbox`."""


class TemplateRenderError(ValueError):
    """A template that does not parse or does not render (the reason in the message)."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the per-render limits of this module."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                    raise TemplateLimitError(f"{type(seq).__name__} of length {len(seq)} * {n} passes {MAX_RENDERED_CHARS:,} items")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if abs(left).bit_length() * right > MAX_POWER_BITS:
                    raise TemplateLimitError(f"{left} ** {right} passes {MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left)
        return self.guard_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        budget = _budget.get()
        if budget is not None:
            budget.calls += 1
            if budget.calls > MAX_CALLS:
                raise TemplateLimitError(f"the render made more than {MAX_CALLS:,} calls")
            budget.tick_time()
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        if isinstance(getattr(method, "__self__", None), str):
            _check_str_method(method.__self__, method.__name__, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def guard_size(self, value):
        """``value``, refused when it is a string or list longer than :data:`MAX_RENDERED_CHARS`."""
        if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDERED_CHARS:
            raise TemplateLimitError(f"a {type(value).__name__} of {len(value):,} items passes {MAX_RENDERED_CHARS:,}")
        return value

    def guard_loop(self, iterable):
        """``iterable``, counting every item against the render's loop budget."""
        budget = _budget.get()
        if budget is None:
            yield from iterable
            return
        for item in iterable:
            budget.loops += 1
            if budget.loops > MAX_LOOP_ITERATIONS:
                raise TemplateLimitError(f"the loops ran more than {MAX_LOOP_ITERATIONS:,} iterations")
            budget.tick_time()
            yield item

    def compile_bounded(self, source: str):
        """The template of ``source`` with every loop guarded.

        Raises:
            jinja2.TemplateSyntaxError: ``source`` does not parse.
        """
        tree = self.parse(source)
        nodes = jinja2.nodes
        for node in list(tree.find_all(nodes.Node)):
            if isinstance(node, (nodes.FilterBlock, nodes.AssignBlock, nodes.CallBlock)):
                continue  # their filter / call field is not an expression
            for field, child in node.iter_fields():
                if _sized(child):
                    setattr(node, field, _guarded("guard_size", child))
                elif isinstance(child, list):
                    child[:] = [_guarded("guard_size", c) if _sized(c) else c for c in child]
        for node in tree.find_all(nodes.For):
            node.iter = _guarded("guard_loop", node.iter)
        return self.from_string(tree)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in _GROWING_FILTERS:
            self.filters[name] = _checked_filter(name, self.filters[name])
        self.filters["mff_guard_size"] = self.guard_size
        self.filters["mff_guard_loop"] = self.guard_loop


def _sized(node) -> bool:
    """Whether ``node`` is an expression whose result :meth:`BoundedSandbox.guard_size` checks: ``~``,
    ``+``, a call, or a filter applied to a value (not the filter of a ``{% filter %}`` block)."""
    nodes = jinja2.nodes
    if isinstance(node, nodes.Filter):
        return node.node is not None
    return isinstance(node, (nodes.Concat, nodes.Add, nodes.Call))


def _guarded(method: str, node):
    """``node | mff_<method>`` as a jinja2 expression node: a filter, which the compiled template calls
    directly (a call node would go through the sandbox's ``call`` on every use)."""
    return jinja2.nodes.Filter(node, f"mff_{method}", [], [], None, None, lineno=node.lineno)


def _checked_filter(name: str, f):
    """The filter ``f`` with its result size estimated before it runs (``format``, ``center``, ``indent``)."""
    import functools

    @functools.wraps(f)
    def checked(value, *args, **kwargs):
        if name == "format" and isinstance(value, str):
            _check_percent(value)
        elif name == "center":
            _too_long(_int(args[0] if args else kwargs.get("width", 80)), f"center({args[0] if args else ''})")
        elif name == "indent" and isinstance(value, str):
            width = args[0] if args else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else _int(width)
            _too_long(len(value) + (value.count("\n") + 1) * width, f"indent({width})")
        return f(value, *args, **kwargs)

    return checked


def syntax_message(e: jinja2.TemplateSyntaxError, what: str) -> str:
    """The one-line error for a template ``what`` that does not parse."""
    return f"{what} does not parse (line {e.lineno}): {e.message}"


def render_bounded(template, variables: dict[str, Any], what: str) -> str:
    """Render a template compiled by :meth:`BoundedSandbox.compile_bounded` within this module's limits.

    Args:
        template: a ``jinja2.Template`` from ``BoundedSandbox.compile_bounded``.
        variables: the template's variables.
        what: how to name the template in an error, e.g. ``"the chat template of model/tokenizer_config.json"``.

    Returns:
        The rendered text (at most :data:`MAX_RENDERED_CHARS` characters).

    Raises:
        TemplateRenderError: ``what`` and the reason on one line: the template's own
            ``raise_exception(message)``, a sandbox ``SecurityError``, a limit of this module, or
            an error its expressions raised (``ZeroDivisionError``, ``KeyError``, runaway recursion, ...).
    """
    budget = _Budget()
    token = _budget.set(budget)
    try:
        pieces, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            if n > MAX_RENDERED_CHARS:
                raise TemplateLimitError(f"the rendered text passes {MAX_RENDERED_CHARS:,} characters")
            budget.tick_time()
            pieces.append(piece)
        return "".join(pieces)
    except TemplateLimitError as e:
        raise TemplateRenderError(f"{what} went past a limit: {e} (see mff.data.jinja_sandbox)") from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateRenderError(f"{what} tried something the sandbox forbids: {e}") from None
    except jinja2.TemplateError as e:
        raise TemplateRenderError(f"{what} raised an error: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError) as e:
        raise TemplateRenderError(f"{what} fails: {type(e).__name__}: {e}") from None
    finally:
        _budget.reset(token)
