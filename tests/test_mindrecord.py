"""MindRecord without MindSpore (issue 8, acceptance 4): the fixture MindSpore 2.10.0 wrote reads
back the rows in its expected.npz, mff's writer reproduces its bytes, multi-shard datasets read
from any shard, a folder or a glob, damaged files are refused, and pretraining runs (and resumes)
from MindRecord data."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from mff.data.config import DataConfig
from mff.data.megatron_source import SampleLoader, as_blend, batch_keys, build_megatron_data
from mff.data.mindrecord import (
    MindRecordDataset,
    MindRecordError,
    decode_int_array,
    encode_int_array,
    find_shards,
    is_mindrecord,
)
from mff.data.mindrecord_source import MindRecordTokens, PackedRows
from mff.data.mindrecord_writer import write_mindrecord
from tests.cli_util import ROOT, run_cli, tiny_args
from tests.data_util import write_indexed

FIXTURE = ROOT / "tests" / "data" / "mindrecord"
FILE = FIXTURE / "tiny_pretrain.mindrecord"
# the fixture's schema as its README states it (MindSpore FileWriter.add_schema)
SCHEMA = {"input_ids": {"type": "int32", "shape": [-1]}, "labels": {"type": "int64", "shape": [-1]},
          "text": {"type": "string"}, "score": {"type": "float32"}}


def _expected_rows() -> list[dict]:
    """The fixture's rows from expected.npz; labels, text and score as the fixture was made
    (labels = input_ids, text "sample i", score i / 2)."""
    exp = np.load(FIXTURE / "expected.npz")
    return [{"input_ids": exp[f"input_ids_{i}"], "labels": exp[f"input_ids_{i}"].astype(np.int64), "text": f"sample {i}",
             "score": 0.5 * i} for i in range(5)]


def test_fixture_reads_back_expected_rows():
    ds = MindRecordDataset(str(FILE))
    assert len(ds) == 5 and ds.schema == SCHEMA
    for i, want in enumerate(_expected_rows()):
        row = ds[i]
        assert row["input_ids"].dtype == np.int32 and np.array_equal(row["input_ids"], want["input_ids"])
        assert row["labels"].dtype == np.int64 and np.array_equal(row["labels"], want["labels"])
        assert row["text"] == want["text"] and isinstance(row["text"], str)
        assert row["score"].dtype == np.float32 and row["score"] == want["score"]
        assert ds.read(i, ["score"]) == {"score": want["score"]}
    assert ds.array_lengths("input_ids").tolist() == [9] * 5
    assert ds[-1]["text"] == "sample 4"
    with pytest.raises(IndexError, match="row 5 out of range for 5 rows"):
        ds.read(5)


def test_compressed_integer_layout():
    # row 0's input_ids payload as it lies in the fixture (hexdump at byte 65552): count 9, width
    # codes 01 x 8 then 00 (2 bytes: 225 does not fit int8), little-endian values
    payload = bytes.fromhex("00000009" "555500" "b003" "7102" "ac02" "8103" "4202" "0703" "4103" "e100" "37")
    assert decode_int_array(payload, np.int32).tolist() == [944, 625, 684, 897, 578, 775, 833, 225, 55]
    assert encode_int_array([944, 625, 684, 897, 578, 775, 833, 225, 55]) == payload
    # one value of each width: codes 00 01 10 11 = 0x1b, then 1, 2, 4 and 8 bytes, two's complement
    got = encode_int_array([-1, 300, -70000, 2**40])
    assert got == bytes.fromhex("00000004" "1b" "ff" "2c01" "90eefeff" "0000000000010000")
    assert decode_int_array(got, np.int64).tolist() == [-1, 300, -70000, 2**40]
    edges = [-128, 127, 128, -129, 32767, -32768, 32768, 2**31 - 1, -(2**31), 2**31, -(2**63), 2**63 - 1, 0]
    assert decode_int_array(encode_int_array(edges), np.int64).tolist() == edges
    assert decode_int_array(encode_int_array([]), np.int32).size == 0
    with pytest.raises(MindRecordError, match="takes 8 bytes by its width codes, the payload has 7"):
        decode_int_array(encode_int_array([1, 300])[:-1], np.int32)


def test_writer_reproduces_the_fixture(tmp_path):
    out = write_mindrecord(str(tmp_path / "tiny_pretrain.mindrecord"), _expected_rows(), SCHEMA, index_fields=["score"],
                           desc="tiny_pretrain", page_size=1 << 16, header_size=1 << 16)
    assert out == [str(tmp_path / "tiny_pretrain.mindrecord")]
    assert (tmp_path / "tiny_pretrain.mindrecord").read_bytes() == FILE.read_bytes()

    def tables(path):
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return {name: (sql, sorted(con.execute(f"SELECT * FROM {name}"))) for name, sql in
                    con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()

    assert tables(tmp_path / "tiny_pretrain.mindrecord.db") == tables(FIXTURE / "tiny_pretrain.mindrecord.db")
    assert not list(tmp_path.glob("*.tmp-*"))


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(-5, 70000, rng.integers(0, 30)).astype(np.int64), "weights": rng.random(3).astype(np.float32),
             "raw": bytes(rng.integers(0, 256, rng.integers(0, 5)).astype(np.uint8)), "name": f"doc {i} é", "n": int(i) - 3,
             "w": float(i) * 0.1} for i in range(n)]


MIXED = {"input_ids": {"type": "int64", "shape": [-1]}, "weights": {"type": "float32", "shape": [3]}, "raw": {"type": "bytes"},
         "name": {"type": "string"}, "n": {"type": "int32"}, "w": {"type": "float64"}}


def _same(got: dict, want: dict, schema: dict) -> None:
    assert set(got) == set(schema)
    for k, v in want.items():
        if schema[k].get("shape"):
            assert got[k].dtype == np.dtype(schema[k]["type"]) and np.array_equal(got[k], np.asarray(v, schema[k]["type"])), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("schema", [MIXED, {"input_ids": {"type": "int32", "shape": [-1]}}], ids=["mixed", "one-blob-field"])
def test_multi_shard_dataset_from_any_shard_folder_or_glob(tmp_path, schema):
    rows = [{k: r[k] if k != "input_ids" or schema[k]["type"] == "int64" else r[k].astype(np.int32) for k in schema} for r in _rows(23)]
    # 256-byte pages: many row groups, blob pages and raw pages holding several groups
    paths = write_mindrecord(str(tmp_path / "d" / "x.mindrecord"), rows, schema, shard_num=3, page_size=256, header_size=1 << 14)
    assert [Path(p).name for p in paths] == ["x.mindrecord0", "x.mindrecord1", "x.mindrecord2"]
    for spec in (paths[1], str(tmp_path / "d"), str(tmp_path / "d" / "x.mindrecord*")):
        assert find_shards(spec) == [paths]
        ds = MindRecordDataset(spec)
        assert [len(s) for s in ds.shards] == [8, 8, 7] and [s.shard_id for s in ds.shards] == [0, 1, 2]
        assert sum(1 for s in ds.shards for p in s.pages if p.kind == "BLOB_DATA") > 3
        for i, want in enumerate(rows):
            _same(ds[i], want, schema)
        assert ds.array_lengths("input_ids").tolist() == [len(r["input_ids"]) for r in rows]
    assert all(is_mindrecord(p) for p in paths) and is_mindrecord(str(tmp_path / "d"))
    Path(paths[2]).unlink()
    with pytest.raises(FileNotFoundError, match=r"shard 2 of 3 \(.*x\.mindrecord2\) is missing"):
        MindRecordDataset(paths[0])


def test_bad_files_are_refused_clearly(tmp_path):
    data = FILE.read_bytes()
    (tmp_path / "cut.mindrecord").write_bytes(data[:-10])
    with pytest.raises(MindRecordError, match=r"cut.mindrecord is truncated: it has 131232 bytes but page 1 \(RAW_DATA, 170 bytes used\) ends at byte 131242"):
        MindRecordDataset(str(tmp_path / "cut.mindrecord"))
    (tmp_path / "short.mindrecord").write_bytes(data[:5])
    with pytest.raises(MindRecordError, match="too short for a MindRecord file"):
        MindRecordDataset(str(tmp_path / "short.mindrecord"))
    (tmp_path / "head.mindrecord").write_bytes(data[:400])
    with pytest.raises(MindRecordError, match="the header length field says 744 bytes but the file has 392"):
        MindRecordDataset(str(tmp_path / "head.mindrecord"))
    bad = bytearray(data)
    bad[8:9] = b"["
    (tmp_path / "json.mindrecord").write_bytes(bytes(bad))
    with pytest.raises(MindRecordError, match="header is not JSON"):
        MindRecordDataset(str(tmp_path / "json.mindrecord"))
    text = data[8:8 + 744].replace(b'"page_size":65536,', b'"page_sizx":65536,')
    (tmp_path / "keys.mindrecord").write_bytes(data[:8] + text + data[8 + 744:])
    with pytest.raises(MindRecordError, match=r"header lacks \['page_size'\]"):
        MindRecordDataset(str(tmp_path / "keys.mindrecord"))
    # a row length that runs past its page
    bad = bytearray(data)
    bad[65536:65538] = (400).to_bytes(2, "little")
    (tmp_path / "row.mindrecord").write_bytes(bytes(bad))
    with pytest.raises(MindRecordError, match="a row of 400 bytes at byte 0 of page 0 .BLOB_DATA. runs past the page's 364 used bytes"):
        MindRecordDataset(str(tmp_path / "row.mindrecord"))[0]
    ds = MindRecordDataset(str(FILE))
    with pytest.raises(MindRecordError, match="no field 'tokens' in the schema; it has input_ids .int32 .-1.., labels"):
        ds.read(0, ["tokens"])
    with pytest.raises(MindRecordError, match="no field 'tokens'"):
        MindRecordTokens(str(FILE), "tokens")
    with pytest.raises(MindRecordError, match="field 'text' is .*expected an int32/int64 array"):
        MindRecordTokens(str(FILE), "text")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MindRecordDataset(str(tmp_path / "nope.mindrecord"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*.mindrecord files in the folder"):
        MindRecordDataset(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"row 0 has fields .* \(missing \['score'\]\)"):
        write_mindrecord(str(tmp_path / "w.mindrecord"), [{"input_ids": [1], "labels": [1], "text": "a"}], SCHEMA)
    # 512 two-byte values: 4 + 128 bitmap + 1024 value bytes, after the 8-byte row length
    with pytest.raises(ValueError, match="row 0 needs 1164 bytes in a page, more than page_size 256"):
        write_mindrecord(str(tmp_path / "w.mindrecord"), [{"input_ids": list(range(300, 812))}], {"input_ids": {"type": "int32", "shape": [-1]}},
                         page_size=256)
    assert not list(tmp_path.glob("w.mindrecord*"))


def test_variable_rows_give_megatron_samples(tmp_path):
    docs = [list(range(10 * k + 1, 10 * k + 1 + n)) + [0] for k, n in enumerate([3, 7, 1, 12, 5, 2, 9, 4, 6, 8])]
    write_indexed(tmp_path / "ref", docs)
    write_mindrecord(str(tmp_path / "mr" / "d.mindrecord"), [{"input_ids": np.array(d, np.int32)} for d in docs],
                     {"input_ids": {"type": "int32", "shape": [-1]}}, shard_num=2, page_size=128, header_size=1 << 14)
    cfg = DataConfig(split="8,2,0", eod_id=0, reset_position_ids=True, eod_mask_loss=True)
    out = {}
    for name, path in (("ref", str(tmp_path / "ref")), ("mr", str(tmp_path / "mr"))):
        c = DataConfig(**{**cfg.__dict__, "path": (path,)})
        out[name] = build_megatron_data(c, as_blend(c.path), seq_len=6, seed=5, train_samples=20, quiet=True)
    ref, mr = out["ref"], out["mr"]
    assert not isinstance(mr.train, PackedRows) and len(mr.train) == len(ref.train) >= 20 and len(mr.val) == len(ref.val) > 0
    for a, b in ((ref.train, mr.train), (ref.val, mr.val)):
        for i in range(len(a)):
            for k, v in a[i].items():
                assert np.array_equal(v, b[i][k]), (i, k)
    assert mr.stats["documents"] == 10 and mr.stats["tokens"] == ref.stats["tokens"]
    # a blend mixing MindRecord and .bin/.idx data
    blend = as_blend(["0.5", str(tmp_path / "mr" / "d.mindrecord1"), "0.5", str(tmp_path / "ref")])
    mixed = build_megatron_data(DataConfig(split="1,0,0"), blend, seq_len=6, seed=5, train_samples=8, quiet=True)
    assert len(mixed.train) == 8 and mixed.train[0]["input_ids"].shape == (6,)


def test_packed_rows_are_samples_and_resume_exactly(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "mr")
    cfg = DataConfig(path=(str(tmp_path / "mr" / "tiny_pretrain.mindrecord"),), split="1,0,0")
    rows = [r["input_ids"].astype(np.int64) for r in _expected_rows()]

    def build():
        return build_megatron_data(cfg, as_blend(cfg.path), seq_len=8, seed=3, train_samples=7, quiet=True)

    data = build()
    assert isinstance(data.train, PackedRows) and len(data.train) == 10  # 7 samples need 2 epochs of 5 rows
    seen = []
    for i in range(10):
        s = data.train[i]
        whole = np.concatenate([s["input_ids"], s["labels"][-1:]])
        assert np.array_equal(s["labels"][:-1], s["input_ids"][1:])
        seen.append(next(k for k, r in enumerate(rows) if np.array_equal(r, whole)))
    assert sorted(seen[:5]) == sorted(seen[5:]) == [0, 1, 2, 3, 4] and seen[:5] != seen[5:]
    ref = SampleLoader(data.train, 2, batch_keys(cfg))
    stream = [ref.next_batch()["input_ids"].tolist() for _ in range(7)]  # wraps past the 10 built samples
    got, state = [], None
    for stop in (2, 5, 7):
        ld = SampleLoader(build().train, 2, batch_keys(cfg))
        if state is not None:
            ld.load_state_dict(state)
        while len(got) < stop:
            got.append(ld.next_batch()["input_ids"].tolist())
        state = json.loads(json.dumps(ld.state_dict()))
    assert got == stream


def _cli_args(path: str) -> list[str]:
    args = tiny_args(ROOT)
    i = args.index("--data.vocab-size")
    del args[i:i + 2]
    args[args.index("--data.path") + 1] = path
    args[args.index("--model.vocab-size") + 1] = "1024"  # the fixture's ids reach 995
    args[args.index("--seq-len") + 1] = "8"  # rows of 9 tokens: one sample each
    args[args.index("--batch-size") + 1] = "2"
    return args + ["--optim.warmup-steps", "1", "--steps", "3"]


def _records(path: Path):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def test_pretrain_from_the_fixture_trains_and_resumes(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "mr")
    args = _cli_args(str(tmp_path / "mr" / "tiny_pretrain.mindrecord"))
    full = run_cli(args + ["--ckpt-dir", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], tmp_path / "cache", timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "MindRecord data" in full.stdout and "5 rows, 45 tokens" in full.stdout and "10 train samples" in full.stdout
    a = _records(tmp_path / "a.jsonl")
    assert [x[0] for x in a] == [1, 2, 3] and all(np.isfinite(x[1]) for x in a) and a[2][1] < a[0][1]
    # the same data named by its folder: stop after step 1, then rerun to the end
    args = _cli_args(str(tmp_path / "mr"))
    for extra in (["--stop-after", "1"], []):
        r = run_cli(args + extra + ["--ckpt-dir", str(tmp_path / "b"), "--metrics-file", str(tmp_path / "b.jsonl")], tmp_path / "cache",
                    timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and _records(tmp_path / "b.jsonl") == a


def test_pretrain_names_a_missing_token_field(tmp_path):
    write_mindrecord(str(tmp_path / "t.mindrecord"), [{"tokens": [1, 2, 3]}], {"tokens": {"type": "int32", "shape": [-1]}}, header_size=1 << 14,
                     page_size=1 << 15)
    r = run_cli(_cli_args(str(tmp_path / "t.mindrecord")) + ["--ckpt-dir", str(tmp_path / "c")], tmp_path / "cache", timeout=600)
    assert r.returncode == 2 and "no field 'input_ids' in the schema; it has tokens (int32 [-1])" in r.stderr
