"""What a first user meets on the command line and in the log: unknown flags name the nearest one,
HF model_type spellings name their family, the default warmup fits a short run (an explicit one
still refuses), usage errors exit 2, and the log states the resolved run, elapsed time and ETA,
caps MFU at 100%, writes the resolved config beside the checkpoints and, on request, TensorBoard
scalars."""

from __future__ import annotations

import json

import pytest

from mff.recipes.common import nearest_option
from mff.train.log import METRICS_FIELDS, RunLog, format_duration
from tests.cli_util import make_corpus, run_cli, tiny_args

OPTIONS = ["--steps", "--seq-len", "--batch-size", "--grad-accum", "--optim.lr", "--optim.warmup-steps", "--optim.weight-decay",
           "--optim.max-grad-norm", "--ckpt-dir", "--data.path", "--data.tokenizer"]


@pytest.mark.parametrize("typed,meant", [
    ("--optim.learning-rate", "--optim.lr"),      # HF Trainer's name
    ("--train-iters", "--steps"),                 # Megatron's
    ("--optim.lrr", "--optim.lr"),                # a typo
    ("--optim.warmup_step", "--optim.warmup-steps"),
    ("--seq-length", "--seq-len"),
    ("--data.tokeniser", "--data.tokenizer"),
])
def test_nearest_option(typed, meant):
    assert nearest_option(typed, OPTIONS) == meant


def test_nearest_option_of_nonsense_is_none():
    assert nearest_option("--xyzzy", OPTIONS) is None


