"""Pytree helpers on optree: flat paths, map-with-path and path patterns.

Params are a flat ``dict[str, Tensor]`` keyed by dotted param paths
(``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``). Trees that nest such dicts
(optimizer state ``{"exp_avg": params_like, ...}``) are addressed by joining the keys of
each level with ``/``: ``exp_avg/model.norm.weight``. That joined form is also the key
used in ``optim.safetensors`` (DESIGN.md, checkpoint layout).

Patterns select param paths: ``*`` matches within one dotted component, ``**`` matches
one or more whole components, everything else is literal.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

__all__ = [
    "flatten_with_paths",
    "unflatten_paths",
    "map_with_path",
    "compile_pattern",
    "matches",
    "first_match",
]


def _key_str(entry: Any) -> str:
    return str(entry)


def flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """List ``(path, leaf)`` for every leaf of ``tree`` in optree's order.

    Dict keys are visited in sorted order (optree's rule); nested levels are joined with
    ``/``. ``None`` leaves are dropped by optree and therefore never listed.
    """
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    return [("/".join(_key_str(k) for k in p), leaf) for p, leaf in zip(paths, leaves)]


def unflatten_paths(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Inverse of :func:`flatten_with_paths` for trees made of nested dicts.

    ``[("exp_avg/model.norm.weight", t)]`` becomes ``{"exp_avg": {"model.norm.weight": t}}``;
    a path with no ``/`` stays a top-level key.
    """
    out: dict[str, Any] = {}
    for path, leaf in items:
        *heads, last = path.split("/")
        node = out
        for h in heads:
            node = node.setdefault(h, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r} descends into a leaf at {h!r}")
        if last in node:
            raise ValueError(f"duplicate path {path!r}")
        node[last] = leaf
    return out


def map_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Apply ``fn(path, leaf)`` to each leaf and rebuild a tree of the same structure."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    new = [fn("/".join(_key_str(k) for k in p), leaf) for p, leaf in zip(paths, leaves)]
    return optree.tree_unflatten(spec, new)


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a path pattern: ``*`` = one dotted component (or part of one, ``w*``),
    ``**`` = one or more whole components; everything else is literal."""
    if not pattern or any(not part for part in pattern.split(".")):
        raise ValueError(f"bad path pattern {pattern!r}: empty component")
    pieces = []
    for part in pattern.split("."):
        if part == "**":
            pieces.append(r"[^.]+(?:\.[^.]+)*")
        else:
            pieces.append("".join("[^.]*" if tok == "*" else re.escape(tok) for tok in re.split(r"(\*)", part) if tok))
    return re.compile(r"\.".join(pieces) + r"\Z")


def matches(pattern: str, path: str) -> bool:
    """True when ``path`` is matched in full by ``pattern``."""
    return compile_pattern(pattern).match(path) is not None


def first_match(path: str, table: Iterable[tuple[str, Any]]) -> tuple[str, Any] | None:
    """The first ``(pattern, value)`` row of ``table`` whose pattern matches ``path``."""
    for pattern, value in table:
        if matches(pattern, path):
            return pattern, value
    return None


def tree_bytes(tree: Any) -> int:
    """Total bytes of the tensor leaves of ``tree`` (local storage, DTensors by local shard)."""
    total = 0
    for leaf in optree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
            total += local.numel() * local.element_size()
    return total
