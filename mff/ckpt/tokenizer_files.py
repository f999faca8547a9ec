"""The tokenizer, chat template and end-of-sequence ids that come with a checkpoint.

- an HF folder (or a MindSpore checkpoint's folder): ``tokenizer.json``, ``tokenizer_config.json``
  (``chat_template``, ``bos_token``, ``eos_token``), ``chat_template.jinja``,
  ``generation_config.json`` / ``config.json`` (``eos_token_id``);
- a ``.gguf`` file: its tokenizer and ``tokenizer.chat_template`` metadata;
- an mff run folder: the ``tokenizer.json`` a run keeps (and the ``tokenizer_config.json``
  fine-tuning and ``pretrain --init-from`` keep beside it); when it names no end token the end
  of a document (the data's EOD token) ends generation.

:func:`save_text_assets` keeps a checkpoint's text side in a run folder (``tokenizer.json`` +
``tokenizer_config.json``); :func:`hf_export_files` gives the files (and the ``config.json``
token ids) an exported HF folder needs for transformers' ``AutoTokenizer`` and ``generate``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mff.ckpt.autoload import checkpoint_kind, resolve_mff_step_dir, tokenizer_folder
from mff.ckpt.checkpoint import read_meta
from mff.data.chat import read_chat_template_file

__all__ = ["TextAssets", "load_text_assets", "read_tokenizer", "read_chat_template_file", "text_asset_files", "save_text_assets",
           "hf_export_files", "write_text_atomic", "TOKEN_ID_KEYS"]

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special-token ids of an HF ``config.json`` / ``generation_config.json``."""


@dataclass
class TextAssets:
    """A checkpoint's text side. ``tokenizer`` is None when it has none; ``eos_ids`` are the ids
    that end a generated answer (the config's ``eos_token_id`` and the EOS token's id); the
    ``*_token`` fields are token strings (None: unknown)."""

    tokenizer: Tokenizer | None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_ids: list[int] = field(default_factory=list)
    pad_token: str | None = None
    chat_template_source: str | None = None
    """Where ``chat_template`` was read, for errors: ``FOLDER/tokenizer_config.json`` (key
    ``chat_template``), ``FOLDER/chat_template.jinja`` or ``FILE.gguf`` (``tokenizer.chat_template``)."""

    def add_eos_token_id(self) -> None:
        """Append the EOS token's id to ``eos_ids`` (when the tokenizer knows it)."""
        if self.eos_token is not None and self.tokenizer is not None:
            eid = self.tokenizer.token_to_id(self.eos_token)
            if eid is not None and eid not in self.eos_ids:
                self.eos_ids.append(eid)


def _special(value, where: str = "tokenizer_config.json", key: str = "token") -> str | None:
    """A special token's text: a string, HF's AddedToken dict (its ``content``) or None.
    Raises ValueError naming ``where`` and ``key`` for anything else."""
    if isinstance(value, dict):  # HF AddedToken serialisation
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: {key} is {value!r}; expected the token's text (a string)")
    return value


def _as_list(x, where: str = "config", key: str = "eos_token_id") -> list[int]:
    """Token ids from an int, a list of ints or None. Raises ValueError naming ``where`` and
    ``key`` for anything else (a string, a float, a bool)."""
    if x is None:
        return []
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise ValueError(f"{where}: {key} is {x!r}; expected a token id (an int) or a list of them")
    bad = [i for i in items if not 0 <= i < 2**31]
    if bad:
        raise ValueError(f"{where}: {key} holds {bad[0]}; expected token ids in [0, 2**31)")
    return items


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temp name beside it and ``os.replace``, so a
    reader never sees a partial file; creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json. Raises FileNotFoundError / ValueError (unreadable)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist or is not a file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library can read: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(d).__name__}")
    try:
        bad = _surrogate_key(d)
    except RecursionError:  # nested about as deep as json itself reads: not a tokenizer file
        raise ValueError(f"{path} is nested too deeply to be a tokenizer or generation config") from None
    if bad is not None:
        raise ValueError(f"{path}: {bad} holds a \\uD800-\\uDFFF escape that is no character on its own (a lone surrogate); "
                         "the text cannot be encoded")
    return d


