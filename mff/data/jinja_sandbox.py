"""A bounded Jinja2 sandbox: templates that come with a file (chat templates, task files) can
neither escape nor exhaust memory or time.

Jinja2's ``ImmutableSandboxedEnvironment`` already refuses unsafe attribute access (``__class__``,
``mro``, ...), mutation of containers and ``range`` longer than 100,000 items. A template can
still loop (nested loops, recursive macros), multiply strings, lists or integers, or nest a list in
itself until the machine runs out of memory or time. :class:`BoundedSandbox` adds, per render (the
limits are module constants):

- all text written, counted where it is written (the top level, a macro, a ``{% set %}`` or
  ``{% filter %}`` block, so text a macro makes and the caller writes again counts twice), is at
  most :data:`MAX_RENDERED_CHARS` characters;
- all ``{% for %}`` loops together run at most :data:`MAX_LOOP_ITERATIONS` iterations;
- at most :data:`MAX_CALLS` calls (macros, filters' callables, methods);
- no value made by an expression, a filter or a call is bigger than :data:`MAX_RENDERED_CHARS`:
  a string or bytes by its length, a list, tuple, dict, set or namespace by its items counted
  through every level (an item held twice counts twice, so a list nested in itself 40 times is
  refused at once) plus the characters of the strings it holds. The operations that multiply
  sizes are refused before they run: ``*`` (strings, bytes, lists, integers), ``%`` and
  ``str.format`` widths and precisions (also ones given as arguments), ``str.replace``,
  ``join``, ``translate``, ``center``/``ljust``/``rjust``/``zfill``, ``expandtabs``, and the
  filters ``format``, ``center``, ``indent``, ``replace``, ``join``, ``wordwrap``, ``batch``,
  ``slice``, ``sum``, ``tojson`` and the ``lipsum`` function; the rest is checked on its result;
  ``**`` and ``*`` make integers of at most :data:`MAX_POWER_BITS` bits; ``wordwrap`` copies at most
  :data:`MAX_TEXT_WORK` characters;
- the render stops after :data:`MAX_RENDER_SECONDS` seconds of wall-clock time (checked at every
  loop iteration, call and piece of output).

Past a limit the render raises :class:`TemplateLimitError` (a ``jinja2.TemplateError``) that
names the limit. :func:`render_bounded` turns every failure of a render (the template's own
``raise_exception``, the sandbox's ``SecurityError``, a limit, an error in the template's
expressions) into :class:`TemplateRenderError`, a ``ValueError`` with one line.

The guards are put in at parse time: every ``For`` node's iterable goes through the filter
``mff_guard_loop``, every ``~``, ``+``, filter, call and list, tuple or dict literal through
``mff_guard_size``, every written expression through ``mff_guard_output`` (filters are the
environment's: a template cannot rebind them, and naming them itself only adds checks). The guards
take the render context, so jinja2 never folds a guarded expression into a constant at compile
time, where no limit would apply (the optimizer is off for the same reason).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import re
import string
import time
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace

__all__ = [
    "MAX_RENDERED_CHARS", "MAX_LOOP_ITERATIONS", "MAX_CALLS", "MAX_RENDER_SECONDS", "MAX_POWER_BITS",
    "MAX_TEXT_WORK", "BoundedSandbox", "TemplateLimitError", "TemplateRenderError", "render_bounded",
    "syntax_message",
]

MAX_RENDERED_CHARS = 4_000_000
"""Most characters a render may write, and the most a value may hold (about a million tokens:
past any context mff trains or decodes)."""
MAX_LOOP_ITERATIONS = 1_000_000
"""Most ``{% for %}`` iterations per render, all loops together."""
MAX_CALLS = 1_000_000
"""Most calls (macros, methods, callables) per render."""
MAX_RENDER_SECONDS = 10.0
"""Most wall-clock seconds per render."""
MAX_POWER_BITS = 4096
"""Largest integer ``**`` or ``*`` may make, in bits."""
MAX_TEXT_WORK = 4_000_000_000
"""Most characters one ``wordwrap`` may copy (it is quadratic in the length of a long word: about a second)."""

_NUMBER = re.compile(r"\d+")
_TEXT = (str, bytes, bytearray)
_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)


def _too_long(n: int, what: str):
    if n > MAX_RENDERED_CHARS:
        raise TemplateLimitError(f"{what} would make {n:,} characters, past {MAX_RENDERED_CHARS:,}")


def _int(x) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _children(v) -> list:
    if isinstance(v, Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    return [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)


def _size(value, limit: int = MAX_RENDERED_CHARS) -> tuple[int, int]:
    """``(size, depth)`` of ``value``: its items counted through every level (an item held twice
    counted twice) plus the characters of the strings and bytes it holds, and how deep its
    containers nest. Each distinct container is visited once (so a list nested in itself 40 times
    costs 40 steps, not 2**40); a container that holds itself counts 1 there, as ``repr`` writes
    ``[...]``. Raises :class:`TemplateLimitError` as soon as a size passes ``limit``."""
    if isinstance(value, _TEXT):
        return len(value), 0
    if not isinstance(value, _CONTAINERS):
        return 0, 0
    done: dict[int, tuple[int, int]] = {}
    expanded: dict[int, list] = {}
    stack = [value]
    budget = _budget.get()
    while stack:
        v = stack[-1]
        key = id(v)
        if key in done:
            stack.pop()
            continue
        kids = expanded.get(key)
        if kids is None:
            kids = expanded[key] = _children(v)
            if budget is not None and len(expanded) % 65536 == 0:
                budget.tick_time()
            todo = [k for k in kids if isinstance(k, _CONTAINERS) and id(k) not in done and id(k) not in expanded]
            if todo:
                stack.extend(todo)
                continue
        stack.pop()
        size, depth = len(kids), 0
        for k in kids:
            if isinstance(k, _TEXT):
                size += len(k)
            elif isinstance(k, int):
                size += k.bit_length() * 30103 // 100000  # its decimal digits, less one
            elif isinstance(k, _CONTAINERS):
                ks, kd = done.get(id(k), (1, 0))
                size += ks
                depth = max(depth, kd)
        if size > limit:
            raise TemplateLimitError(f"a {type(value).__name__} holding more than {limit:,} items and characters")
        done[key] = (size, depth + 1)
    return done[id(value)]


def _materialized(iterable, what: str) -> list:
    """``iterable`` as a list, refused past :data:`MAX_RENDERED_CHARS` items (a generator is read once)."""
    items = list(itertools.islice(iter(iterable), MAX_RENDERED_CHARS + 1))
    if len(items) > MAX_RENDERED_CHARS:
        raise TemplateLimitError(f"{what} of more than {MAX_RENDERED_CHARS:,} items")
    return items


def _check_join(sep, items: list, what: str):
    _too_long(len(sep) * max(0, len(items) - 1) + _size(items)[0], what)


def _check_replace(s, old, new, count=None, what="replace"):
    if isinstance(s, _TEXT) and isinstance(old, _TEXT) and isinstance(new, _TEXT):
        hits = len(s) + 1 if not old else s.count(old)
        if count is not None and _int(count) >= 0:
            hits = min(hits, _int(count))
        _too_long(len(s) + hits * max(0, len(new) - len(old)), what)


def _check_text_method(s, name: str, args: tuple, kwargs: dict):
    """Refuse a ``str`` / ``bytes`` method call whose result would pass the size limit (estimated
    before it runs). ``str.format`` and ``format_map`` are checked by :class:`_BoundedFormatter`."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _too_long(_int(args[0]), f"{type(s).__name__}.{name}({args[0]})")
    elif name == "expandtabs":
        size = _int(args[0] if args else kwargs.get("tabsize", 8))
        _too_long(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * size, f"expandtabs({size})")
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, *args[:3], what=f"{type(s).__name__}.replace")
    elif name == "translate" and isinstance(s, str) and args and isinstance(args[0], (dict, list, tuple)):
        table = args[0].values() if isinstance(args[0], dict) else args[0]
        longest = max((len(v) for v in table if isinstance(v, str)), default=1)
        _too_long(len(s) * longest, "str.translate")


