"""Checkpoints with per-rank shard files: the piece arithmetic against DTensor's chunking, the
piece index read back region by region, real DTensors saved on one mesh and loaded onto
another (4 gloo processes), and a pretrain run saved on 2 processes resumed on 1 and on 4 with
the losses of an uninterrupted single-process run."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import mff
from mff import ckpt
from mff.ckpt.checkpoint import open_tensors
from mff.ckpt.shards import ShardedTensors, decode_placements, encode_placements, shard_region, writes_piece
from tests.cli_util import make_corpus, run_cli, tiny_args
from tests.dist_util import torchrun

R, S = Replicate(), Shard

# (global shape, mesh shape, placements): FSDP, nested dense (dp_shard x ep on the same dim),
# stacked experts (ep on the expert dim, dp_shard on embed), HSDP, TP x FSDP, size-1 axes
CASES = [
    ((8, 6), (1, 2, 1, 1), (R, S(0), R, R)),
    ((8, 6), (1, 2, 2, 1), (R, S(0), S(0), R)),
    ((4, 8, 6), (1, 2, 2, 1), (R, S(1), S(0), R)),
    ((8, 6), (2, 2, 1, 1), (R, S(1), R, R)),
    ((8, 6), (1, 2, 1, 2), (R, S(1), R, S(0))),
    ((16,), (2, 2, 2, 1), (R, S(0), S(0), R)),
    ((3, 5), (1, 1, 1, 1), (R, S(0), S(1), R)),
    ((), (1, 2, 1, 1), (R, R, R, R)),
    ((255, 4), (1, 1, 1, 2), (R, R, R, S(0))),  # a vocabulary split unevenly over tp
    ((7, 4), (1, 2, 1, 2), (R, S(1), R, S(0))),
]


def _dtensor_block(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """DTensor's rule as a plain loop: each mesh axis in order chunks the current block."""
    t = full
    for size, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            t = torch.chunk(t, size, dim=p.dim)[c]
    return t


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


@pytest.mark.parametrize("shape, mesh_shape, placements", CASES)
def test_shard_region_is_dtensor_block_and_pieces_cover_once(shape, mesh_shape, placements):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    for coord in _coords(mesh_shape):
        offset, length = shard_region(shape, mesh_shape, coord, placements)
        block = full[tuple(slice(o, o + n) for o, n in zip(offset, length))]
        assert torch.equal(block, _dtensor_block(full, mesh_shape, coord, placements)), coord
        if writes_piece(mesh_shape, coord, placements):
            seen[tuple(slice(o, o + n) for o, n in zip(offset, length))] += 1
    assert bool((seen == 1).all()), "the written pieces must cover every element exactly once"


def test_shard_region_errors_and_placement_codes():
    assert shard_region((6, 4), (1, 4, 1, 1), (0, 3, 0, 0), (R, S(0), R, R)) == ([6, 0], [0, 4])  # torch.chunk: 2, 2, 2, 0
    with pytest.raises(ValueError, match="outside the mesh"):
        shard_region((8,), (1, 2, 1, 1), (0, 2, 0, 0), (R, S(0), R, R))
    assert encode_placements((R, S(0), S(2))) == ["R", "S(0)", "S(2)"]
    assert decode_placements(["R", "S(0)", "S(2)"]) == [R, S(0), S(2)]
    with pytest.raises(ValueError, match="only Replicate and Shard"):
        encode_placements((Partial(),))
    with pytest.raises(ValueError, match="unknown placement"):
        decode_placements(["P"])


def _write_pieces(step: Path, full: dict[str, torch.Tensor], mesh_shape, placements) -> dict:
    """Piece files and index for ``full`` sharded by ``placements`` over ``mesh_shape`` (ranks
    in row-major order), written by hand (no process group)."""
    world = math.prod(mesh_shape)
    files: dict[int, dict] = {}
    index = {}
    for name, t in full.items():
        pieces = []
        for rank, coord in enumerate(_coords(mesh_shape)):
            if writes_piece(mesh_shape, coord, placements[name]):
                off, n = shard_region(t.shape, mesh_shape, coord, placements[name])
                files.setdefault(rank, {})[name] = t[tuple(slice(o, o + k) for o, k in zip(off, n))].contiguous()
                pieces.append({"file": f"model-rank{rank:05d}-of-{world:05d}.safetensors", "offset": off, "length": n})
        index[name] = {"shape": list(t.shape), "dtype": "float32", "mesh": 0, "placements": encode_placements(placements[name]),
                       "pieces": pieces}
    step.mkdir(parents=True)
    for rank, tensors in files.items():
        save_file(tensors, str(step / f"model-rank{rank:05d}-of-{world:05d}.safetensors"))
    return {"layout": {"world_size": world, "meshes": [{"axes": [], "shape": list(mesh_shape)}], "tensors": {"model": index}}}


