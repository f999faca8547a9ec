"""Issue 15, acceptance 1: the same numbers three ways. On a tiny random HF model, lm-eval's own
``hf`` backend (transformers) and mff's ``mff`` backend give identical acc / acc_norm on a
local-json multiple-choice task and per-request log-likelihoods within 1e-4 (fp32), rolling
log-likelihoods included (windows of 64 tokens, so texts span several); and
``python -m mff.recipes.eval`` on the same task file gives the mff backend's numbers."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lm_eval")

from tests.eval_util import write_mc_task, write_ppl_task  # noqa: E402
from tests.sft_util import make_chat_checkpoint  # noqa: E402

WINDOW = 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    os.environ.setdefault("HF_DATASETS_CACHE", str(root / "hf-datasets"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    ckpt = make_chat_checkpoint(root / "ckpt", "qwen3", seed=3)
    mc, ppl = write_mc_task(root), write_ppl_task(root)
    return root, ckpt, mc, ppl


def _evaluate(model, root):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=["tiny_mc", "tiny_ppl"], task_manager=TaskManager(include_path=str(root)),
                                   log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _responses(out, task):
    """Per-request results of ``task`` in (doc, request) order."""
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] if isinstance(r, list) else r for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def both(setup):
    from lm_eval.models.huggingface import HFLM

    from mff.eval.harness import MffLM

    root, ckpt, _, _ = setup
    hf = _evaluate(HFLM(pretrained=str(ckpt), dtype="float32", batch_size=8, device="cpu", max_length=WINDOW), root)
    ours = _evaluate(MffLM(pretrained=str(ckpt), dtype="float32", batch_size=8, device="cpu", max_length=WINDOW), root)
    return hf, ours


def test_mff_backend_matches_hf_backend(both):
    hf, ours = both
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == hf["results"]["tiny_mc"][metric]
    a, b = _responses(hf, "tiny_mc"), _responses(ours, "tiny_mc")
    assert len(a) == 24 and all(len(x) == 4 for x in a)
    for ra, rb in zip(a, b):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(ra, rb):
            assert abs(float(lp_a) - float(lp_b)) < 1e-4
            assert bool(greedy_a) == bool(greedy_b)
    ra, rb = _responses(hf, "tiny_ppl"), _responses(ours, "tiny_ppl")
    assert len(ra) == 6
    for x, y in zip(ra, rb):
        assert abs(float(x[0]) - float(y[0])) < 1e-4 * max(1.0, abs(float(x[0])) / 100)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_ppl"][metric] == pytest.approx(hf["results"]["tiny_ppl"][metric], rel=1e-5)


def test_windows_span_several(setup):
    """The rolling texts are longer than the 64-token window (else the test would not test windows)."""
    from tokenizers import Tokenizer

    root, ckpt, _, ppl = setup
    import json

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    lengths = [len(tok.encode(json.loads(line)["text"]).ids) for line in (root / "tiny_ppl.jsonl").read_text().splitlines()]
    assert max(lengths) > 2 * WINDOW and min(lengths) < WINDOW


def test_recipe_matches_mff_backend(setup, both, tmp_path):
    from mff.recipes.eval import EvalConfig, run

    root, ckpt, mc, ppl = setup
    _, ours = both
    results = {r.task: r for r in run(EvalConfig(ckpt=str(ckpt), tasks=f"{mc},{ppl}", batch_size=5, max_length=WINDOW,
                                                 output=str(tmp_path / "r.json"), progress=False))}
    assert results["tiny_mc"].metrics["acc"] == ours["results"]["tiny_mc"]["acc,none"]
    assert results["tiny_mc"].metrics["acc_norm"] == ours["results"]["tiny_mc"]["acc_norm,none"]
    theirs = _responses(ours, "tiny_mc")
    for d, r in zip(results["tiny_mc"].details, theirs):
        assert d["loglikelihoods"] == pytest.approx([float(x[0]) for x in r], abs=1e-4)
    ppl_ours = [float(x[0]) for x in _responses(ours, "tiny_ppl")]
    assert [d["loglikelihood"] for d in results["tiny_ppl"].details] == pytest.approx(ppl_ours, abs=1e-3)
    assert results["tiny_ppl"].metrics["word_perplexity"] == pytest.approx(ours["results"]["tiny_ppl"]["word_perplexity,none"], rel=1e-5)
    assert (tmp_path / "r.json").is_file()


def test_harness_cli_runs_lm_eval_with_the_mff_backend(setup, both, tmp_path):
    """``python -m mff.recipes.eval --harness -- ...`` is lm-eval's own CLI with ``--model mff``."""
    import json
    import subprocess
    import sys

    from tests.cli_util import ROOT

    root, ckpt, _, _ = setup
    _, ours = both
    r = subprocess.run([sys.executable, "-m", "mff.recipes.eval", "--harness", "--", "--model", "mff", "--model_args",
                        f"pretrained={ckpt},max_length={WINDOW}", "--tasks", "tiny_mc", "--include_path", str(root), "--batch_size", "8",
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hfd")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny_mc" in r.stdout and "acc" in r.stdout
    (result,) = list((tmp_path / "out").rglob("results_*.json"))
    got = json.loads(result.read_text())["results"]["tiny_mc"]
    assert got["acc,none"] == ours["results"]["tiny_mc"]["acc,none"]
    assert got["acc_norm,none"] == ours["results"]["tiny_mc"]["acc_norm,none"]


def test_harness_needs_a_checkpoint():
    from mff.eval.harness import MffLM

    with pytest.raises(ValueError, match="pretrained=PATH"):
        MffLM()
    with pytest.raises(ValueError, match="dtype='fp8'"):
        MffLM(pretrained="x", dtype="fp8")
