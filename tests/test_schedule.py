"""LR schedules (issue 6, acceptance 2): the issue's exact values, the conventions, and resume
continuity through the pretrain recipe (wsd run stopped at step 4 and rerun)."""

from __future__ import annotations

import json
import math

import pytest

from mff.optim import OptimConfig, lr_at, warmup_cosine, warmup_stable_decay
from mff.optim.schedule import decay_steps_of
from tests.cli_util import make_corpus, run_cli, tiny_args


def _lrs(**kw):
    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0, **kw)
    return [lr_at(s, cfg, 10) for s in range(1, 11)]


def test_warmup_then_linear_decay_over_the_rest():
    assert _lrs(schedule="linear") == pytest.approx([0.5, 1, 1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8], abs=1e-12)


def test_wsd_with_decay_ratio_half():
    assert _lrs(schedule="wsd", decay_ratio=0.5) == pytest.approx([0.5, 1, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2], abs=1e-12)


def test_wsd_decay_shapes_and_floor():
    cos = _lrs(schedule="wsd", decay_ratio=0.5, decay_type="cosine")
    assert cos[:6] == pytest.approx([0.5, 1, 1, 1, 1, 1])
    assert cos[7] == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 5)))
    sq = _lrs(schedule="wsd", decay_ratio=0.5, decay_type="sqrt")
    assert sq[6] == pytest.approx(1 - math.sqrt(1 / 5))
    floor = [lr_at(s, OptimConfig(lr=2.0, warmup_steps=2, min_lr_ratio=0.1, schedule="wsd", decay_ratio=0.5), 10) for s in range(1, 11)]
    assert min(floor) > 0.2 and floor[-1] == pytest.approx(0.2 + 1.8 * 0.2)  # last step above the floor, not wasted


def test_constant_and_cosine():
    assert _lrs(schedule="constant") == [0.5] + [1.0] * 9
    cos = _lrs(schedule="cosine")
    assert cos == pytest.approx([warmup_cosine(s, 1.0, 2, 10, 0.0) for s in range(1, 11)])
    assert cos[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 8)))
    assert cos[0] > 0 and cos[1] == 1.0 and cos[-1] > 0


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="overlaps the 8 warmup steps"):
        decay_steps_of("wsd", 8, 10, 0.5)
    with pytest.raises(ValueError, match="decay_type 'exp'"):
        warmup_stable_decay(5, 1.0, 2, 10, 4, "exp")
    with pytest.raises(ValueError, match="1-based"):
        warmup_stable_decay(0, 1.0, 2, 10, 4)
    with pytest.raises(ValueError, match="--optim.decay-ratio 1.5"):
        OptimConfig(schedule="wsd", decay_ratio=1.5).validate()


def test_pretrain_wsd_resumed_after_step_4_continues_the_schedule(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n_docs=20)
    args = tiny_args(corpus) + ["--steps", "10", "--optim.schedule", "wsd", "--optim.decay-ratio", "0.5", "--optim.lr", "1e-3",
                                "--optim.min-lr-ratio", "0"]
    full = run_cli(args + ["--ckpt-dir", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], tmp_path / "cache", timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    for extra in (["--stop-after", "4"], []):
        r = run_cli(args + extra + ["--ckpt-dir", str(tmp_path / "b"), "--metrics-file", str(tmp_path / "b.jsonl")], tmp_path / "cache",
                    timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    a = [r for r in map(json.loads, (tmp_path / "a.jsonl").read_text().splitlines()) if "event" not in r]  # no resume markers
    b = [r for r in map(json.loads, (tmp_path / "b.jsonl").read_text().splitlines()) if "event" not in r]
    assert [x["step"] for x in b] == list(range(1, 11))
    assert [x["lr"] for x in b] == [x["lr"] for x in a] == pytest.approx([1e-3 * f for f in (0.5, 1, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2)])
    assert [x["loss"] for x in b] == [x["loss"] for x in a]