def test_read_region_takes_any_block_from_the_pieces(tmp_path):
    g = torch.Generator().manual_seed(0)
    full = {"dense": torch.randn(8, 6, generator=g), "experts": torch.randn(4, 8, 6, generator=g), "bias": torch.randn(4, generator=g)}
    saved_on = (1, 2, 2, 1)
    meta = _write_pieces(tmp_path / "s", full, saved_on, {"dense": (R, S(0), S(0), R), "experts": (R, S(1), S(0), R),
                                                          "bias": (R, R, R, R)})
    assert sorted(p.name for p in (tmp_path / "s").iterdir())[0] == "model-rank00000-of-00004.safetensors"
    src = ShardedTensors(tmp_path / "s", meta, "model")
    for name, t in full.items():
        assert torch.equal(src.read(name), t)
    # blocks of another mesh (tp x dp_replicate), including ones that straddle pieces
    new_mesh, new = (2, 1, 1, 2), {"dense": (R, R, R, S(1)), "experts": (R, R, R, S(2)), "bias": (S(0), R, R, R)}
    for name, t in full.items():
        for coord in _coords(new_mesh):
            off, n = shard_region(t.shape, new_mesh, coord, new[name])
            assert torch.equal(src.read_region(name, off, n), _dtensor_block(t, new_mesh, coord, new[name]))
    assert torch.equal(src.read_region("dense", [3, 1], [3, 4]), full["dense"][3:6, 1:5])
    os.remove(tmp_path / "s" / "model-rank00003-of-00004.safetensors")
    with pytest.raises(FileNotFoundError, match="rank00003.*missing"):
        ShardedTensors(tmp_path / "s", meta, "model").read("dense")
    meta["layout"]["tensors"]["model"]["dense"]["pieces"].pop()
    with pytest.raises(ValueError, match="cover 36 elements"):
        ShardedTensors(tmp_path / "s", meta, "model")


# --- real DTensors on 4 gloo processes: save on dp_shard x ep, load on dp_replicate x tp


def _global(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


SAVE = {"dense": ((8, 6), (R, S(0), S(0), R)), "experts": ((4, 8, 6), (R, S(1), S(0), R)), "norm": ((8,), (R, S(0), S(0), R)),
        "bias": ((4,), (R, R, R, R))}
LOAD = {"dense": (R, R, R, S(1)), "experts": (S(0), R, R, S(2)), "norm": (R, R, R, R), "bias": (S(0), R, R, R)}


def _worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        axes = ("dp_replicate", "dp_shard", "ep", "tp")
        mesh = init_device_mesh("cpu", (1, 2, 2, 1), mesh_dim_names=axes)
        params, exp_avg = {}, {}
        for i, (name, (shape, pl)) in enumerate(SAVE.items()):
            coord = mesh.get_coordinate()
            params[name] = DTensor.from_local(_dtensor_block(_global(shape, i), mesh.shape, coord, pl), mesh, pl, run_check=False)
            exp_avg[name] = DTensor.from_local(_dtensor_block(_global(shape, 10 + i), mesh.shape, coord, pl), mesh, pl, run_check=False)
        state = {"step": torch.tensor(3), "exp_avg": exp_avg}
        ckpt.save(out, 5, params, state, {"note": "x"})
        # onto another mesh: every rank gets exactly its new block
        mesh2 = init_device_mesh("cpu", (2, 1, 1, 2), mesh_dim_names=axes)
        like_p = {k: DTensor.from_local(torch.zeros(shard_region(s, mesh2.shape, mesh2.get_coordinate(), LOAD[k])[1]), mesh2, LOAD[k],
                                        run_check=False) for k, (s, _) in SAVE.items()}
        like_s = {"step": torch.tensor(0), "exp_avg": dict(like_p)}
        p2, s2, meta = ckpt.load(Path(out) / "step_00000005", like_p, like_s)
        for i, (name, (shape, _)) in enumerate(SAVE.items()):
            want = _dtensor_block(_global(shape, i), mesh2.shape, mesh2.get_coordinate(), LOAD[name])
            assert p2[name].placements == LOAD[name] and torch.equal(p2[name].to_local(), want), name
            assert torch.equal(p2[name].full_tensor(), _global(shape, i)), name
            assert torch.equal(s2["exp_avg"][name].full_tensor(), _global(shape, 10 + i)), name
        assert int(s2["step"]) == 3 and meta["note"] == "x"
    finally:
        dist.destroy_process_group()


def test_dtensors_saved_on_one_mesh_load_onto_another(tmp_path):
    mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(tmp_path / "ck")), nprocs=4, join=True)
    step = tmp_path / "ck" / "step_00000005"
    names = sorted(p.name for p in step.iterdir())
    assert names == ["meta.msgpack"] + [f"{k}-rank{r:05d}-of-00004.safetensors" for k in ("model", "optim") for r in range(4)]
    meta = ckpt.read_meta(step)
    layout = meta["layout"]
    assert layout["world_size"] == 4 and layout["meshes"][0]["axes"] == ["dp_replicate", "dp_shard", "ep", "tp"]
    dense = layout["tensors"]["model"]["dense"]
    assert dense["placements"] == ["R", "S(0)", "S(0)", "R"]
    assert [(p["file"][:15], p["offset"], p["length"]) for p in dense["pieces"]] == [
        (f"model-rank{r:05d}", [2 * r, 0], [2, 6]) for r in range(4)]  # nested: dp_shard outer, ep inner
    bias = layout["tensors"]["model"]["bias"]["pieces"]
    assert [p["file"] for p in bias] == ["model-rank00000-of-00004.safetensors"]  # one replica only
    # one process, no process group: whole tensors
    src = open_tensors(step, meta, "model")
    for i, (name, (shape, _)) in enumerate(SAVE.items()):
        assert torch.equal(src.read(name), _global(shape, i))


