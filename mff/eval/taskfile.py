"""Tasks from local files: lm-eval task YAML over local JSON data, and ``ppl:FILE``.

A task ``.yaml`` file uses lm-evaluation-harness's keys (``lm_eval/api/task.py`` ``TaskConfig``),
so one file serves both mff and ``lm_eval --include_path``::

    task: my_mc
    dataset_path: json
    dataset_kwargs: {data_files: {test: /data/my_mc.jsonl}}
    test_split: test
    output_type: multiple_choice        # or loglikelihood_rolling, generate_until
    doc_to_text: "Question: {{question}}\\nAnswer:"
    doc_to_choice: choices              # a field, a list, or a template giving a list
    doc_to_target: answer               # a field or template: an index or the choice text
    target_delimiter: " "               # the defaults are lm-eval's
    fewshot_delimiter: "\\n\\n"
    description: ""
    generation_kwargs: {until: ["\\n"], max_gen_toks: 64}

``doc_to_*`` values that name a field of the row take that field; other strings are jinja2
templates (sandboxed; an unknown name is an error), as in lm-eval. Relative data paths are
taken from the YAML's folder (lm-eval takes them from the working directory: write absolute
paths in a file meant for both).
Read: ``dataset_path: json`` with ``.json``/``.jsonl`` files (other dataset paths need the HF
hub, which mff never reaches at run time).

``ppl:FILE`` is the perplexity of a ``.txt`` file (one document), of a ``.jsonl`` file (a
document per row's ``text``) or of a Megatron / mff indexed dataset (``FILE.bin`` +
``FILE.idx``: its documents' token ids, scored as they are).
"""

from __future__ import annotations

import ast
import json
import os
import re
from functools import lru_cache
from pathlib import Path

import jinja2

from mff.data.jinja_sandbox import BoundedSandbox, TemplateRenderError, render_bounded, syntax_message
from mff.eval.task import Generation, MultipleChoice, Perplexity, Task

__all__ = ["read_task_file", "perplexity_task", "TaskFileError"]

OUTPUT_TYPES = ("multiple_choice", "loglikelihood_rolling", "generate_until")


class TaskFileError(ValueError):
    """A task file that mff cannot use (the file and the key named)."""


@lru_cache(maxsize=1)
def _env():
    from jinja2 import StrictUndefined

    return BoundedSandbox(keep_trailing_newline=True, undefined=StrictUndefined)  # as lm-eval: an unknown name is an error


@lru_cache(maxsize=64)
def _template(rule: str):
    return _env().compile_bounded(rule)


def _apply(rule, doc: dict, where: str, key: str):
    """lm-eval's ``doc_to_*`` rule: a field name, a literal list / int, or a jinja2 template."""
    if isinstance(rule, (list, int)):
        return rule
    if not isinstance(rule, str):
        raise TaskFileError(f"{where}: {key} must be a field name, a template or a list, not {type(rule).__name__}")
    if rule in doc:
        return doc[rule]
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule):  # a field name, not a template
        raise TaskFileError(f"{where}: {key} names the field {rule!r}, which a data row lacks (its fields: {', '.join(sorted(doc))})")
    what = f"{where}: {key} template {rule[:200]!r}"
    try:
        template = _template(rule)
    except jinja2.TemplateSyntaxError as e:
        raise TaskFileError(syntax_message(e, what)) from None
    try:
        return render_bounded(template, doc, what)
    except TemplateRenderError as e:
        raise TaskFileError(f"{e} (a row with fields {sorted(doc)})") from None


def _read_rows(path: Path, where: str) -> list[dict]:
    """The JSON objects of a ``.json`` (a list, or ``{"data": [...]}``) or ``.jsonl`` data file."""
    from mff.data.sft_rows import read_rows

    if not path.is_file():
        raise TaskFileError(f"{where}: data file {path} does not exist")
    if path.suffix == ".json":
        try:
            obj = json.loads(path.read_text(encoding="utf-8-sig"))
        except (ValueError, RecursionError, OSError) as e:
            raise TaskFileError(f"{where}: {path} is not a readable JSON file ({e})") from None
        if isinstance(obj, dict) and isinstance(obj.get("data"), list):  # the layout HF datasets' json builder also reads
            rows = obj["data"]
            if not rows or not all(isinstance(r, dict) for r in rows):
                raise TaskFileError(f"{where}: {path}: \"data\" must be a non-empty list of JSON objects")
            return rows
    try:
        return [r.data for r in read_rows([str(path)])]
    except (ValueError, FileNotFoundError) as e:
        raise TaskFileError(f"{where}: {e}") from None