def _percent_numbers(fmt: str):
    """The widths and precisions (digit strings, or ``*``) of the %-conversions of ``fmt``, parsed as
    Python does: a ``%(key)`` mapping key may hold nested parentheses."""
    i, n = 0, len(fmt)
    while True:
        i = fmt.find("%", i)
        if i < 0 or i + 1 >= n:
            return
        i += 1
        if fmt[i] == "%":
            i += 1
            continue
        if fmt[i] == "(":
            depth = 0
            while i < n:
                depth += {"(": 1, ")": -1}.get(fmt[i], 0)
                i += 1
                if depth == 0:
                    break
        while i < n and fmt[i] in "-#0 +":
            i += 1
        for _ in range(2):  # width, then precision after a "."
            j = i
            if i < n and fmt[i] == "*":
                i += 1
            else:
                while i < n and fmt[i].isdigit():
                    i += 1
            if i > j:
                yield fmt[j:i]
            if i < n and fmt[i] == ".":
                i += 1
            else:
                break


def _check_percent(fmt, args=None):
    """Refuse ``fmt % args`` (a str or bytes ``fmt``) whose widths or precisions (``%999d``,
    ``%(a)999s``, ``%((a))999s``, ``%*s``) pass the limit."""
    if isinstance(fmt, (bytes, bytearray)):
        fmt = fmt.decode("latin-1")
    star = False
    for w in _percent_numbers(fmt):
        if w == "*":
            star = True
        else:
            _too_long(int(w), f"format width {w}")
    if star and isinstance(args, tuple):
        for a in args:
            _too_long(_int(a), f"format width {a} (from *)")


