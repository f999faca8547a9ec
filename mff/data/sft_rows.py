"""Instruction and chat rows in the three formats fine-tuning users bring, read from ``.json`` /
``.jsonl`` files and normalised to one conversation form: ``[{"role", "content"}]`` with roles
``system``, ``user`` and ``assistant``.

- ``alpaca`` (Stanford Alpaca; LLaMA-Factory's ``alpaca`` dataset format): ``instruction``,
  optional ``input`` (appended to the instruction after a newline), ``output``, optional
  ``system`` and ``history`` (earlier ``[instruction, output]`` pairs, oldest first).
- ``sharegpt``: ``conversations: [{"from": human|user|gpt|assistant|system, "value": text}]``,
  optional top-level ``system``.
- ``openai``: ``messages: [{"role": system|user|assistant, "content": text}]``.

The format is told apart by the keys (``messages``, ``conversations``, ``instruction``) or set.
A ``.json`` file holds a list of rows; a ``.jsonl`` file one row per line (blank lines skipped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mff.paths import file_kind

__all__ = ["FORMATS", "Row", "read_rows", "detect_format", "to_messages"]

FORMATS = ("alpaca", "sharegpt", "openai")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_OPENAI_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Row:
    """One row: ``where`` it came from (``file:line`` for .jsonl, ``file[index]`` for .json),
    its ``data``, and a stable ``key`` (``file name:index of the row in the file``)."""

    where: str
    data: dict
    key: str = ""


def _files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".json", ".jsonl"))
            if not found:
                raise FileNotFoundError(f"--data.path {p}: the folder holds no .json or .jsonl files")
            out += found
        elif p.is_file():
            if p.suffix not in (".json", ".jsonl"):
                raise ValueError(f"--data.path {p}: expected a .json or .jsonl file of rows (or a folder of them), got {p.suffix or 'no suffix'}")
            out.append(p)
        elif p.exists():
            raise ValueError(f"--data.path {p} is {file_kind(p)}; expected a .json or .jsonl file of rows or a folder of them")
        else:
            raise FileNotFoundError(f"--data.path {p} does not exist")
    return out


def _loads(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None


def read_rows(paths: tuple[str, ...] | list[str]) -> list[Row]:
    """Every row of the files or folders ``paths``, in file order.

    Raises:
        FileNotFoundError: a path that does not exist, a folder without .json/.jsonl files.
        ValueError: no paths; a file of another kind; invalid JSON (file and line named); a
            row that is not a JSON object; an empty file or no rows at all.
    """
    if not paths:
        raise ValueError("--data.path is required: .json or .jsonl files of rows (alpaca, sharegpt or openai format), or folders of them")
    rows: list[Row] = []
    for f in _files(paths):
        try:
            text = f.read_text(encoding="utf-8-sig")  # a leading byte-order mark is skipped
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text: {e}") from None
        except OSError as e:
            raise ValueError(f"{f} cannot be read: {e.strerror or e}") from None
        n0 = len(rows)
        if f.suffix == ".jsonl":
            for i, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 or U+0085 may stand inside a JSON string
                if not line.strip():
                    continue
                obj = _loads(line, f"{f}:{i}")
                if not isinstance(obj, dict):
                    raise ValueError(f"{f}:{i}: a row must be a JSON object, got {type(obj).__name__}")
                rows.append(Row(f"{f}:{i}", obj, f"{f.name}:{len(rows) - n0}"))
        else:
            obj = _loads(text, str(f)) if text.strip() else []
            if not isinstance(obj, list):
                raise ValueError(f"{f}: a .json file of rows must hold a JSON list of objects, got {type(obj).__name__}")
            for i, item in enumerate(obj):
                if not isinstance(item, dict):
                    raise ValueError(f"{f}[{i}]: a row must be a JSON object, got {type(item).__name__}")
                rows.append(Row(f"{f}[{i}]", item, f"{f.name}:{i}"))
        if len(rows) == n0:
            raise ValueError(f"{f} holds no rows (an empty file)")
    return rows


def detect_format(row: Row) -> str:
    """``openai``, ``sharegpt`` or ``alpaca`` from the row's keys. Raises ValueError naming the keys."""
    if "messages" in row.data:
        return "openai"
    if "conversations" in row.data:
        return "sharegpt"
    if "instruction" in row.data:
        return "alpaca"
    raise ValueError(f"{row.where}: cannot tell the row's format from its keys {sorted(row.data)}; expected 'messages' (openai), "
                     "'conversations' (sharegpt) or 'instruction' (alpaca), or set --data.format")