def _data_file(cfg: dict, base: Path, where: str, split: str) -> Path:
    kwargs = cfg.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TaskFileError(f"{where}: dataset_kwargs must be a mapping with data_files, got {type(kwargs).__name__}")
    files = kwargs.get("data_files")
    if isinstance(files, dict):
        if split not in files:
            raise TaskFileError(f"{where}: dataset_kwargs.data_files has no {split!r} split (has {sorted(files)})")
        files = files[split]
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if not isinstance(files, str):
        raise TaskFileError(f"{where}: dataset_kwargs.data_files must name one local .json/.jsonl file (per split), got {files!r}")
    p = Path(os.path.expanduser(files))
    return p if p.is_absolute() else base / p


def _check_types(cfg: dict, where: str) -> None:
    """The value types lm-eval accepts for the keys mff reads; raises TaskFileError naming the key."""
    def bad(key: str, want: str):
        raise TaskFileError(f"{where}: {key} is {cfg[key]!r}; expected {want}")

    if not isinstance(cfg["task"], str) or not cfg["task"]:
        bad("task", "a non-empty name")
    for key in ("doc_to_text", "doc_to_target"):
        if key in cfg and not (isinstance(cfg[key], str) or (isinstance(cfg[key], int) and not isinstance(cfg[key], bool))):
            bad(key, "a field name, a jinja2 template or an int")
    if "doc_to_choice" in cfg and not isinstance(cfg["doc_to_choice"], (str, list)):
        bad("doc_to_choice", "a field name, a template or a list of strings")
    for key in ("target_delimiter", "fewshot_delimiter", "description"):
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], str):
            bad(key, "a string")
    if "num_fewshot" in cfg and cfg["num_fewshot"] is not None and (
            isinstance(cfg["num_fewshot"], bool) or not isinstance(cfg["num_fewshot"], int) or cfg["num_fewshot"] < 0):
        bad("num_fewshot", "an int >= 0")
    gen = cfg.get("generation_kwargs")
    if gen is not None:
        if not isinstance(gen, dict):
            bad("generation_kwargs", "a mapping (until, max_gen_toks)")
        until = gen.get("until", [])
        if not (isinstance(until, str) or (isinstance(until, list) and all(isinstance(u, str) and u for u in until))):
            raise TaskFileError(f"{where}: generation_kwargs.until is {until!r}; expected a string or a list of non-empty strings")
        mg = gen.get("max_gen_toks", 256)
        if isinstance(mg, bool) or not isinstance(mg, int) or mg < 1:
            raise TaskFileError(f"{where}: generation_kwargs.max_gen_toks is {mg!r}; expected an int >= 1")