def _surrogate_key(value, key: str = "") -> str | None:
    """The key path of the first string in ``value`` holding a lone surrogate (JSON ``"\\ud800"``), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return key or "a string"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _surrogate_key(k) is not None:
            return f"the key {k.encode('utf-8', 'backslashreplace').decode()!r}"
        found = _surrogate_key(v, f"{key}.{k}" if key else str(k))
        if found is not None:
            return found
    return None


def _folder_assets(folder: Path, eos_ids: list[int]) -> TextAssets:
    tok_file = folder / "tokenizer.json"
    tok_cfg = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template")
    source = f"{folder / 'tokenizer_config.json'} chat_template" if template is not None else None
    if isinstance(template, list):  # several named templates: the default one
        names = [t.get("name") for t in template if isinstance(t, dict)]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if template is None:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: chat_template is a list of named templates without one named "
                             f"'default' (names: {names}); pass the one to use as a file (--chat-template / --data.chat-template)")
    if template is None and (folder / "chat_template.jinja").is_file():
        try:
            template = (folder / "chat_template.jinja").read_bytes().decode("utf-8") or None
        except UnicodeDecodeError as e:
            raise ValueError(f"{folder / 'chat_template.jinja'} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        source = str(folder / "chat_template.jinja")
    if (folder / "generation_config.json").is_file():
        gen = folder / "generation_config.json"
        eos_ids = _as_list(_read_json(gen).get("eos_token_id"), str(gen)) or eos_ids
    tok = read_tokenizer(tok_file) if tok_file.is_file() else None
    where = str(folder / "tokenizer_config.json")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: chat_template is a {type(template).__name__}; expected the template text (a string)")
    return TextAssets(tok, template, _special(tok_cfg.get("bos_token"), where, "bos_token"),
                      _special(tok_cfg.get("eos_token"), where, "eos_token"), list(eos_ids),
                      pad_token=_special(tok_cfg.get("pad_token"), where, "pad_token"), chat_template_source=source)


def _run_eod_id(tokenizer: Tokenizer, step: Path) -> int | None:
    """The EOD id a pretraining run's data used (``--data.eod-id``, else ``--data.eod-token`` or
    the tokenizer's EOD candidate); None when it cannot be told."""
    from mff.data.tokenizer import find_eod_id

    data = (read_meta(step).get("run") or {}).get("data") or {}
    if isinstance(data.get("eod_id"), int) and not isinstance(data.get("eod_id"), bool):
        return data["eod_id"]
    eod = data.get("eod_token")
    try:
        return find_eod_id(tokenizer, eod if isinstance(eod, str) else None)
    except ValueError:
        return None


def load_text_assets(path: str | os.PathLike, gguf=None) -> TextAssets:
    """The :class:`TextAssets` of the checkpoint at ``path`` (see the module docstring).

    ``gguf``: the :class:`mff.ckpt.gguf.GGUFCheckpoint` of a ``.gguf`` ``path`` already read
    (else it is read again, without its tensors). Raises as :func:`mff.load` for a path that is
    no checkpoint, ValueError for an unreadable tokenizer.json or JSON file.
    """
    kind = checkpoint_kind(path)
    p = Path(path)
    if kind == "gguf":
        if gguf is None:
            from mff.ckpt.gguf import read_gguf

            gguf = read_gguf(p, with_tokenizer=True)
        out = TextAssets(gguf.tokenizer, gguf.chat_template, gguf.bos_token, gguf.eos_token, _as_list(gguf.config.get("eos_token_id"), str(p)),
                         chat_template_source=f"{p} tokenizer.chat_template")
        pad = gguf.config.get("pad_token_id")
        if gguf.tokenizer is not None and isinstance(pad, int):
            out.pad_token = gguf.tokenizer.id_to_token(pad)
    elif kind in ("hf", "mindspore"):
        folder = p if p.is_dir() else p.parent
        cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        out = _folder_assets(folder, _as_list(cfg.get("eos_token_id"), str(folder / "config.json")))
    else:
        folder = tokenizer_folder(p)
        out = _folder_assets(folder, [])
        out.add_eos_token_id()
        if not out.eos_ids and out.tokenizer is not None:
            # a pretraining run (or one whose EOS token its tokenizer lacks): generation ends at
            # its data's end-of-document token, which is also the EOS token of a run without a
            # chat template
            eod = _run_eod_id(out.tokenizer, resolve_mff_step_dir(p))
            if eod is not None:
                out.eos_ids = [eod]
                if out.chat_template is None and out.eos_token is None:
                    out.eos_token = out.tokenizer.id_to_token(eod)
        return out
    out.add_eos_token_id()
    return out


def text_asset_files(assets: TextAssets) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS / EOS / pad tokens)
    texts (name -> text) that carry ``assets`` into a folder (an mff run, an exported HF folder);
    ``tokenizer_config.json`` only when ``assets`` name one of those."""
    out = {}
    if assets.tokenizer is not None:
        out["tokenizer.json"] = assets.tokenizer.to_str()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, value in (("bos_token", assets.bos_token), ("eos_token", assets.eos_token), ("pad_token", assets.pad_token)):
        if value is not None:
            cfg[key] = value
    if assets.chat_template:
        cfg["chat_template"] = assets.chat_template
    if len(cfg) > 2:
        out["tokenizer_config.json"] = _json(cfg)
    return out


def save_text_assets(folder: str | os.PathLike, assets: TextAssets, overwrite: bool = False) -> list[str]:
    """Keep ``assets`` in ``folder`` (a run folder): the files of :func:`text_asset_files`, each
    written atomically; a file already there is kept unless ``overwrite``. Returns the names
    written. Raises OSError when ``folder`` cannot be written."""
    written = []
    for name, text in text_asset_files(assets).items():
        path = Path(folder) / name
        if overwrite or not path.exists():
            write_text_atomic(path, text)
            written.append(name)
    return written


def _json(d: Mapping[str, Any]) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


def _is_id(x: Any, vocab_size: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab_size


def _special_text(tok: Tokenizer | None, tid: Any) -> str | None:
    """The text of token ``tid`` when it is one of the tokenizer's special (added) tokens."""
    if tok is None or not isinstance(tid, int):
        return None
    added = tok.get_added_tokens_decoder().get(tid)
    return added.content if added is not None and added.special else None


