"""Resume is exact: stop-after + rerun, and SIGKILL after a checkpoint + rerun, reproduce an
uninterrupted run's losses and final params bit for bit (CPU, fp32)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from mff.ckpt import latest_step_dir, step_dir_name
from tests.cli_util import popen_cli, run_cli, tiny_args, trained_fixture, wait_for

STEPS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    corpus, cache, ref = trained_fixture(root, STEPS, with_metrics=True)
    return root, corpus, cache, ref


def _records(path):
    """The step records (a resumed run's ``{"event": "resume", ...}`` markers left out)."""
    keep = ("step", "loss", "lm_loss", "mtp_loss", "balance_loss", "lr", "grad_norm")
    return [{k: rec[k] for k in keep} for rec in map(json.loads, path.read_text().splitlines()) if "event" not in rec]


def _final(ckpt_dir, name):
    return load_file(str(ckpt_dir / step_dir_name(STEPS) / name))


def _assert_same_final(a, b):
    for name in ("model.safetensors", "optim.safetensors"):
        ta, tb = _final(a, name), _final(b, name)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{name}:{k} differs"


def test_stop_after_then_rerun_is_bitwise_equal(setup):
    root, corpus, cache, ref = setup
    out = root / "stopped"
    args = tiny_args(corpus) + ["--steps", str(STEPS), "--ckpt-dir", str(out), "--metrics-file", str(out / "m.jsonl")]
    r = run_cli(args + ["--stop-after", str(STEPS // 2)], cache, timeout=600)
    assert r.returncode == 0, r.stderr
    assert latest_step_dir(out).name == step_dir_name(STEPS // 2)
    r = run_cli(args, cache, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert _records(out / "m.jsonl") == _records(ref / "m.jsonl")
    _assert_same_final(out, ref)


def test_sigkill_after_checkpoint_then_rerun_is_bitwise_equal(setup):
    root, corpus, cache, ref = setup
    out = root / "killed"
    args = tiny_args(corpus) + ["--steps", str(STEPS), "--ckpt-dir", str(out), "--save-every", "3", "--metrics-file", str(out / "m.jsonl")]
    proc = popen_cli(args, cache)
    wait_for(proc, lambda: (out / "latest").exists())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = latest_step_dir(out).name
    assert killed_at < step_dir_name(STEPS)
    r = run_cli(args, cache, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {out / killed_at}" in r.stdout
    _assert_same_final(out, ref)
    # the metrics file holds the killed run's steps, then the resumed run's from the checkpoint on
    k = int(killed_at.split("_")[1])
    assert _records(out / "m.jsonl")[-(STEPS - k):] == _records(ref / "m.jsonl")[k:]
    # with a marker where the re-run starts: the steps after it replace the killed run's
    lines = [json.loads(x) for x in (out / "m.jsonl").read_text().splitlines()]
    marks = [i for i, rec in enumerate(lines) if rec.get("event") == "resume"]
    assert len(marks) == 1 and lines[marks[0]]["resumed_from"] == str(out / killed_at) and lines[marks[0]]["next_step"] == k + 1
    assert [rec["step"] for rec in lines[marks[0] + 1:]] == list(range(k + 1, STEPS + 1))
    # a rerun with nothing left to do adds no marker
    r = run_cli(args, cache, timeout=600)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr
    assert len((out / "m.jsonl").read_text().splitlines()) == len(lines)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_save_and_resume(setup, sig):
    """SIGTERM and Ctrl-C (SIGINT) both finish the step, save it, say so and exit 128 + signal
    (130 for Ctrl-C), without a traceback; the rerun resumes to the uninterrupted result."""
    root, corpus, cache, ref = setup
    out = root / f"signal{int(sig)}"
    args = tiny_args(corpus) + ["--steps", str(STEPS), "--ckpt-dir", str(out), "--save-every", "0", "--metrics-file", str(out / "m.jsonl")]
    proc = popen_cli(args, cache)
    metrics = out / "m.jsonl"
    wait_for(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert f"{sig.name}: checkpoint saved at step" in stdout and "Traceback" not in stderr, (stdout[-1000:], stderr[-2000:])
    r = run_cli(args, cache, timeout=600)
    assert r.returncode == 0, r.stderr
    _assert_same_final(out, ref)


def test_ctrl_c_under_torchrun_saves_on_every_rank_and_resumes(setup):
    """Ctrl-C in a terminal signals torchrun and both workers (the whole process group): the ranks
    agree on the step, save it and exit 130 with no traceback of theirs; torchrun itself reports
    the signal (its own SignalException). The rerun on two processes resumes from that step."""
    import subprocess

    from tests.cli_util import ROOT, cli_env
    from tests.dist_util import torchrun_cmd

    root, corpus, cache, _ = setup
    out = root / "torchrun-ctrl-c"
    args = tiny_args(corpus) + ["--steps", "200", "--ckpt-dir", str(out), "--save-every", "0", "--metrics-file", str(out / "m.jsonl"),
                                "--parallel.dp-shard", "2"]
    proc = subprocess.Popen(torchrun_cmd(2, ["-m", "mff.recipes.pretrain", *args]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(cache), cwd=ROOT, start_new_session=True)
    metrics = out / "m.jsonl"
    wait_for(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    stdout, stderr = proc.communicate(timeout=180)
    saved = [line for line in stdout.splitlines() if line.startswith("SIGINT: checkpoint saved at step")]
    assert len(saved) == 1, (stdout[-2000:], stderr[-3000:])  # printed by rank 0 once
    step = int(saved[0].split("step ")[1].split()[0])
    assert (out / "latest").read_text().strip() == step_dir_name(step)
    assert "mff/" not in "".join(line for line in stderr.splitlines() if line.strip().startswith("File ")), stderr[-3000:]
    r = subprocess.run(torchrun_cmd(2, ["-m", "mff.recipes.pretrain", *args, "--stop-after", str(step + 2)]),
                       capture_output=True, text=True, env=cli_env(cache), cwd=ROOT, timeout=600)
    assert r.returncode == 0 and f"resumed from {out / step_dir_name(step)}" in r.stdout, r.stderr[-3000:]