def read_task_file(path: str | os.PathLike) -> Task:
    """The task a YAML file describes (see the module docstring).

    Raises:
        TaskFileError: unreadable YAML, a missing required key (``task``, ``output_type``,
            ``doc_to_text``; ``doc_to_choice`` and ``doc_to_target`` for multiple choice), an
            unknown ``output_type``, a non-local dataset, data rows the rules cannot read.
    """
    import yaml

    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise TaskFileError(f"{where}: no such task file (a .yaml file of lm-eval task keys)")
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise TaskFileError(f"{where}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    except OSError as e:
        raise TaskFileError(f"{where}: cannot be read ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise TaskFileError(f"{where}: a task file is a YAML mapping of lm-eval task keys")
    kind = cfg.get("output_type", "generate_until")
    need = ["task", "doc_to_text"] + (["doc_to_choice", "doc_to_target"] if kind == "multiple_choice" else [])
    if kind == "loglikelihood_rolling":
        need = ["task"]
    missing = [k for k in need + ["dataset_path"] if k not in cfg]
    if missing:
        raise TaskFileError(f"{where}: missing key(s) {', '.join(missing)} (lm-eval task keys: task, dataset_path, dataset_kwargs, "
                            "output_type, doc_to_text, doc_to_choice, doc_to_target)")
    if kind not in OUTPUT_TYPES:
        raise TaskFileError(f"{where}: output_type {kind!r}; expected one of {', '.join(OUTPUT_TYPES)}")
    if cfg["dataset_path"] != "json":
        raise TaskFileError(f"{where}: dataset_path {cfg['dataset_path']!r}: mff reads local data only (dataset_path: json with "
                            "dataset_kwargs.data_files)")
    split = cfg.get("test_split") or cfg.get("validation_split")
    if not isinstance(split, str):
        raise TaskFileError(f"{where}: needs test_split (or validation_split): the data_files split to evaluate, as lm-eval requires")
    _check_types(cfg, where)
    data = _data_file(cfg, path.parent, where, split)
    name = cfg["task"]
    description = cfg.get("description") or ""

    def describe(doc: dict) -> str:
        return str(_apply(description, doc, where, "description")) if description else ""

    def rows() -> list[dict]:
        return _read_rows(data, where)

    if kind == "loglikelihood_rolling":
        rule = cfg.get("doc_to_target", cfg.get("doc_to_text"))
        if rule is None:
            raise TaskFileError(f"{where}: missing key doc_to_target (or doc_to_text): the text to score")
        return Perplexity(name, lambda: [{"text": str(_apply(rule, r, where, "doc_to_target"))} for r in rows()], source=str(data))

    def query(r: dict) -> str:
        return str(_apply(cfg["doc_to_text"], r, where, "doc_to_text"))

    common = dict(target_delimiter=str(cfg.get("target_delimiter", " ")), fewshot_delimiter=str(cfg.get("fewshot_delimiter", "\n\n")),
                  num_fewshot=int(cfg.get("num_fewshot") or 0), description=describe, source=str(data))
    if kind == "multiple_choice":
        def load() -> list[dict]:
            docs = []
            for n, r in enumerate(rows()):
                choices = _apply(cfg["doc_to_choice"], r, where, "doc_to_choice")
                if isinstance(choices, str):
                    try:
                        choices = ast.literal_eval(choices)
                    except (ValueError, SyntaxError):
                        raise TaskFileError(f"{where}: row {n}: doc_to_choice gave {choices[:80]!r}, not a list") from None
                if not isinstance(choices, list) or not choices:
                    raise TaskFileError(f"{where}: row {n}: doc_to_choice gave {choices!r}; expected a non-empty list")
                choices = [str(c) for c in choices]
                target = _apply(cfg["doc_to_target"], r, where, "doc_to_target")
                if isinstance(target, str) and target.strip().isdigit():
                    target = int(target)
                if isinstance(target, int) and not isinstance(target, bool):
                    gold = target
                elif isinstance(target, str) and target in choices:
                    gold = choices.index(target)
                else:
                    raise TaskFileError(f"{where}: row {n}: doc_to_target gave {target!r}: neither an index nor one of the choices")
                if not 0 <= gold < len(choices):
                    raise TaskFileError(f"{where}: row {n}: target index {gold} outside the {len(choices)} choices")
                docs.append({"query": query(r), "choices": choices, "gold": gold})
            return docs

        return MultipleChoice(name, load, **common)
    gen = cfg.get("generation_kwargs") or {}
    until = gen.get("until", ["\n\n"])
    until = (until,) if isinstance(until, str) else tuple(until)
    target_rule = cfg.get("doc_to_target", "")

    def gen_load() -> list[dict]:
        return [{"query": query(r), "target": str(_apply(target_rule, r, where, "doc_to_target"))} for r in rows()]

    def exact_match(doc: dict, completion: str) -> dict[str, float]:
        return {"exact_match": float(completion.strip() == doc["target"].strip())}

    return Generation(name, gen_load, exact_match, until=until, max_gen_toks=int(gen.get("max_gen_toks", 256)), **common)


def perplexity_task(spec: str) -> Perplexity:
    """``ppl:FILE`` (see the module docstring). Raises FileNotFoundError naming what was looked for."""
    p = Path(os.path.expanduser(spec[len("ppl:"):]))
    if p.suffix in (".bin", ".idx") and p.with_suffix(".bin").is_file() and p.with_suffix(".idx").is_file():
        p = p.with_suffix("")  # a dataset named by one of its two files
    if Path(str(p) + ".bin").is_file() and Path(str(p) + ".idx").is_file():
        from mff.data.indexed import IndexedDataset

        def load_ids() -> list[dict]:
            ds = IndexedDataset(str(p))
            return [{"ids": [int(t) for t in ds[i]]} for i in range(len(ds)) if len(ds[i])]

        return Perplexity(f"ppl:{p.name}", load_ids, source=str(p))
    if not p.is_file():
        raise FileNotFoundError(f"{spec}: no file {p} (and no {p}.bin/{p}.idx dataset); give a .txt or .jsonl file or a dataset prefix")
    if p.suffix not in (".txt", ".jsonl", ".md", ".text", ""):
        raise ValueError(f"{spec}: {p.suffix} files are not text; give a .txt or .jsonl file (rows with a \"text\" field) or the "
                         "prefix of a Megatron .bin/.idx dataset")

    def load_text() -> list[dict]:
        if p.suffix == ".jsonl":
            from mff.data.sft_rows import read_rows

            docs = []
            for r in read_rows([str(p)]):
                if not isinstance(r.data.get("text"), str):
                    raise ValueError(f"{r.where}: expected an object with a \"text\" string")
                docs.append({"text": r.data["text"]})
            return docs
        try:
            text = p.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(f"{p} is not UTF-8 text: {e}") from None
        if not text.strip():
            raise ValueError(f"{p} is empty: nothing to score")
        return [{"text": text}]

    return Perplexity(f"ppl:{p.name}", load_text, source=str(p))
