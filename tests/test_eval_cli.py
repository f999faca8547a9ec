"""Issue 15, acceptance 5 and 7: a continuation that merges with its context into one token is
still scored (on a tokenizer built here where "xa" + "b" encodes as "x" "ab") and the count is
reported; bad input gives one clear line: unknown task, a task file with missing fields,
--limit 0, a checkpoint without a tokenizer, --num-fewshot larger than the pool; a context
longer than the model's length is cut from the left and counted."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tokenizers import Tokenizer, models

import mff
from mff.eval.tokens import EncodeStats, encode_pair
from mff.recipes.eval import main

VOCAB = {"<eos>": 0, "x": 1, "a": 2, "b": 3, "ab": 4, " ": 5, "c": 6, "Q": 7, "y": 8}


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=VOCAB, merges=[("a", "b")]))  # no pre-tokenizer: "a" + "b" merge across the join
    tok.add_special_tokens(["<eos>"])
    return tok


def _checkpoint(folder, tokenizer: bool = True):
    cfg = dataclasses.replace(mff.build("qwen3").config, vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    model = mff.build("qwen3", cfg)
    extra = {"tokenizer.json": _tokenizer().to_str(), "tokenizer_config.json": json.dumps({"eos_token": "<eos>"})} if tokenizer else {}
    mff.save_hf(model, model.init(0), folder, extra_files=extra)
    return folder


def _task(folder, rows, name="tiny", delimiter=" ", missing: str | None = None, text="{{q}}", kwargs=None):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = {"task": name, "dataset_path": "json", "dataset_kwargs": kwargs or {"data_files": {"test": str(data)}}, "test_split": "test",
            "output_type": "multiple_choice", "doc_to_text": text, "doc_to_choice": "choices", "doc_to_target": "answer",
            "target_delimiter": delimiter}
    keys.pop(missing, None)
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(keys))  # JSON is YAML
    return path


def _run(capsys, *args):
    rc = main(["--no-progress", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_merged_continuation_is_scored_alone():
    tok = _tokenizer()
    enc = lambda s: tok.encode(s).ids  # noqa: E731
    assert enc("xab")[len(enc("xa")):] == []  # lm-eval's split leaves nothing to score here
    stats = EncodeStats()
    assert encode_pair(enc, "xa", "b", 0, stats) == ([1, 2], [3]) and stats.merged == 1
    assert encode_pair(enc, "xa", "c", 0, stats) == ([1, 2], [6]) and stats.merged == 1


def test_recipe_reports_merged_continuations(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt")
    rows = [{"q": "xa", "choices": ["b", "c"], "answer": 0}, {"q": "Qxa", "choices": ["c", "b"], "answer": 1},
            {"q": "y", "choices": ["x", "c"], "answer": 0}]
    task = _task(tmp_path, rows, delimiter="")
    rc, out, err = _run(capsys, "--ckpt", str(ckpt), "--tasks", str(task), "--output", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert "note: tiny: 2 merged continuations" in err
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["tasks"]["tiny"]["counts"]["merged_continuations"] == 2
    model, params = mff.load(ckpt)
    with torch.no_grad():
        lp = torch.log_softmax(model.forward(params, {"input_ids": torch.tensor([[1, 2, 3]])}).logits[0, 1].float(), -1)
    assert res["samples"]["tiny"][0]["loglikelihoods"][0] == pytest.approx(float(lp[3]), abs=1e-5)  # log p("b" | "x" "a")


def test_long_context_is_cut_from_the_left_and_counted(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt")
    rows = [{"q": "xy" * 40, "choices": ["a", "c"], "answer": 0}, {"q": "x", "choices": ["a", "c"], "answer": 1}]
    rc, out, err = _run(capsys, "--ckpt", str(ckpt), "--tasks", str(_task(tmp_path, rows)), "--output", "")
    assert rc == 0, err
    assert "note: tiny: 2 truncated requests" in err
    assert "tiny" in out and "acc" in out


@pytest.mark.parametrize("case", ["unknown_task", "missing_field", "limit_0", "no_tokenizer", "fewshot", "negative_fewshot", "ppl_missing",
                                  "row_missing_field", "undefined_name", "kwargs_not_mapping", "duplicate", "output_folder"])
def test_bad_input_one_clear_line(tmp_path, capsys, case):
    ckpt = _checkpoint(tmp_path / "ckpt", tokenizer=case != "no_tokenizer")
    rows = [{"q": "x", "choices": ["a", "c"], "answer": 0}] * 3
    args = {"unknown_task": lambda: ["--tasks", "arc_eazy"],
            "missing_field": lambda: ["--tasks", str(_task(tmp_path, rows, missing="doc_to_choice"))],
            "limit_0": lambda: ["--tasks", str(_task(tmp_path, rows)), "--limit", "0"],
            "no_tokenizer": lambda: ["--tasks", str(_task(tmp_path, rows))],
            "fewshot": lambda: ["--tasks", str(_task(tmp_path, rows)), "--num-fewshot", "5"],
            "negative_fewshot": lambda: ["--tasks", str(_task(tmp_path, rows)), "--num-fewshot", "-1"],
            "ppl_missing": lambda: ["--tasks", f"ppl:{tmp_path / 'nope.txt'}"],
            "row_missing_field": lambda: ["--tasks", str(_task(tmp_path, rows + [{"q": "x", "answer": 0}]))],
            "undefined_name": lambda: ["--tasks", str(_task(tmp_path, rows, text="Q: {{ nope }}"))],
            "kwargs_not_mapping": lambda: ["--tasks", str(_task(tmp_path, rows, kwargs=[1, 2]))],
            "duplicate": lambda: ["--tasks", f"{_task(tmp_path, rows)},{_task(tmp_path, rows)}"],
            "output_folder": lambda: ["--tasks", str(_task(tmp_path, rows)), "--output", str(tmp_path)]}[case]()
    want = {"unknown_task": "unknown task 'arc_eazy'; known: arc_easy, arc_challenge, hellaswag, piqa, boolq, mmlu, gsm8k, humaneval",
            "missing_field": "missing key(s) doc_to_choice",
            "limit_0": "--limit 0 must be >= 1",
            "no_tokenizer": "comes with no tokenizer",
            "fewshot": "--num-fewshot 5 is larger than the few-shot pool of tiny (2 examples); use at most 2",
            "negative_fewshot": "--num-fewshot -1 must be >= 0",
            "ppl_missing": "no file",
            "row_missing_field": "doc_to_choice names the field 'choices', which a data row lacks (its fields: answer, q)",
            "undefined_name": "'nope' is undefined",
            "kwargs_not_mapping": "dataset_kwargs must be a mapping",
            "duplicate": "are both named 'tiny'",
            "output_folder": "exists and is not a regular file"}[case]
    rc, out, err = _run(capsys, "--ckpt", str(ckpt), *(["--output", ""] if "--output" not in args else []), *args)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err
    assert "Traceback" not in err


def test_json_has_no_nan(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt")
    rc, out, err = _run(capsys, "--ckpt", str(ckpt), "--tasks", str(_task(tmp_path, [{"q": "x", "choices": ["a", "c"], "answer": 0}])),
                        "--output", str(tmp_path / "r.json"))
    assert rc == 0, err
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and json.loads(text)["results"]["tiny"]["acc_stderr"] is None  # one document: no stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("r.json")) == ["r.json"]