def hf_export_files(assets: TextAssets, config_ids: Mapping[str, Any], vocab_size: int, model_max_length: int | None = None,
                    copied: Mapping[str, str] | None = None, keep_tokenizer_config: bool = False) -> tuple[dict[str, int], dict[str, str]]:
    """The token ids and text files an exported HF folder needs so that transformers'
    ``AutoTokenizer`` knows the special tokens and ``generate`` stops at the end token.

    Args:
        assets: the source checkpoint's text side (:func:`load_text_assets`).
        config_ids: the model config's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``
            (an int, a list of ints for ``eos_token_id``, or None).
        vocab_size: the model's vocabulary; a tokenizer id outside ``[0, vocab_size)`` is not used.
        model_max_length: ``tokenizer_config.json`` ``model_max_length`` (the model's context).
        copied: files (name -> text) taken over from the source as they are (an HF folder's
            tokenizer files); they win over generated ones.
        keep_tokenizer_config: True keeps a copied ``tokenizer_config.json`` as it is (an HF
            folder's own); False adds the keys it lacks (an mff run's).

    Returns:
        ``(ids, files)``: ``ids`` the token ids to set in ``config.json`` where ``config_ids``
        has None (``eos_token_id`` the first end token, ``bos_token_id`` / ``pad_token_id`` the
        ids of the tokenizer's BOS / pad tokens, when known); ``files`` the ``copied`` files plus
        ``tokenizer.json``, ``generation_config.json`` (``bos_token_id``, ``eos_token_id`` (the
        config's, then the tokenizer's end tokens; a list when several), ``pad_token_id``, as
        transformers writes them) and ``tokenizer_config.json`` (``tokenizer_class``
        PreTrainedTokenizerFast, ``bos_token`` / ``eos_token`` / ``pad_token``,
        ``model_max_length``, ``chat_template``) where the source gives the values.

    Raises:
        ValueError: a copied ``tokenizer_config.json`` that is not a JSON object.
    """
    tok = assets.tokenizer
    files = dict(copied or {})

    def token_id(text: str | None) -> int | None:
        tid = tok.token_to_id(text) if tok is not None and text is not None else None
        return tid if _is_id(tid, vocab_size) else None

    eos_all = _as_list(config_ids.get("eos_token_id"))
    eos_all += [i for i in assets.eos_ids if i not in eos_all and _is_id(i, vocab_size)]
    derived = {"bos_token_id": token_id(assets.bos_token), "eos_token_id": eos_all[0] if eos_all else None,
               "pad_token_id": token_id(assets.pad_token)}
    ids = {k: derived[k] for k in TOKEN_ID_KEYS if config_ids.get(k) is None and derived[k] is not None}
    final = {k: config_ids.get(k) if config_ids.get(k) is not None else ids.get(k) for k in TOKEN_ID_KEYS}
    gen: dict[str, Any] = {}
    if final["bos_token_id"] is not None:
        gen["bos_token_id"] = final["bos_token_id"]
    if eos_all:
        gen["eos_token_id"] = eos_all[0] if len(eos_all) == 1 else eos_all
    if final["pad_token_id"] is not None:
        gen["pad_token_id"] = final["pad_token_id"]
    if gen and "generation_config.json" not in files:
        files["generation_config.json"] = _json(gen)
    if tok is not None and "tokenizer.json" not in files:
        files["tokenizer.json"] = tok.to_str()
    if "tokenizer.json" in files and not (keep_tokenizer_config and "tokenizer_config.json" in files):
        tok_cfg: dict[str, Any] = {}
        if "tokenizer_config.json" in files:
            try:
                tok_cfg = json.loads(files["tokenizer_config.json"])
            except ValueError as e:
                raise ValueError(f"the source's tokenizer_config.json is not valid JSON: {e}") from None
            if not isinstance(tok_cfg, dict):
                raise ValueError(f"the source's tokenizer_config.json must hold a JSON object, got a {type(tok_cfg).__name__}")
        eos_text = assets.eos_token or next((t for t in map(lambda i: _special_text(tok, i), eos_all) if t is not None), None)
        add = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
               "bos_token": assets.bos_token or _special_text(tok, final["bos_token_id"]), "eos_token": eos_text,
               "pad_token": assets.pad_token or _special_text(tok, final["pad_token_id"]), "model_max_length": model_max_length,
               "chat_template": assets.chat_template or None}
        for key, value in add.items():
            if value is not None and tok_cfg.get(key) is None:
                tok_cfg[key] = value
        files["tokenizer_config.json"] = _json(tok_cfg)
    return ids, files