def test_format_duration():
    assert [format_duration(s) for s in (0, 7.4, 125, 3723)] == ["0s", "7s", "2m05s", "1h02m03s"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("log")
    return make_corpus(root / "corpus"), root / "cache"


def _args(corpus, extra):
    args = tiny_args(corpus)
    i = args.index("--optim.warmup-steps")
    return args[:i] + args[i + 2:] + extra  # the default warmup


def test_unknown_flag_exits_2_naming_the_nearest(corpus, tmp_path):
    path, cache = corpus
    r = run_cli(_args(path, ["--optim.learning-rate", "3e-4", "--ckpt-dir", str(tmp_path / "c")]), cache, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: unknown option --optim.learning-rate; did you mean --optim.lr?"
    assert not (tmp_path / "c").exists()


def test_help_lists_model_size_and_mindformers_yaml(corpus):
    _, cache = corpus
    r = run_cli(["--help"], cache, timeout=300)
    assert r.returncode == 0
    for flag in ("--model FAMILY", "--size NAME", "--from-mindformers-yaml FILE", "deepseek_v3"):
        assert flag in r.stdout


def test_short_run_default_warmup_hf_alias_and_the_log(corpus, tmp_path):
    """--steps 3 with the default warmup (20) runs (warmup 1); --model deepseek_v3 is deepseek3;
    the header, the step lines and the files say what the README says they do."""
    path, cache = corpus
    ckpt, metrics, tb = tmp_path / "c", tmp_path / "m.jsonl", tmp_path / "tb"
    args = _args(path, ["--steps", "3", "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics), "--metrics.tensorboard", str(tb)])
    args[args.index("deepseek3")] = "deepseek_v3"
    r = run_cli(args, cache, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "model deepseek3/tiny" in r.stdout
    plan = next(line for line in r.stdout.splitlines() if line.startswith("run: "))
    assert "3 steps x global batch 4 x 32 tokens = 128 tokens/step, 384 tokens in all" in plan
    assert "cosine (warmup 1," in plan and "precision fp32" in plan
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ") and "/3 |" in line]
    assert len(steps) == 3 and all(" | elapsed " in s and " | eta " in s for s in steps)
    assert "\r" not in r.stdout + r.stderr  # no progress bar redrawn into a pipe
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3]
    for rec in recs:
        assert set(rec) <= set(METRICS_FIELDS), set(rec) - set(METRICS_FIELDS)
        assert 0 <= rec["mfu_percent"] <= 100 and rec["elapsed_s"] >= 0 and rec["eta_s"] >= 0
    assert recs[-1]["eta_s"] == 0
    # the console prints the file's MFU, in the same unit
    assert f"MFU {recs[0]['mfu_percent']:.2f}%" in steps[0]
    saved = json.loads((ckpt / "run_config.json").read_text())
    assert saved["family"] == "deepseek3" and saved["run"]["steps"] == 3 and saved["run"]["optim"]["warmup_steps"] == 1
    assert saved["config"]["hidden_size"] == 64
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert loss[-1].value == pytest.approx(recs[-1]["loss"], rel=1e-6)


def test_an_explicit_warmup_longer_than_the_run_is_refused(corpus, tmp_path):
    path, cache = corpus
    r = run_cli(_args(path, ["--steps", "3", "--optim.warmup-steps", "5", "--ckpt-dir", str(tmp_path / "c")]), cache, timeout=300)
    assert r.returncode == 2
    assert "error: --optim.warmup-steps 5 exceeds --steps 3" in r.stderr


def test_mfu_above_the_measured_peak_is_capped_with_a_note(capsys):
    log = RunLog(None, total=2)
    rec = {"step": 1, "loss": 1.0, "lm_loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "mfu": 1.7}
    log.step(rec)
    log.step({**rec, "step": 2})
    log.close()
    out = capsys.readouterr().out
    assert "MFU 100.00%" in out and "170%" in out and out.count("note: MFU capped") == 1


def test_default_cpu_threads_follow_the_free_cores():
    from mff.backend import cpu_threads

    assert cpu_threads(None, "cpu", 1, load=0.1, cores=2)[0] == 2        # idle: every core
    n, why = cpu_threads(None, "cpu", 1, load=1.4, cores=2)
    assert n == 1 and "load average 1.4" in why                           # one core busy with other work
    assert cpu_threads(None, "cpu", 2, load=0.0, cores=2)[0] == 1         # two torchrun processes share 2 cores
    assert cpu_threads(None, "cpu", 1, load=9.0, cores=2)[0] == 1         # never 0
    assert cpu_threads(3, "cpu", 1, load=9.0, cores=2) == (3, "--threads")  # the flag wins
    assert cpu_threads(None, "cuda")[0] is None
    with pytest.raises(ValueError, match="--threads 0 must be >= 1"):
        cpu_threads(0, "cpu")


def test_a_pad_token_outside_the_vocabulary_is_refused_before_training(corpus, tmp_path):
    """An export of such a run would load nowhere (transformers refuses it too)."""
    path, cache = corpus
    r = run_cli(_args(path, ["--steps", "2", "--model.pad-token-id", "99999", "--ckpt-dir", str(tmp_path / "c")]), cache, timeout=300)
    assert r.returncode == 2
    assert "pad_token_id=99999 is outside the vocabulary (vocab_size=512)" in r.stderr and "Traceback" not in r.stderr


def test_a_step_above_the_cpu_peak_measures_the_peak_again(capsys):
    """A peak measured under load (here: 1 kFLOP/s, far below any CPU) is measured again when a
    step runs above it; the higher peak is kept and printed, and the step's MFU is against it."""
    from types import SimpleNamespace

    import torch

    from mff.train.loop import _remeasure_peak

    run = SimpleNamespace(device=torch.device("cpu"), peak_flops=1e3, flops_per_token=1e6, world_size=1,
                          cfg=SimpleNamespace(precision="bf16-mixed"))
    log = RunLog(None, total=1)
    value = _remeasure_peak(run, log, 7, tps=10.0)
    log.close()
    out = capsys.readouterr().out
    assert run.peak_flops > 1e8 and value == pytest.approx(1e7 / run.peak_flops)
    assert "note: peak re-measured at step 7" in out and "start-up: 0.0" in out
    run.peak_flops = 1e18  # above anything measured: kept, no note
    assert _remeasure_peak(run, RunLog(None, total=1), 8, tps=10.0) == pytest.approx(1e7 / 1e18)
    assert "re-measured" not in capsys.readouterr().out
