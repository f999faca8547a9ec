"""MindSpore .ckpt and MindSpore/MindFormers safetensors without MindSpore.

References: files written by MindSpore 2.10.0's save_checkpoint (tests/data/mindspore/; the
format is described in docs/mindformers_formats.md §2) with their tensors in expected.npz and
append_dict.json, and protobuf's own parser / serializer for the record framing."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mff.ckpt import mindspore as ms
from mff.ckpt.mindspore import (
    Checkpoint,
    MapTensorProto,
    MindSporeCheckpointError,
    TensorProto,
    ckpt_names,
    is_mindspore_ckpt,
    iter_ckpt,
    open_mindformers_safetensors,
    read_ckpt,
    read_ms_safetensors,
    write_ckpt,
)

DATA = Path(__file__).parent / "data" / "mindspore"
EXPECTED = np.load(DATA / "expected.npz")
APPEND = json.loads((DATA / "append_dict.json").read_text())["append_dict"]
BF16 = "__bf16_bits_uint16"
# expected.npz also holds two tensors of a chunked-tensor fixture that was not shipped
NOT_IN_FILES = {"big.sliced.weight", "small.bias"}


def expected_names() -> set[str]:
    return {k.split("__")[0] for k in EXPECTED.files} - NOT_IN_FILES


def assert_matches_expected(name: str, t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        want = EXPECTED[name + BF16]
        assert t.shape == want.shape
        assert np.array_equal(t.view(torch.uint16).numpy(), want), name
        np.testing.assert_array_equal(t.float().numpy(), EXPECTED[name + "__as_float32"])
    else:
        want = EXPECTED[name]
        got = t.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
        assert got.tobytes() == want.tobytes(), name


@pytest.fixture(params=["protobuf", "by-hand"])
def record_path(request, monkeypatch):
    """Run a test with small records parsed by protobuf (default) and with every record walked by hand."""
    if request.param == "by-hand":
        monkeypatch.setattr(ms, "SMALL_RECORD", 0)
    return request.param


# ---------------------------------------------------------------- fixtures written by MindSpore

@pytest.mark.parametrize("fname", ["dtypes.ckpt", "dtypes_crc.ckpt"])
def test_fixture_tensors_bit_exact(fname, record_path):
    got = read_ckpt(DATA / fname, verify_crc=fname == "dtypes_crc.ckpt")
    tensors = {k: v for k, v in got.items() if k not in APPEND}
    assert set(tensors) == expected_names()
    for name, t in tensors.items():
        assert_matches_expected(name, t)
    assert got["global_step"].shape == () and got["loss_scale"].shape == ()
    if fname == "dtypes.ckpt":  # append_dict entries come back as metadata, in save order at the end
        assert list(got)[-len(APPEND):] == list(APPEND)
        for k, v in APPEND.items():
            if isinstance(v, str):
                assert got[k] == v
            else:
                assert got[k].dtype == torch.int64 and got[k].shape == () and got[k].item() == v


def test_hand_walk_is_used_for_big_records(tmp_path, monkeypatch):
    """With every record "big", MindSpore-layout records never reach the protobuf parser."""
    monkeypatch.setattr(ms, "SMALL_RECORD", 0)
    monkeypatch.setattr(ms, "SLICE_BYTES", 64)

    def refuse(*a):
        raise AssertionError("protobuf path taken")

    monkeypatch.setattr(ms, "_parse_small", refuse)
    write_ckpt(tmp_path / "c.ckpt", all_dtypes(), metadata={"s": "text"})
    for path in (DATA / "dtypes.ckpt", DATA / "dtypes_crc.ckpt", tmp_path / "c.ckpt"):
        assert read_ckpt(path, verify_crc=path.name == "dtypes_crc.ckpt")
        assert ckpt_names(path)
    back = read_ckpt(tmp_path / "c.ckpt")
    assert all(same(back[k], v) for k, v in all_dtypes().items()) and back["s"] == "text"


def test_iter_ckpt_order_and_names():
    entries = list(iter_ckpt(DATA / "dtypes.ckpt"))
    names = ckpt_names(DATA / "dtypes.ckpt")
    assert [k for k, _ in entries] == [n for n, _, _ in names]
    for (_, v), (_, ttype, shape) in zip(entries, names):
        if ttype == "str":
            assert isinstance(v, str) and shape == ()
        else:
            assert ms.MS_DTYPES[ttype] == v.dtype and tuple(v.shape) == shape
    assert dict((n, t) for n, t, _ in names)["model.layers.1.input_layernorm.weight"] == "BFloat16"


def test_read_selected_names():
    got = read_ckpt(DATA / "dtypes_crc.ckpt", verify_crc=True, names={"mask.bool", "lr_note"})
    assert list(got) == ["mask.bool"]
    assert_matches_expected("mask.bool", got["mask.bool"])


def test_ms_safetensors_fixture():
    got = read_ms_safetensors(DATA / "dtypes.safetensors")
    assert set(got) == expected_names()
    for name, t in got.items():
        assert_matches_expected(name, t)
    assert ms.is_ms_safetensors(DATA / "dtypes.safetensors")
    assert not ms.is_ms_safetensors(DATA / "dtypes.ckpt")


def test_detection():
    assert is_mindspore_ckpt(DATA / "dtypes.ckpt") and is_mindspore_ckpt(DATA / "dtypes_crc.ckpt")
    assert not is_mindspore_ckpt(DATA / "dtypes_encrypted_aesgcm.ckpt")
    assert not is_mindspore_ckpt(DATA / "dtypes.safetensors")
    assert not is_mindspore_ckpt(DATA / "missing.ckpt")


# ---------------------------------------------------------------- CRC and encryption

def test_crc_flipped_byte_is_reported(tmp_path, record_path):
    raw = bytearray((DATA / "dtypes_crc.ckpt").read_bytes())
    pos = raw.index(b"Float32") + len(b"Float32") + 2 + 5  # inside q_proj.weight's content
    raw[pos] ^= 0x01
    bad = tmp_path / "flipped.ckpt"
    bad.write_bytes(bytes(raw))
    read_ckpt(bad)  # without verification the damage is invisible
    with pytest.raises(MindSporeCheckpointError, match=r"flipped\.ckpt: CRC mismatch.*damaged"):
        read_ckpt(bad, verify_crc=True)


def test_verify_crc_without_trailer():
    with pytest.raises(MindSporeCheckpointError, match="no CRC trailer"):
        read_ckpt(DATA / "dtypes.ckpt", verify_crc=True)


def test_encrypted_file_refused():
    with pytest.raises(MindSporeCheckpointError, match=r"dtypes_encrypted_aesgcm\.ckpt is encrypted.*AES-GCM.*decrypt it with MindSpore"):
        read_ckpt(DATA / "dtypes_encrypted_aesgcm.ckpt")
    with pytest.raises(ValueError, match="encrypted"):  # MindSporeCheckpointError is a ValueError
        ckpt_names(DATA / "dtypes_encrypted_aesgcm.ckpt")


# ---------------------------------------------------------------- writer

def all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "w.f32": torch.randn(3, 4, generator=g),
        "w.f16": torch.randn(2, 3, 4, generator=g).half(),
        "w.bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "w.f64": torch.randn(7, generator=g).double(),
        "w.bool": torch.tensor([True, False, True]),
        "scalar.f32": torch.tensor(0.25),
        "scalar.i64": torch.tensor(-3, dtype=torch.int64),
        "empty.f32": torch.zeros(0),
        "empty.2d": torch.zeros(2, 0, dtype=torch.int32),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }
    for dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dt)
        out[f"w.{dt}"] = torch.tensor([info.min, -1 if info.min else 1, 0, info.max], dtype=dt)
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        out[f"w.{dt}"] = torch.tensor([0, 1, 255], dtype=torch.int64).to(dt)
    return out


def same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def records_by_protobuf(path: Path) -> list:
    """The records as protobuf parses the whole (small) file: one Checkpoint, records merged."""
    data = path.read_bytes()
    if data[-17:-10] == b"crc_num":
        data = data[:-17]
    return list(Checkpoint.FromString(data).value)


def test_round_trip_all_dtypes(tmp_path, record_path):
    tensors = all_dtypes()
    meta = {"epoch_num": 7, "lr_note": "cosine warmup", "loss_scale": 1024.0, "flag": True, "unicode": "λ→ü", "blank": ""}
    path = tmp_path / "rt.ckpt"
    n = write_ckpt(path, tensors, metadata=meta, crc=True)
    assert n == path.stat().st_size
    back = read_ckpt(path, verify_crc=True)
    assert list(back) == list(tensors) + list(meta)
    for k, t in tensors.items():
        assert same(back[k], t), k
    assert back["epoch_num"].dtype == torch.int64 and back["epoch_num"].item() == 7
    assert back["loss_scale"].dtype == torch.float32 and back["loss_scale"].item() == 1024.0
    assert back["flag"].dtype == torch.bool and back["flag"].item() is True
    assert back["lr_note"] == "cosine warmup" and back["unicode"] == "λ→ü" and back["blank"] == ""
    # independent check of the framing: protobuf parses the file and re-serializes it to the same bytes
    recs = records_by_protobuf(path)
    assert [r.tag for r in recs] == list(back)
    assert b"".join(Checkpoint(value=[r]).SerializeToString() for r in recs) == path.read_bytes()[:-17]
    by_tag = {r.tag: r.tensor for r in recs}
    assert by_tag["lr_note"].tensor_type == "str" and list(by_tag["lr_note"].dims) == [0]
    assert by_tag["lr_note"].tensor_content == np.array("cosine warmup").tobytes()  # numpy U<n>, as MindSpore writes
    assert list(by_tag["scalar.f32"].dims) == [] and by_tag["w.bf16"].tensor_type == "BFloat16"


def test_chunked_tensor(tmp_path, monkeypatch, record_path):
    monkeypatch.setattr(ms, "SLICE_BYTES", 1024)
    big = torch.randn(50, 30, generator=torch.Generator().manual_seed(1))  # 6000 bytes -> 6 records
    tensors = {"a": torch.arange(10.0), "big": big, "bf": big.bfloat16(), "z": torch.ones(256)}  # z: exactly 1024 bytes
    path = tmp_path / "chunked.ckpt"
    write_ckpt(path, tensors)
    recs = records_by_protobuf(path)
    assert [r.tag for r in recs] == ["a"] + ["big"] * 6 + ["bf"] * 3 + ["z"]
    assert all(list(r.tensor.dims) == [50, 30] for r in recs if r.tag == "big")
    assert b"".join(r.tensor.tensor_content for r in recs if r.tag == "big") == big.numpy().tobytes()
    back = read_ckpt(path)
    assert list(back) == list(tensors)
    assert all(same(back[k], v) for k, v in tensors.items())
    assert ckpt_names(path) == [("a", "Float32", (10,)), ("big", "Float32", (50, 30)), ("bf", "BFloat16", (50, 30)), ("z", "Float32", (256,))]
    assert list(read_ckpt(path, names={"z"})) == ["z"]


def test_streamed_input(tmp_path):
    """An iterator of (name, callable) pairs: tensors are produced while writing."""
    made = []

    def make(i):
        def f():
            made.append(i)
            return torch.full((4,), float(i))
        return f

    pairs = ((f"t{i}", make(i)) for i in range(3))
    write_ckpt(tmp_path / "s.ckpt", pairs)
    assert made == [0, 1, 2]
    back = read_ckpt(tmp_path / "s.ckpt")
    assert [v[0].item() for v in back.values()] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("fname", ["dtypes.ckpt", "dtypes_crc.ckpt"])
def test_fixture_rewrite_is_byte_identical(tmp_path, fname):
    entries = read_ckpt(DATA / fname)
    out = tmp_path / fname
    write_ckpt(out, entries, crc=fname == "dtypes_crc.ckpt")
    assert out.read_bytes() == (DATA / fname).read_bytes()


def test_write_errors_leave_no_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="folder .*nope does not exist"):
        write_ckpt(tmp_path / "nope" / "x.ckpt", {"a": torch.ones(2)})

    def boom():
        raise RuntimeError("producer failed")

    cases = [
        ({"a": torch.ones(2), "b": boom}, RuntimeError, "producer failed"),
        ({"a": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)}, MindSporeCheckpointError, "complex64 has no MindSpore"),
        ([("a", torch.ones(2)), ("a", torch.ones(2))], MindSporeCheckpointError, "'a' is given twice"),
        ({"a": [1.0, 2.0]}, MindSporeCheckpointError, "expected a torch.Tensor"),
    ]
    for tensors, err, msg in cases:
        with pytest.raises(err, match=msg):
            write_ckpt(tmp_path / "x.ckpt", tensors)
        assert list(tmp_path.iterdir()) == [], msg
    with pytest.raises(MindSporeCheckpointError, match="metadata 'm'"):
        write_ckpt(tmp_path / "x.ckpt", {"a": torch.ones(2)}, metadata={"m": [1]})
    assert list(tmp_path.iterdir()) == []


def test_write_replaces_existing(tmp_path):
    path = tmp_path / "x.ckpt"
    write_ckpt(path, {"a": torch.ones(2)})
    write_ckpt(path, {"b": torch.zeros(3)})
    assert list(read_ckpt(path)) == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]


# ---------------------------------------------------------------- bad input

def one_record(tag: str, dims, ttype: str, content: bytes) -> bytes:
    c = Checkpoint()
    c.value.add(tag=tag, tensor=TensorProto(dims=dims, tensor_type=ttype, tensor_content=content))
    return c.SerializeToString()


def test_truncated_file(tmp_path, record_path):
    raw = (DATA / "dtypes.ckpt").read_bytes()
    for cut in (0x50, 3, len(raw) - 1):  # inside the first tensor's data, inside the first header, in the last record
        bad = tmp_path / f"cut{cut}.ckpt"
        bad.write_bytes(raw[:cut])
        with pytest.raises(MindSporeCheckpointError, match=rf"cut{cut}\.ckpt: truncated.*\(at byte \d+\)"):
            read_ckpt(bad)
    with pytest.raises(MindSporeCheckpointError, match=r"cut80\.ckpt: truncated"):
        ckpt_names(tmp_path / "cut80.ckpt")


def test_garbage_and_empty(tmp_path, record_path):
    rnd = random.Random(0)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(bytes(rnd.randrange(256) for _ in range(4096)))
    with pytest.raises(MindSporeCheckpointError, match=r"junk\.ckpt is not a MindSpore checkpoint.*at byte 0"):
        read_ckpt(junk)
    # a valid record followed by garbage: the bad byte's offset is named
    good = one_record("a", [2], "Float32", b"\0" * 8)
    tail = tmp_path / "tail.ckpt"
    tail.write_bytes(good + b"\x55garbage")
    with pytest.raises(MindSporeCheckpointError, match=rf"tail\.ckpt: expected a record .*found 0x55.*\(at byte {len(good)}\)"):
        read_ckpt(tail)
    # a record whose Value is not a protobuf message
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"\x0a\x04\xff\xff\xff\xff")
    with pytest.raises(MindSporeCheckpointError, match=r"broken\.ckpt: .*\(at byte 0\)"):
        read_ckpt(broken)
    partial = ms.Value(tag="a")
    partial.tensor.tensor_type = "Float32"
    raw = partial.SerializePartialToString()
    (tmp_path / "req.ckpt").write_bytes(b"\x0a" + bytes([len(raw)]) + raw)
    with pytest.raises(MindSporeCheckpointError, match=r"record 'a' lacks required fields \['tensor.tensor_content'\]"):
        read_ckpt(tmp_path / "req.ckpt")
    (tmp_path / "utf.ckpt").write_bytes(b"\x0a\x04\x0a\x02\xff\xfe")
    with pytest.raises(MindSporeCheckpointError, match="not valid UTF-8"):
        read_ckpt(tmp_path / "utf.ckpt")
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(MindSporeCheckpointError, match="is empty"):
        read_ckpt(empty)
    with pytest.raises(MindSporeCheckpointError, match="cannot open"):
        read_ckpt(tmp_path / "absent.ckpt")


def test_map_tensor_refused(tmp_path, record_path):
    c = Checkpoint()
    keys = TensorProto(dims=[3], tensor_type="Int64", tensor_content=np.arange(3, dtype=np.int64).tobytes())
    vals = TensorProto(dims=[3, 2], tensor_type="Float32", tensor_content=np.zeros((3, 2), np.float32).tobytes())
    status = TensorProto(dims=[3], tensor_type="Int32", tensor_content=np.zeros(3, np.int32).tobytes())
    c.value.add(tag="embedding.table", maptensor=MapTensorProto(tensor=[keys, vals, status]))
    path = tmp_path / "map.ckpt"
    first = one_record("w", [2], "Float32", b"\0" * 8)
    path.write_bytes(first + c.SerializeToString())
    with pytest.raises(MindSporeCheckpointError, match=rf"'embedding\.table' is a map tensor.*\(at byte {len(first)}\)"):
        read_ckpt(path)


@pytest.mark.parametrize("records, msg", [
    ([("q", [4], "Int4", b"\x12\x34")], "'q' has type Int4"),
    ([("q", [2], "Complex64", b"\0" * 16)], "unknown tensor_type 'Complex64'"),
    ([("q", [3], "Float32", b"\0" * 8)], "need 12"),  # too few bytes for the dims
    ([("q", [1], "Float32", b"\0" * 8)], "more than the 4 bytes"),  # too many
    ([("q", [4], "Float32", b"\0" * 8), ("q", [2, 2], "Float32", b"\0" * 8)], r"continues a tensor of Float32 \[4\]"),
    ([("q", [1 << 40], "Float32", b"\0" * 8)], "need 4398046511104 bytes but the file has only"),  # no huge allocation
    ([("q", [-1], "Float32", b"\0" * 4)], "negative dims"),
])
def test_bad_records(tmp_path, records, msg, record_path):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(b"".join(one_record(*r) for r in records))
    with pytest.raises(MindSporeCheckpointError, match=msg):
        read_ckpt(path)


# ---------------------------------------------------------------- MindFormers safetensors folders

def mf_folder(tmp_path: Path, index: str) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    shard1 = {"embedding.word_embeddings.weight": torch.randn(8, 4, generator=g).bfloat16(),
              "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(8, 4, generator=g).bfloat16()}
    shard2 = {"decoder.final_layernorm.weight": torch.ones(4, dtype=torch.bfloat16),
              "decoder.layers.0.mlp.router.expert_bias": torch.zeros(2)}
    folder = tmp_path / "mf"
    folder.mkdir()
    files = ["ms-model-00001-of-00002.safetensors", "ms-model-00002-of-00002.safetensors"]
    for f, sh in zip(files, (shard1, shard2)):
        save_file(sh, str(folder / f), metadata={"format": "ms"})
    save_file({"global_step": torch.tensor(5)}, str(folder / "hyper_param.safetensors"))
    weight_map = {k: f for f, sh in zip(files, (shard1, shard2)) for k in sh}
    if index == "param_name_map.json":
        (folder / index).write_text(json.dumps(weight_map))
    else:
        (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, {**shard1, **shard2}


@pytest.mark.parametrize("index", ["param_name_map.json", "ms-model.safetensors.index.json"])
def test_mindformers_folder(tmp_path, index):
    folder, tensors = mf_folder(tmp_path, index)
    view = open_mindformers_safetensors(folder)
    assert sorted(view.names) == sorted(tensors)  # hyper_param.safetensors is not in the map
    assert view.file_of["decoder.final_layernorm.weight"] == "ms-model-00002-of-00002.safetensors"
    assert view.shape("decoder.layers.0.self_attention.linear_qkv.weight") == (8, 4)
    assert same(view.read("embedding.word_embeddings.weight"), tensors["embedding.word_embeddings.weight"])
    back = read_ms_safetensors(folder)
    assert set(back) == set(tensors) and all(same(back[k], v) for k, v in tensors.items())
    assert ms.is_ms_safetensors(folder / "ms-model-00001-of-00002.safetensors")


def test_mindformers_folder_errors(tmp_path):
    folder, _ = mf_folder(tmp_path, "param_name_map.json")
    m = json.loads((folder / "param_name_map.json").read_text())
    m["decoder.final_layernorm.weight"] = "ms-model-00001-of-00002.safetensors"
    (folder / "param_name_map.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="param_name_map.json: tensor 'decoder.final_layernorm.weight' is in ms-model-00002"):
        open_mindformers_safetensors(folder)
    (folder / "param_name_map.json").unlink()
    with pytest.raises(FileNotFoundError, match="no param_name_map.json .*several safetensors files"):
        open_mindformers_safetensors(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_mindformers_safetensors(tmp_path / "absent")
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(DATA / "dtypes.safetensors", single / "model.safetensors")
    assert "mask.bool" in open_mindformers_safetensors(single).names
    save_file({"q": torch.zeros(4, dtype=torch.int8)}, str(tmp_path / "int4.safetensors"), metadata={"format": "ms", "q": "Int4"})
    with pytest.raises(ValueError, match="packed Int4"):
        open_mindformers_safetensors(tmp_path / "int4.safetensors")


def test_write_dtensor(tmp_path, dist1):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = dist1
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).bfloat16()
    placements = [Shard(0) if i == 0 else Replicate() for i in range(mesh.ndim)]
    write_ckpt(tmp_path / "d.ckpt", {"w": distribute_tensor(w, mesh, placements)})
    assert same(read_ckpt(tmp_path / "d.ckpt")["w"], w)
