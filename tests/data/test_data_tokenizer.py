import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mff.data import (
    discover_files,
    encode_documents,
    find_eod_id,
    load_tokenizer,
    read_documents,
    token_dtype,
    train_bpe,
)

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓ 🚀\n", "the cat sat on the mat " * 20]


def test_trained_bpe_round_trip_and_eod_zero():
    tok = train_bpe(TEXTS, vocab_size=300)
    assert tok.get_vocab_size() == 300
    assert find_eod_id(tok, None) == 0 == tok.token_to_id("<|endoftext|>")
    for text in TEXTS + ["unseen text: 日本語 \t\r\n  spaces", " leading space"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(TEXTS, vocab_size=200)


def test_bpe_on_stdlib_subset_round_trip():
    files, _ = discover_files([])
    docs, _ = read_documents(files[:40])
    tok = train_bpe([d.text for d in docs], vocab_size=512)
    assert tok.get_vocab_size() == 512
    text = docs[0].text[:2000]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text.encode()) / 1.5  # merges were learned
    assert tok.decode(ids) == text


def test_encode_documents_appends_eod():
    tok = train_bpe(TEXTS, vocab_size=300)
    out = encode_documents(tok, ["ab", "", "cd"], eod_id=0, dtype=np.uint16, batch_bytes=1)
    want = (tok.encode("ab", add_special_tokens=False).ids + [0] + [0]
            + tok.encode("cd", add_special_tokens=False).ids + [0])
    assert out.dtype == np.uint16 and out.tolist() == want
    assert encode_documents(tok, [], 0).shape == (0,)


def test_token_dtype():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def wordlevel(tmp_path, specials):
    vocab = {"<unk>": 0, "a": 1, "b": 2}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_eod_detected_from_special_tokens(tmp_path):
    tok = load_tokenizer(wordlevel(tmp_path, ["<pad>", "</s>"]))
    assert find_eod_id(tok, None) == 4
    assert find_eod_id(tok, "<pad>") == 3


def test_eod_detection_prefers_candidate_order(tmp_path):
    tok = load_tokenizer(wordlevel(tmp_path, ["</s>", "<|endoftext|>"]))
    assert find_eod_id(tok, None) == 4


def test_eod_errors(tmp_path):
    tok = load_tokenizer(wordlevel(tmp_path, ["<pad>"]))
    with pytest.raises(ValueError, match="no end-of-document token"):
        find_eod_id(tok, None)
    with pytest.raises(ValueError, match="'<sep>' is not in the tokenizer"):
        find_eod_id(tok, "<sep>")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(str(bad))
