"""Issue 15: under torchrun the documents are split over the data-parallel ranks and the results
gathered; the numbers do not depend on the rank count (2 processes, gloo on the CPU, against
one process). The generation task checks the split of generate_until requests too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_util import ROOT, cli_env
from tests.dist_util import torchrun
from tests.eval_util import write_mc_task, write_ppl_task
from tests.sft_util import make_chat_checkpoint


def _gen_task(folder):
    rows = [{"q": f"count {i}", "a": "alpha"} for i in range(5)]
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "gen.yaml").write_text(json.dumps({"task": "gen", "dataset_path": "json", "dataset_kwargs": {"data_files": str(folder / "gen.jsonl")},
                                                 "test_split": "train", "output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "a",
                                                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8}}))
    return folder / "gen.yaml"


def test_two_ranks_give_the_numbers_of_one(tmp_path):
    ckpt = make_chat_checkpoint(tmp_path / "ckpt", "qwen3", seed=4)
    tasks = ",".join(map(str, [write_mc_task(tmp_path, n=11), write_ppl_task(tmp_path, n=5), _gen_task(tmp_path)]))
    args = ["--ckpt", str(ckpt), "--tasks", tasks, "--batch-size", "4", "--max-length", "64", "--no-progress"]
    one = subprocess.run([sys.executable, "-m", "mff.recipes.eval", *args, "--output", str(tmp_path / "one.json")], capture_output=True,
                         text=True, cwd=ROOT, env=cli_env(tmp_path / "cache"), timeout=300)
    assert one.returncode == 0, one.stderr
    two = torchrun(2, args + ["--output", str(tmp_path / "two.json")], tmp_path / "cache", target=("-m", "mff.recipes.eval"))
    assert two.returncode == 0, two.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert b["timings"]["world_size"] == 2
    assert a["results"]["tiny_mc"] == b["results"]["tiny_mc"]
    assert a["results"]["gen"] == b["results"]["gen"]
    assert [s["completion"] for s in a["samples"]["gen"]] == [s["completion"] for s in b["samples"]["gen"]]
    for x, y in zip(a["samples"]["tiny_mc"], b["samples"]["tiny_mc"]):
        assert x["loglikelihoods"] == pytest.approx(y["loglikelihoods"], abs=1e-5)
    assert a["results"]["tiny_ppl"]["word_perplexity"] == pytest.approx(b["results"]["tiny_ppl"]["word_perplexity"], rel=1e-6)
    assert b["tasks"]["tiny_mc"]["samples"] == 11
    assert sum(line.startswith("tiny_mc ") and " acc " in line for line in two.stdout.splitlines()) == 1  # one table, from rank 0