# --- pretrain: save on 2 processes, resume on 1 and on 4


def _records(path: Path) -> list[dict]:
    return [rec for rec in map(json.loads, path.read_text().splitlines()) if "event" not in rec]  # without resume markers


def _close(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in ("loss", "lm_loss", "mtp_loss", "grad_norm"):
            assert x[k] == pytest.approx(y[k], abs=1e-5), (x["step"], k)


@pytest.mark.slow
def test_pretrain_saved_on_2_resumes_on_1_and_on_4(tmp_path):
    corpus, cache = make_corpus(tmp_path / "corpus"), tmp_path / "cache"
    args = tiny_args(corpus) + ["--steps", "4"]

    def run_args(name):
        return args + ["--ckpt-dir", str(tmp_path / name), "--metrics-file", str(tmp_path / f"{name}.jsonl")]

    ref = run_cli(run_args("ref"), cache, timeout=300)
    assert ref.returncode == 0, ref.stderr
    two = torchrun(2, run_args("two") + ["--stop-after", "2", "--parallel.dp-shard", "2"], cache)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    step2 = tmp_path / "two" / "step_00000002"
    assert sorted(p.name for p in step2.glob("*.safetensors")) == [f"{k}-rank{r:05d}-of-00002.safetensors" for k in ("model", "optim")
                                                                   for r in range(2)]
    meta = msgpack.unpackb((step2 / "meta.msgpack").read_bytes(), raw=False)
    q = meta["layout"]["tensors"]["model"]["model.layers.0.self_attn.q_a_proj.weight"]
    assert q["placements"] == ["R", "S(1)", "R", "R"] and len(q["pieces"]) == 2
    _close(_records(tmp_path / "two.jsonl"), _records(tmp_path / "ref.jsonl")[:2])

    for name in ("one", "four"):
        shutil.copytree(tmp_path / "two", tmp_path / name)
        shutil.copy(tmp_path / "two.jsonl", tmp_path / f"{name}.jsonl")
    one = run_cli(run_args("one"), cache, timeout=300)
    assert one.returncode == 0, one.stderr
    assert f"resumed from {tmp_path / 'one' / 'step_00000002'}" in one.stdout
    four = torchrun(4, run_args("four") + ["--parallel.dp-shard", "2", "--parallel.ep", "2"], cache)
    assert four.returncode == 0, four.stdout[-2000:] + four.stderr[-3000:]
    assert "resumed from" in four.stdout
    for name in ("one", "four"):
        _close(_records(tmp_path / f"{name}.jsonl"), _records(tmp_path / "ref.jsonl"))

    # the 4-process checkpoint (nested dp_shard x ep pieces) reads back whole in one process
    _, ref_params = mff.load(tmp_path / "ref")
    _, four_params = mff.load(tmp_path / "four")
    assert (tmp_path / "four" / "step_00000004" / "model-rank00003-of-00004.safetensors").is_file()
    for k, v in ref_params.items():
        torch.testing.assert_close(four_params[k], v, atol=1e-5, rtol=0)
