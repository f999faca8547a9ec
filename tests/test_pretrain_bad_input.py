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
    (["--model", "gpt9"], "unknown model 'gpt9'; valid models: deepseek3, telechat3"),
    (["--size", "huge"], "unknown size 'huge' for model deepseek3; valid sizes: tiny, v3-671b"),
    (["--seq-len", "100000"], "--seq-len 100000 must be in [1, 4096]"),
    (["--batch-size", "5", "--grad-accum", "2"], "--batch-size 5 must be divisible by data-parallel ranks 1 x --grad-accum 2 = 2"),
    (["--model.hidden-size", "128"], "hidden_size: checkpoint 64, this run 128"),
    (["--model.vocab-size", "256"], "tokens but the model's vocab_size is 256; raise --model.vocab-size"),
]


@pytest.mark.parametrize("extra,needle", CASES, ids=[c[0][0] for c in CASES])
def test_bad_flags_leave_checkpoint_intact(base, extra, needle):
    root, corpus, cache, ckpt = base
    before = tree_digest(ckpt)
    args = _args(corpus, ckpt)
    # later flags win in tyro; --model/--size are read first
    _fails(run_cli(args + extra, cache, timeout=300), needle)
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
