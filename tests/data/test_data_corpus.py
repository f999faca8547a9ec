import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mff.data import (
    Document,
    discover_files,
    is_validation,
    read_documents,
    split_documents,
    stdlib_root,
)

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# SHA-1 based bucket (first 8 digest bytes, big endian, mod 1000) of fixed keys
BUCKETS = {"a.txt": 178, "b.txt": 564, "docs/x.txt": 39, "data.jsonl:1": 578, "asyncio/tasks.py": 132}


def test_stable_hash_split_fixed_keys():
    for key, bucket in BUCKETS.items():
        assert not is_validation(key, bucket)
        assert is_validation(key, bucket + 1)
    assert [k for k in (f"doc{i}.txt" for i in range(200)) if is_validation(k, 20)] == [
        "doc86.txt", "doc165.txt", "doc167.txt"]
    assert not any(is_validation(k, 0) for k in BUCKETS)
    assert all(is_validation(k, 1000) for k in BUCKETS)


def test_split_independent_of_pythonhashseed():
    code = (
        "from mff.data import is_validation;"
        f"print([is_validation(k, b + 1) for k, b in {BUCKETS!r}.items()], hash('a.txt'))"
    )
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.split("] "))
    assert outs[0][0] == outs[1][0] == str([True] * len(BUCKETS))[:-1]
    assert outs[0][1] != outs[1][1]  # the builtin hash really did change


def test_discover_sorted_relative_posix_paths(tmp_path):
    write(tmp_path / "c" / "z.txt", "z")
    write(tmp_path / "b.jsonl", '{"text": "j"}\n')
    write(tmp_path / "a.txt", "a")
    write(tmp_path / "skip.md", "not a corpus file")
    single = write(tmp_path.parent / f"{tmp_path.name}_one.txt", "one")
    files, roots = discover_files([str(tmp_path), str(single)])
    assert [(f.rel, f.kind) for f in files] == [
        ("a.txt", "text"), ("b.jsonl", "jsonl"), ("c/z.txt", "text"), (single.name, "text")]
    assert roots == [str(tmp_path), str(single)]
    assert files[0].size == 1 and files[0].mtime_ns > 0


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        discover_files([str(tmp_path / "nope.txt")])


def test_unsupported_file_type(tmp_path):
    with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
        discover_files([str(write(tmp_path / "x.csv", "a,b"))])


def test_read_jsonl_keys_and_non_utf8_skipped(tmp_path):
    write(tmp_path / "d.jsonl", '{"text": "first"}\n\n{"text": "", "x": 1}\n{"body": "b", "text": "fourth\\u2028x"}\n')
    write(tmp_path / "bad.txt", b"\xff\xfe not utf-8")
    write(tmp_path / "e.txt", "")
    files, _ = discover_files([str(tmp_path)])
    docs, skipped = read_documents(files)
    assert skipped == 1
    assert docs == [Document("d.jsonl:1", "first"), Document("d.jsonl:4", "fourth\u2028x")]


@pytest.mark.parametrize(
    "line, why",
    [("not json", "not valid JSON"), ('{"body": "x"}', "no 'text' field"), ('{"text": 3}', "field 'text' is int, not a string"),
     ("[1, 2]", "no 'text' field")],
)
def test_jsonl_error_names_file_and_line(tmp_path, line, why):
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"text": "ok"}\n' + line + "\n")
    files, _ = discover_files([str(path)])
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: {why}"):
        read_documents(files)


def test_jsonl_custom_field(tmp_path):
    path = write(tmp_path / "d.jsonl", json.dumps({"content": "hi"}) + "\n")
    files, _ = discover_files([str(path)])
    assert read_documents(files, "content")[0] == [Document("d.jsonl:1", "hi")]


def test_split_keeps_order_and_fallbacks():
    docs = [Document(f"doc{i}.txt", f"t{i}") for i in range(200)]
    train, val = split_documents(docs, 20)
    assert [d.key for d in val] == ["doc86.txt", "doc165.txt", "doc167.txt"]
    assert len(train) == 197 and train[0].key == "doc0.txt"
    # nothing hashes into val: the last document moves there
    train, val = split_documents(docs[:3], 0)
    assert [d.key for d in val] == ["doc2.txt"] and [d.key for d in train] == ["doc0.txt", "doc1.txt"]
    # everything hashes into val: the first document stays in train
    train, val = split_documents(docs[:3], 1000)
    assert [d.key for d in train] == ["doc0.txt"] and [d.key for d in val] == ["doc1.txt", "doc2.txt"]


def test_split_errors():
    with pytest.raises(ValueError, match="empty corpus"):
        split_documents([], 20)
    with pytest.raises(ValueError, match="single document"):
        split_documents([Document("a.txt", "x")], 20)
    with pytest.raises(ValueError, match="0..1000"):
        split_documents([Document("a.txt", "x"), Document("b.txt", "y")], 1001)


def test_default_corpus_is_stdlib_py_files():
    files, roots = discover_files([])
    root = stdlib_root()
    assert roots == [root]
    rels = [f.rel for f in files]
    assert rels == sorted(rels)
    assert "os.py" in rels and "json/__init__.py" in rels
    assert all(r.endswith(".py") and "\\" not in r for r in rels)
    assert not any(p in ("site-packages", "dist-packages") for r in rels for p in r.split("/"))
    assert all(f.kind == "text" and os.path.isfile(f.path) for f in files[:20])
    assert len(files) > 500
    assert not is_validation("os.py", 20)  # bucket 429
    assert is_validation("asyncio/tasks.py", 133)