def _check_spec(spec: str):
    for n in _NUMBER.findall(spec):
        _too_long(int(n), f"str.format width {n}")


class _BoundedFormatter(SandboxedFormatter):
    """The sandbox's ``str.format`` with every format spec checked once its nested fields are filled in."""

    def format_field(self, value, format_spec: str):
        _check_spec(format_spec)
        return super().format_field(value, format_spec)


class _Budget:
    """What one render has used so far."""

    __slots__ = ("loops", "calls", "written", "deadline")

    def __init__(self):
        self.loops = 0
        self.calls = 0
        self.written = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick_time(self):
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the render ran past {MAX_RENDER_SECONDS:g} s")

    def write(self, n: int):
        self.written += n
        if self.written > MAX_RENDERED_CHARS:
            raise TemplateLimitError(f"the rendered text passes {MAX_RENDERED_CHARS:,} characters")
        self.tick_time()


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("mff_template_budget", default=None)


class TemplateLimitError(jinja2.TemplateError):
    """A render went past one of the limits of :mod:`mff.data.jinja_sandbox`."""


class TemplateRenderError(ValueError):
    """A template that does not parse or does not render (the reason in the message)."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the per-render limits of this module (and jinja2's
    compile-time optimizer off: see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if _int(left) and _int(right) and abs(left).bit_length() + abs(right).bit_length() > MAX_POWER_BITS:
                raise TemplateLimitError(f"an integer * an integer passes {MAX_POWER_BITS} bits")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (*_TEXT, list, tuple)) and _int(n) > 0:
                    _too_long(len(seq) * n, f"a {type(seq).__name__} of length {len(seq)} * {n}")
                    if isinstance(seq, (list, tuple)):
                        _too_long(_size(seq)[0] * n, f"a {type(seq).__name__} of length {len(seq)} * {n}")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if abs(left).bit_length() * right > MAX_POWER_BITS:
                    raise TemplateLimitError(f"{left} ** {right} passes {MAX_POWER_BITS} bits")
        elif operator == "%" and isinstance(left, _TEXT):
            _check_percent(left, right)
        return self._size_checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        budget = _budget.get()
        if budget is not None:
            budget.calls += 1
            if budget.calls > MAX_CALLS:
                raise TemplateLimitError(f"the render made more than {MAX_CALLS:,} calls")
            budget.tick_time()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, int) and getattr(__obj, "__name__", "") == "to_bytes":
            length = args[0] if args else kwargs.get("length", 1)
            _too_long(_int(length), f"int.to_bytes({length})")
        elif isinstance(owner, _TEXT) and not isinstance(owner, type):
            name = __obj.__name__
            if name == "join" and args:
                args = (_materialized(args[0], f"{type(owner).__name__}.join"), *args[1:])
                _check_join(owner, args[0], f"{type(owner).__name__}.join")
            else:
                _check_text_method(owner, name, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """``str.format`` / ``format_map`` of a plain string through :class:`_BoundedFormatter`
        (jinja2's own wrapper, for ``Markup``, with the widths of its string checked)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        s = value.__self__
        if type(s) is not str:
            for _, _, spec, _ in string.Formatter().parse(s):
                if spec and "{" not in spec:
                    _check_spec(spec)
            return wrapped
        formatter = _BoundedFormatter(self)
        if value.__name__ == "format_map":
            def format_map(mapping):
                return formatter.vformat(s, (), mapping)
            return format_map

        def format(*args, **kwargs):
            return formatter.vformat(s, args, kwargs)
        return format

    @staticmethod
    def _size_checked(value):
        if isinstance(value, _TEXT):
            if len(value) > MAX_RENDERED_CHARS:
                raise TemplateLimitError(f"a {type(value).__name__} of {len(value):,} items passes {MAX_RENDERED_CHARS:,}")
        elif isinstance(value, _CONTAINERS):
            _size(value)
        elif isinstance(value, int) and value.bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"an integer of {value.bit_length():,} bits passes {MAX_POWER_BITS} bits")
        return value

    @jinja2.pass_context
    def guard_size(self, context, value):
        """``value``, refused when it is bigger than :data:`MAX_RENDERED_CHARS` (see :func:`_size`)."""
        return self._size_checked(value)

    @jinja2.pass_context
    def guard_loop(self, context, iterable):
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

    @jinja2.pass_context
    def guard_output(self, context, value, static: int = 0):
        """``value`` (an expression a template writes), its length and the ``static`` characters of
        template text written beside it counted against the render's written characters."""
        budget = _budget.get()
        if budget is not None:
            budget.write(static + (len(value) if isinstance(value, str) else len(str(value))))
        return value

    @jinja2.pass_context
    def count_output(self, context, static: int):
        """``""``, counting ``static`` characters of template text written."""
        budget = _budget.get()
        if budget is not None:
            budget.write(static)
        return ""

    def set_tojson(self, f):
        """Use ``f`` as the ``tojson`` filter, its result size checked before it runs (a chat
        template's ``tojson`` differs from jinja2's: no HTML escaping)."""
        self.filters["tojson"] = _checked_tojson(f)

    def compile_bounded(self, source: str):
        """The template of ``source`` with every loop, value and written piece guarded.

        Raises:
            jinja2.TemplateSyntaxError: ``source`` does not parse, or nests too deeply for jinja2's
                parser or Python's compiler (3,000 chained ``+``, 120 nested ``{% if %}``).
        """
        try:
            return self._compile_guarded(source)
        except (RecursionError, SyntaxError, MemoryError) as e:  # IndentationError is a SyntaxError
            raise jinja2.TemplateSyntaxError(f"it nests too deeply to compile ({type(e).__name__})", 1) from None

    def _compile_guarded(self, source: str):
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
        for node in tree.find_all(nodes.Output):
            static = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
            node.nodes = [c if isinstance(c, nodes.TemplateData) else _guarded("guard_output", c) for c in node.nodes]
            if static:
                node.nodes.append(_guarded("count_output", nodes.Const(static, lineno=node.lineno)))
        return self.from_string(tree)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("optimized", False)
        super().__init__(*args, **kwargs)
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = _checked(self.filters[name], check)
        self.globals["lipsum"] = _checked(self.globals["lipsum"], _check_lipsum)
        self.filters["sum"] = _bounded_sum(self.filters["sum"])
        for name in _LAZY_FILTERS:
            self.filters[name] = _ticking_filter(self.filters[name])
        self.set_tojson(self.filters["tojson"])
        self.filters["join"] = _bounded_join(self.filters["join"])
        self.filters["mff_guard_size"] = self.guard_size
        self.filters["mff_guard_loop"] = self.guard_loop
        self.filters["mff_guard_output"] = self.guard_output
        self.filters["mff_count_output"] = self.count_output