def _text(row: Row, value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{row.where}: {what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{row.where}: {what} holds a lone surrogate code point (\\ud800-\\udfff), not text") from None
    return value


def _alpaca(row: Row) -> list[dict]:
    d = row.data
    if "instruction" not in d or "output" not in d:
        raise ValueError(f"{row.where}: an alpaca row needs 'instruction' and 'output' (keys: {sorted(d)})")
    msgs = []
    if d.get("system") is not None and _text(row, d["system"], "'system'"):
        msgs.append({"role": "system", "content": d["system"]})
    for j, pair in enumerate(d.get("history") or []):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{row.where}: history[{j}] must be an [instruction, output] pair")
        msgs += [{"role": "user", "content": _text(row, pair[0], f"history[{j}][0]")},
                 {"role": "assistant", "content": _text(row, pair[1], f"history[{j}][1]")}]
    prompt = _text(row, d["instruction"], "'instruction'")
    extra = _text(row, d["input"], "'input'") if d.get("input") is not None else ""
    prompt = f"{prompt}\n{extra}" if extra else prompt
    return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(row, d["output"], "'output'")}]


def _sharegpt(row: Row) -> list[dict]:
    conv = row.data.get("conversations")
    if not isinstance(conv, list):
        raise ValueError(f"{row.where}: 'conversations' must be a list of {{from, value}} turns")
    msgs = []
    if row.data.get("system") is not None and _text(row, row.data["system"], "'system'"):
        msgs.append({"role": "system", "content": row.data["system"]})
    for j, turn in enumerate(conv):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise ValueError(f"{row.where}: conversations[{j}] must be an object with 'from' and 'value'")
        role = _SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ValueError(f"{row.where}: conversations[{j}] has unknown role 'from': {turn['from']!r}; expected one of "
                             f"{', '.join(_SHAREGPT_ROLES)}")
        msgs.append({"role": role, "content": _text(row, turn["value"], f"conversations[{j}].value")})
    return msgs


def _openai(row: Row) -> list[dict]:
    raw = row.data.get("messages")
    if not isinstance(raw, list):
        raise ValueError(f"{row.where}: 'messages' must be a list of {{role, content}} messages")
    msgs = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{row.where}: messages[{j}] must be an object with 'role' and 'content'")
        if m["role"] not in _OPENAI_ROLES:
            raise ValueError(f"{row.where}: messages[{j}] has unknown role {m['role']!r}; expected one of {', '.join(_OPENAI_ROLES)}")
        msgs.append({"role": m["role"], "content": _text(row, m["content"], f"messages[{j}].content")})
    return msgs


def to_messages(row: Row, fmt: str = "auto") -> list[dict]:
    """The row as ``[{"role", "content"}]`` (``fmt``: one of :data:`FORMATS` or ``auto``).

    Raises:
        ValueError: an unknown format; a row without the format's keys, with an unknown role,
            a non-string text, no assistant turn, or a system message after the first turn
            (each names the row's file and line).
    """
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt not in FORMATS:
        raise ValueError(f"--data.format {fmt!r}; expected auto, {', '.join(FORMATS)}")
    msgs = {"alpaca": _alpaca, "sharegpt": _sharegpt, "openai": _openai}[fmt](row)
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"{row.where}: the row has no assistant turn, so nothing to learn from ({fmt} format)")
    if any(m["role"] == "system" for m in msgs[1:]):
        raise ValueError(f"{row.where}: a system message may only come first")
    return msgs

