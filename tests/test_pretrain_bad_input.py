"""Every bad input of the pretraining recipe: one clear message, a non-zero exit, and the
checkpoint already on disk left exactly as it was."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.cli_util import run_cli, tiny_args, trained_fixture, tree_digest


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    corpus, cache, ckpt = trained_fixture(root, 3)
    return root, corpus, cache, ckpt


def _fails(r, needle: str, code: int | None = None):
    assert r.returncode != 0, r.stdout
    if code is not None:
        assert r.returncode == code, r.stderr
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def _args(corpus, ckpt, *extra):
    return tiny_args(corpus) + ["--steps", "6", "--ckpt-dir", str(ckpt), *extra]


CASES = [
    (["--model", "gpt9"], "unknown model 'gpt9'; valid models: deepseek3, glm4, glm4_moe, llama, qwen3, qwen3_moe, telechat3"),
    (["--init-from", "/nonexistent/ckpt"], "/nonexistent/ckpt does not exist"),
    (["--size", "huge"], "unknown size 'huge' for model deepseek3; valid sizes: tiny, v3-671b"),
    (["--seq-len", "100000"], "--seq-len 100000 must be in [1, 4096]"),
    (["--batch-size", "5", "--grad-accum", "2"], "--batch-size 5 must be divisible by data-parallel ranks 1 x --grad-accum 2 = 2"),
    (["--model.hidden-size", "128"], "hidden_size: checkpoint 64, this run 128"),
    (["--model.vocab-size", "256"], "vocab_size: checkpoint 512, this run 256"),
    (["--model.n-routed-experts", "6", "--model.n-group", "4"], "error: model config: n_routed_experts=6 must divide into n_group=4 groups"),
    (["--model.n-shared-experts", "-1"], "n_shared_experts=-1 must be >= 0"),
    (["--model.vocab-size", "100000000000"], "params, 47,683.7 GiB in float32, more than the"),  # refused before the skeleton is built
    (["--optim.lr", "nan"], "error: --optim.lr nan must be a finite number >= 0"),
    (["--optim.min-lr-ratio", "5"], "--optim.min-lr-ratio 5.0 must be in [0, 1]"),
    (["--save-every", "-1"], "--save-every -1 must be >= 0"),
    (["--threads", "0"], "--threads 0 must be >= 1"),
    (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--device", "garbage"], "error: --device 'garbage' is not a device; expected one of auto, cpu, cuda, npu"),
    (["--parallel.timeout-s", "0"], "--parallel.timeout-s"),
    (["--parallel.timeout-s", "0.01"], "--parallel.timeout-s 0.01: must be a finite number >= 1 second"),
    (["--parallel.timeout-s", "inf"], "--parallel.timeout-s inf: must be a finite number >= 1 second"),
    (["--seq-len", "16"], "was trained with --seq-len 32; this run has --seq-len 16"),
]


@pytest.mark.parametrize("extra,needle", CASES, ids=[c[0][0] for c in CASES])
def test_bad_flags_leave_checkpoint_intact(base, extra, needle):
    root, corpus, cache, ckpt = base
    before = tree_digest(ckpt)
    args = _args(corpus, ckpt)
    # later flags win in tyro; --model/--size are read first
    _fails(run_cli(args + extra, cache, timeout=300), needle)
    assert tree_digest(ckpt) == before


def test_vocabulary_smaller_than_the_tokenizer(base, tmp_path):
    root, corpus, cache, ckpt = base
    r = run_cli(_args(corpus, tmp_path / "fresh", "--model.vocab-size", "256"), cache, timeout=300)
    _fails(r, "tokens but the model's vocab_size is 256; raise --model.vocab-size")


def test_checkpoint_of_another_model_fails_before_the_data_is_read(base):
    root, corpus, cache, ckpt = base
    before = tree_digest(ckpt)
    r = run_cli(_args(corpus, ckpt, "--model", "telechat3"), cache, timeout=300)
    _fails(r, "the checkpoint holds a 'deepseek3' model, this run builds 'telechat3'; use another --ckpt-dir")
    assert "data:" not in r.stdout + r.stderr
    assert tree_digest(ckpt) == before


def test_missing_and_empty_data(base, tmp_path):
    root, corpus, cache, ckpt = base
    before = tree_digest(ckpt)
    _fails(run_cli(_args(corpus, ckpt, "--data.path", str(tmp_path / "nope")), cache, timeout=300), str(tmp_path / "nope"), 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("   \n")
    _fails(run_cli(_args(corpus, ckpt, "--data.path", str(empty)), cache, timeout=300), "empty corpus", 2)
    assert tree_digest(ckpt) == before


def test_corrupt_checkpoint_is_reported_and_kept(base, tmp_path):
    root, corpus, cache, ckpt = base
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    model_file = next(broken.glob("step_*/model.safetensors"))
    model_file.write_bytes(model_file.read_bytes()[:1000])
    before = tree_digest(broken)
    _fails(run_cli(_args(corpus, broken), cache, timeout=300), "model.safetensors is corrupt or truncated", 1)
    assert tree_digest(broken) == before


def test_non_finite_loss_stops_without_saving(base, tmp_path):
    root, corpus, cache, ckpt = base
    run = tmp_path / "nan"
    shutil.copytree(ckpt, run)
    before = tree_digest(run)
    r = run_cli(_args(corpus, run, "--optim.lr", "1e30", "--save-every", "1", "--keep-last", "0"), cache, timeout=300)
    _fails(r, "non-finite", 1)
    bad_step = int(re.search(r"error: step (\d+):", r.stderr).group(1))
    assert bad_step > 3
    after = tree_digest(run)
    old = {k: v for k, v in before.items() if k.startswith("step_")}
    assert {k: v for k, v in after.items() if k in old} == old  # no earlier checkpoint overwritten or deleted
    assert not (run / f"step_{bad_step:08d}").exists()  # the failed step saved nothing


def test_bad_checkpoint_folders(base, tmp_path):
    root, corpus, cache, ckpt = base
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    _fails(run_cli(_args(corpus, a_file), cache, timeout=300), "exists and is not a folder", 1)
    _fails(run_cli(_args(corpus, ""), cache, timeout=300), "the checkpoint folder is empty", 1)
    for content in (b"\x8c\xff\x00", None):
        broken = tmp_path / f"latest-{content is None}"
        shutil.copytree(ckpt, broken)
        (broken / "latest").unlink()
        if content is None:
            (broken / "latest").mkdir()
        else:
            (broken / "latest").write_bytes(content)
        _fails(run_cli(_args(corpus, broken), cache, timeout=300), str(broken / "latest"), 1)


def test_second_run_on_a_locked_folder_is_refused(base, tmp_path):
    import fcntl

    root, corpus, cache, ckpt = base
    locked = tmp_path / "locked"
    shutil.copytree(ckpt, locked)
    before = tree_digest(locked)
    with open(locked / ".lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running first run holds it
        _fails(run_cli(_args(corpus, locked), cache, timeout=300), "is in use by another run", 1)
    assert tree_digest(locked) == before


def test_orphan_step_dir_from_a_crash_is_replaced(base, tmp_path):
    """A step dir renamed into place but never made `latest` (crash between the two) is not a
    committed checkpoint: the resumed run rewrites it instead of refusing."""
    root, corpus, cache, ckpt = base
    run = tmp_path / "orphan"
    shutil.copytree(ckpt, run)
    shutil.copytree(run / "step_00000003", run / "step_00000004")  # latest still names step 3
    (run / ".tmp-step_00000005-999999999").mkdir()  # a dead writer's temp dir
    r = run_cli(_args(corpus, run, "--save-every", "1", "--keep-last", "0"), cache, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (run / "latest").read_text().strip() == "step_00000006"
    assert not (run / ".tmp-step_00000005-999999999").exists()
