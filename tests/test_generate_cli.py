"""The generate CLI on a tiny trained run and an HF folder: streaming output, chat templates,
and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mff
from tests.cli_util import ROOT, cli_env, make_corpus, run_cli


def _gen(*args):
    return subprocess.run([sys.executable, "-m", "mff.recipes.generate", *map(str, args)], capture_output=True, text=True, cwd=ROOT)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    corpus = make_corpus(root / "corpus")
    r = run_cli(["--model", "llama", "--model.hidden-size", "64", "--model.intermediate-size", "128", "--model.num-hidden-layers", "2",
                 "--model.vocab-size", "512", "--model.num-attention-heads", "4", "--model.num-key-value-heads", "2",
                 "--seq-len", "32", "--batch-size", "4", "--data.path", str(corpus), "--data.vocab-size", "512", "--steps", "30",
                 "--optim.warmup-steps", "2", "--eval-every", "0", "--threads", "1", "--ckpt-dir", str(root / "run")], root / "cache")
    assert r.returncode == 0, r.stderr
    return root / "run"


def test_mff_run_greedy_matches_library(run_dir):
    from tokenizers import Tokenizer

    r = _gen("--ckpt", run_dir, "--prompt", "alpha beta gamma", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    model, params = mff.load(run_dir)
    ids = torch.tensor([tok.encode("alpha beta gamma").ids])
    out = model.generate(params, ids, max_new_tokens=12)
    assert r.stdout == tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True) + "\n"


def test_hf_folder_chat_template(run_dir, tmp_path):
    model, params = mff.load(run_dir)
    folder = mff.save_hf(model, params, tmp_path / "hf")
    (folder / "tokenizer.json").write_text((run_dir / "tokenizer.json").read_text())
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    r = _gen("--ckpt", folder, "--prompt", "delta", "--chat", "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "5", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("args,needle", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "a", "--max-new-tokens", "100000"], "exceeds the model's context"),
    (["--prompt", "a", "--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
    (["--prompt", "a", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "a", "--chat"], "no chat template"),
    (["--prompt", "a", "--system", "be brief"], "--system needs --chat"),
    (["--prompt", "a", "--tokenizer", "README.md"], "is not a tokenizer.json"),
])
def test_bad_input(run_dir, args, needle):
    r = _gen("--ckpt", run_dir, *args)
    assert r.returncode == 2 and r.stderr.startswith("error:") and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_checkpoint(tmp_path):
    r = _gen("--ckpt", tmp_path / "nope", "--prompt", "a")
    assert r.returncode == 2 and "does not exist" in r.stderr


def _generate(ckpt, tmp_path, *extra):
    env = cli_env(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(ckpt), "--prompt", "hello world",
                           "--threads", "1", *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def test_compile_auto_decodes_eagerly_until_timed_then_follows_the_break_even(run_dir, tmp_path):
    """--compile auto: eager while this machine has not timed both ways (and the eager timing is
    recorded), then compiled only past the recorded break-even; --compile on is obeyed."""
    from mff.decode_timing import read_record

    run = run_dir
    r = _generate(run, tmp_path, "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "decode: eager (--compile auto: compiled decoding of this model is not timed on this machine yet" in r.stderr
    (rec_file,) = (tmp_path / "cache" / "decode-timing").iterdir()
    assert set(read_record(rec_file)) == {"eager_step_s"}
    # pretend this machine timed both ways: 1 s to compile, 0.01 s saved per step -> break-even 100 steps
    rec_file.write_text('{"eager_step_s": 0.02, "compiled_step_s": 0.01, "first_compiled_step_s": 1.0}')
    r = _generate(run, tmp_path, "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "decode: eager (--compile auto: compiling pays back above 100 decode steps here; this call decodes up to 5)" in r.stderr
    eager_text = r.stdout
    r = _generate(run, tmp_path, "--max-new-tokens", "6", "--compile", "on")
    assert r.returncode == 0, r.stderr
    assert "decode:" not in r.stderr and r.stdout == eager_text  # forced: no note, the same tokens
    assert set(read_record(rec_file)) == {"eager_step_s", "compiled_step_s", "first_compiled_step_s"}
