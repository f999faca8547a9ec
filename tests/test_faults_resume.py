"""Hostile checkpoint folders and data paths (issue 20): a corrupt meta.msgpack on resume, a
leftover ``.latest.tmp-PID``, a ``model.safetensors`` that is a folder, a FIFO as ``--data.path``,
a run that fails at start-up. Each is one error line naming the file and the cause, no
traceback, and nothing left behind; a corrupt newest step says that the previous one is still
there and how to resume from it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import msgpack
import pytest

from tests.cli_util import ROOT, cli_env, make_corpus, tiny_args

STEPS = 4


def _pretrain(args, cache):
    return subprocess.run([sys.executable, "-m", "mff.recipes.pretrain", *args], capture_output=True, text=True, env=cli_env(cache),
                          cwd=ROOT, timeout=600)


def _one_line(r, code, *needles):
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("faults")
    corpus = make_corpus(root / "corpus", 20)
    args = tiny_args(corpus) + ["--save-every", "2", "--keep-last", "0"]
    r = _pretrain(args + ["--steps", str(STEPS), "--ckpt-dir", str(root / "run")], root / "cache")
    assert r.returncode == 0, r.stderr
    assert (root / "run" / "step_00000002").is_dir() and (root / "run" / "step_00000004").is_dir()
    return root, args


def _corrupt(meta: dict, how: str) -> dict:
    meta = dict(meta)
    if how == "step":
        meta["step"] = "six"
    elif how == "config":
        meta["config"] = [1, 2]
    elif how == "rng":
        meta["rng"] = {"torch_cpu": meta["rng"]["torch_cpu"][:100]}
    elif how == "data":
        meta["data"] = {k: v for k, v in meta["data"].items() if k != "position"}
    elif how == "tokens":
        meta["tokens_seen"] = -5
    elif how == "step past its folder":
        meta["step"] = 2**64 - 1
    elif how == "huge data position":
        meta["data"] = dict(meta["data"], position=2**63)
    elif how.startswith("run."):
        key, value = {"run.optim": ("optim", "adamw"), "run.seq_len": ("seq_len", "32"), "run.precision": ("precision", 7)}[how]
        meta["run"] = dict(meta["run"], **{key: value})
    elif how == "config NaN":
        meta["config"] = dict(meta["config"], rope_parameters=dict(meta["config"]["rope_parameters"], rope_theta=float("nan")))
    elif how == "config field":
        meta["config"] = dict(meta["config"], hidden_size=[meta["config"]["hidden_size"]])
    return meta


@pytest.mark.parametrize("how,needle", [
    ("step", "is corrupt: step is 'six', expected a step number >= 0"),
    ("config", "is corrupt: config is [1, 2], expected the model config (a map)"),
    ("rng", "is corrupt: rng.torch_cpu is 100 bytes, expected torch's 5056-byte CPU generator state"),
    ("data", "is corrupt: its data position cannot be restored (KeyError: 'position')"),
    ("tokens", "is corrupt: tokens_seen is -5, expected a token count >= 0"),
    ("step past its folder", "is corrupt: step is 18446744073709551615 in a folder named step_00000004"),
    ("huge data position", "is corrupt: data.position is 9223372036854775808, expected a sample count in [0, 2**62)"),
    ("run.optim", "is corrupt: run.optim is 'adamw', expected the optimizer options (a map)"),
    ("run.seq_len", "is corrupt: run.seq_len is '32', expected a sequence length"),
    ("run.precision", "is corrupt: run.precision is 7, expected a precision name"),
    ("config NaN", "is corrupt: config.rope_parameters.rope_theta is nan, expected a finite number"),
    ("config field", "is corrupt: config.hidden_size is [64] (list), expected a number like this run's 64"),
])
def test_a_corrupt_meta_on_resume_is_one_line_naming_the_previous_step(trained, tmp_path, how, needle):
    root, args = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    meta_file = run / "step_00000004" / "meta.msgpack"
    meta = msgpack.unpackb(meta_file.read_bytes(), raw=False)
    meta_file.write_bytes(msgpack.packb(_corrupt(meta, how), use_bin_type=True))
    r = _pretrain(args + ["--steps", "6", "--ckpt-dir", str(run)], root / "cache")
    line = _one_line(r, 1, str(meta_file), needle)
    assert f"the previous checkpoint {run / 'step_00000002'} is still there" in line and f"write 'step_00000002' into {run / 'latest'}" in line
    if how not in ("step", "huge data position"):
        return
    # doing what it says resumes from step 2
    shutil.move(run / "step_00000004", tmp_path / "aside")
    (run / "latest").write_text("step_00000002\n")
    r = _pretrain(args + ["--steps", str(STEPS), "--ckpt-dir", str(run)], root / "cache")
    assert r.returncode == 0 and f"resumed from {run / 'step_00000002'}" in r.stdout, r.stderr[-2000:]


def test_a_leftover_latest_temp_file_is_removed(trained, tmp_path):
    root, args = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (run / f".latest.tmp-{dead}").write_text("step_000")  # a writer killed between writing and renaming
    (run / f".latest.tmp-{os.getpid()}").write_text("x")  # a live writer's: kept
    r = _pretrain(args + ["--steps", "6", "--ckpt-dir", str(run)], root / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (run / f".latest.tmp-{dead}").exists() and (run / f".latest.tmp-{os.getpid()}").exists()
    assert (run / "latest").read_text().strip() == "step_00000006"


def test_a_failed_start_leaves_no_folder(trained, tmp_path):
    root, args = trained
    out = tmp_path / "new" / "run"
    r = _pretrain([*args, "--steps", "2", "--ckpt-dir", str(out), "--data.path", str(tmp_path / "missing")], root / "cache")
    _one_line(r, 2, "corpus path not found")
    assert not out.exists() and not (tmp_path / "new").exists()  # nor the parent made for it
    # a folder the user made is kept, as is what it held; only the lock file goes
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    r = _pretrain([*args, "--steps", "2", "--ckpt-dir", str(out), "--data.path", str(tmp_path / "missing")], root / "cache")
    assert r.returncode == 2 and sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_a_fifo_as_data_path_is_named(trained, tmp_path):
    root, args = trained
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    r = _pretrain([*args, "--steps", "2", "--ckpt-dir", str(tmp_path / "run"), "--data.path", str(fifo)], root / "cache")
    _one_line(r, 2, f"data: corpus path '{fifo}' is a FIFO (named pipe)")
    from mff.data.sft_rows import read_rows

    with pytest.raises(ValueError, match=r"--data.path .*rows.jsonl is a FIFO \(named pipe\); expected a .json or .jsonl file"):
        read_rows([str(fifo)])


def test_model_safetensors_that_is_a_folder_or_a_bad_link_is_named(tmp_path):
    import mff
    from tests.sft_util import make_chat_checkpoint

    folder = make_chat_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"model.safetensors is a folder, not a file"):
        mff.load(folder)
    (folder / "model.safetensors").rmdir()
    (folder / "model.safetensors").symlink_to("model.safetensors")  # a link to itself
    with pytest.raises(ValueError, match=r"model.safetensors is a symlink loop, not a file"):
        mff.load(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors is a broken symlink, not a file"):
        mff.load(folder)