def _sized(node) -> bool:
    """Whether ``node`` is an expression whose result :meth:`BoundedSandbox.guard_size` checks: ``~``,
    ``+``, a call, a list, tuple or dict literal, or a filter applied to a value (not the filter of
    a ``{% filter %}`` block)."""
    nodes = jinja2.nodes
    if isinstance(node, nodes.Filter):
        return node.node is not None and not node.name.startswith("mff_")
    if isinstance(node, (nodes.List, nodes.Tuple)):
        return node.ctx == "load" if isinstance(node, nodes.Tuple) else True
    return isinstance(node, (nodes.Concat, nodes.Add, nodes.Call, nodes.Dict))


def _guarded(method: str, node):
    """``node | mff_<method>`` as a jinja2 expression node: a filter, which the compiled template calls
    directly (a call node would go through the sandbox's ``call`` on every use)."""
    return jinja2.nodes.Filter(node, f"mff_{method}", [], [], None, None, lineno=node.lineno)


def _checked(f, check):
    """``f`` (a filter or global) with ``check(*args, **kwargs)`` run on its arguments before it
    (the arguments after the context jinja2 passes, for a filter that takes one)."""
    skip = 1 if jinja2.utils._PassArg.from_obj(f) is not None else 0

    @functools.wraps(f)
    def checked(*args, **kwargs):
        check(*args[skip:], **kwargs)
        return f(*args, **kwargs)

    return checked


def _check_format_filter(value, *args, **kwargs):
    if isinstance(value, str):
        _check_percent(value, args)


def _check_center(value, width=80):
    _too_long(_int(width), f"center({width})")


def _check_indent(value, width=4, *args, **kwargs):
    if isinstance(value, str):
        width = len(width) if isinstance(width, str) else _int(width)
        _too_long(len(value) + (value.count("\n") + 1) * width, f"indent({width})")


def _check_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(s, str):
        width = max(1, _int(width))
        lines = len(s) // width + s.count("\n") + 1
        _too_long(len(s) + lines * (len(wrapstring) if isinstance(wrapstring, str) else 1), f"wordwrap({width})")
        longest = max(map(len, s.split()), default=0)
        if longest * (len(s) // width) > MAX_TEXT_WORK:
            raise TemplateLimitError(f"wordwrap({width}) of a {longest:,}-character word would copy past {MAX_TEXT_WORK:,} characters")


def _check_batch(value, linecount, fill_with=None):
    if fill_with is not None:
        _too_long(_int(linecount), f"batch({linecount}) with a fill value")


def _check_slice(value, slices, fill_with=None):
    _too_long(_int(slices), f"slice({slices})")


def _check_tojson(value, indent=None, separators=None, **_):
    size, depth = _size(value)
    if indent is None and separators is None:
        return  # at most a few characters per item and character: checked on its result
    width = 0 if indent is None else len(indent) if isinstance(indent, str) else _int(indent)
    gaps = sum(len(x) for x in separators if isinstance(x, str)) if isinstance(separators, (list, tuple)) else 2
    what = f"tojson(indent={indent})" if separators is None else f"tojson(indent={indent}, separators of {gaps} characters)"
    _too_long((size + 1) * (2 + depth * width + gaps), what)


def _checked_tojson(f):
    """A ``tojson`` filter ``f`` (jinja2's, or a chat template's with ``ensure_ascii`` first) with its
    result size estimated from its value and ``indent`` before it runs."""
    import inspect

    signature = inspect.signature(f)
    skip = 1 if jinja2.utils._PassArg.from_obj(f) is not None else 0

    @functools.wraps(f)
    def tojson(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        _check_tojson(*list(bound.values())[skip:skip + 1], indent=bound.get("indent"), separators=bound.get("separators"))
        return f(*args, **kwargs)

    return tojson


def _check_replace_filter(s, old, new, count=None):
    _check_replace(str(s) if not isinstance(s, _TEXT) else s, old, new, count)


def _check_lipsum(n=5, html=True, *bounds, **kwargs):
    longest = max([100, *map(_int, bounds), *map(_int, kwargs.values())])  # words per paragraph
    _too_long(_int(n) * longest * 15, f"lipsum({n})")


_FILTER_CHECKS = {
    "format": _check_format_filter, "center": _check_center, "indent": _check_indent,
    "wordwrap": _check_wordwrap, "batch": _check_batch, "slice": _check_slice, "replace": _check_replace_filter,
}


_LAZY_FILTERS = ("map", "select", "reject", "selectattr", "rejectattr")


def _ticking_filter(f):
    """A filter ``f`` that returns an iterator, its items read with the render's clock checked
    every 1,024 items (a chain of them, pulled by one ``|list``, is one long call otherwise)."""

    @functools.wraps(f)
    def ticking(*args, **kwargs):
        return _ticking(f(*args, **kwargs))

    return ticking


def _ticking(items):
    budget = _budget.get()
    if budget is None:
        yield from items
        return
    for i, item in enumerate(items):
        if not i & 1023:
            budget.tick_time()
        yield item


def _bounded_join(f):
    """The ``join`` filter reading its iterable once into a list and refusing a result past the limit."""

    @functools.wraps(f)
    def join(eval_ctx, value, d="", attribute=None):
        items = _materialized(value, "join")
        if attribute is None:
            _check_join(d, items, "join")
        result = f(eval_ctx, items, d, attribute)
        _too_long(len(result), "join")
        return result

    return join


def _bounded_sum(f):
    """The ``sum`` filter, adding lists or tuples in one pass (Python's ``sum`` copies the running
    total at every item: quadratic) and refusing a total past the limit."""

    @functools.wraps(f)
    def sum_(environment, iterable, attribute=None, start=0):
        if attribute is None and isinstance(start, (list, tuple)):
            items = _materialized(iterable, "sum")
            if all(type(x) is type(start) for x in items):
                _too_long(_size(start)[0] + sum(_size(x)[0] for x in items), "sum")
                return type(start)(itertools.chain(start, *items))
            iterable = items
        return f(environment, iterable, attribute, start)

    return sum_


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
        why = f"went past a limit: {e} (see mff.data.jinja_sandbox)"
    except jinja2.exceptions.SecurityError as e:
        why = f"tried something the sandbox forbids: {e}"
    except jinja2.TemplateError as e:
        why = f"raised an error: {e}"
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError) as e:
        why = f"fails: {type(e).__name__}: {e}"
    finally:
        _budget.reset(token)
    raise TemplateRenderError(f"{what} " + " ".join(why.splitlines()))
