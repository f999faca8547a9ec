"""``python -m mff.recipes.finetune`` end to end on tiny chat checkpoints: full fine-tuning and
LoRA, exports (PEFT, merged HF), generation with an adapter, resuming after ``kill -9`` with
bitwise the losses of an uninterrupted run, real multi-turn dialogues (chitchat-dataset), a
MindFormers finetune YAML, and bad input (one clear line, nothing left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mff
import mff.peft as mp
from mff import ckpt
from mff.ckpt.checkpoint import open_tensors
from tests.cli_util import ROOT, cli_env, wait_for
from tests.package_data import chitchat_sharegpt
from tests.sft_util import make_chat_checkpoint, run_finetune, write_rows

FAST = ["--seq-len", "128", "--batch-size", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("base") / "qwen3")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    return write_rows(tmp_path_factory.mktemp("rows") / "chat.jsonl", 40)


def _metrics(path: Path) -> dict[int, dict]:
    """The last record of each step (a rerun after a kill logs the steps after the checkpoint again)."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:  # a resume marker
            out[rec["step"]] = rec
    return out


def test_help_lists_the_fine_tuning_options(tmp_path):
    r = run_finetune(["--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for flag in ("--lora.r", "--lora.alpha", "--lora.targets", "--lora.init-from", "--data.train-on", "--data.pack", "--epochs",
                 "--data.template", "--init-from", "--stop-after"):
        assert flag in r.stdout, flag


def test_lora_run_exports_and_generates(base, rows, tmp_path):
    run = tmp_path / "lora"
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(run), "--lora.r", "4", "--lora.alpha", "16",
                      "--optim.lr", "5e-3", "--steps", "8", "--eval-every", "4", "--metrics-file", str(run / "m.jsonl"), *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "LoRA r 4, alpha 16 (scale 4) on 14 weights" in r.stdout and "38 train, 2 held out" in r.stdout
    m = _metrics(run / "m.jsonl")
    assert m[8]["val_loss"] < m[4]["val_loss"] + 1.0 and "epoch" in m[8]
    step = ckpt.latest_step_dir(run)
    meta = ckpt.read_meta(step)
    assert meta["lora"]["r"] == 4 and meta["base"]["path"] == str(base.absolute())
    stored = open_tensors(step, meta, "model").names
    assert stored and all(n.endswith((".lora_A", ".lora_B")) for n in stored)  # the checkpoint holds only the adapters
    assert (run / "tokenizer_config.json").is_file()  # the chat template travels with the run
    # exports: PEFT adapter and the merged HF folder; both give the run's model
    assert subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(run), "--to", "peft", "--dst", str(tmp_path / "peft")],
                          capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT).returncode == 0
    assert subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(run), "--to", "hf", "--dst", str(tmp_path / "hf")],
                          capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT).returncode == 0
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    model, params = mff.load(base)
    lm, both = mff.load(run, merged=False)
    _, merged_run = mff.load(run)
    _, via_peft = mff.load(base, adapter=tmp_path / "peft")
    _, merged_hf = mff.load(tmp_path / "hf")
    with torch.no_grad():
        ref = lm.forward(both, {"input_ids": ids}).logits
        for p in (merged_run, via_peft, merged_hf):
            torch.testing.assert_close(model.forward(p, {"input_ids": ids}).logits, ref, atol=1e-5, rtol=0)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"].startswith("{% for message")
    g = subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(base), "--adapter", str(tmp_path / "peft"), "--chat",
                        "--prompt", "alpha beta", "--max-new-tokens", "4"], capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT)
    assert g.returncode == 0, g.stderr
    # training continues from the exported PEFT adapter
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(tmp_path / "more"),
                      "--lora.init-from", str(tmp_path / "peft"), "--steps", "1", *FAST], tmp_path)
    assert r.returncode == 0 and "adapters from" in r.stdout and "r 4, alpha 16" in r.stdout, r.stderr


def test_full_fine_tuning_moe(tmp_path):
    base = make_chat_checkpoint(tmp_path / "moe", "qwen3_moe")
    rows = write_rows(tmp_path / "a.jsonl", 24, "alpaca")
    run = tmp_path / "full"
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(run), "--epochs", "1", "--data.pack", *FAST],
                     tmp_path)
    assert r.returncode == 0, r.stderr
    assert "full fine-tuning" in r.stdout and "packed into" in r.stdout and "export: python -m mff.recipes.convert" in r.stdout
    assert "steps 2 (" in r.stdout  # one epoch of the packed rows at batch 4
    model, params = mff.load(run)
    assert model.family.name == "qwen3_moe" and model.lora is None


def test_resume_after_kill_9_gives_bitwise_the_same_losses(base, rows, tmp_path):
    args = ["--init-from", str(base), "--data.path", str(rows), "--lora.r", "4", "--steps", "10", "--save-every", "3",
            "--eval-every", "0", *FAST]
    straight = tmp_path / "straight"
    r = run_finetune([*args, "--ckpt-dir", str(straight), "--metrics-file", str(straight / "m.jsonl")], tmp_path)
    assert r.returncode == 0, r.stderr
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "mff.recipes.finetune", *args, "--ckpt-dir", str(killed), "--metrics-file",
                             str(killed / "m.jsonl")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=cli_env(tmp_path), cwd=ROOT)
    wait_for(proc, lambda: (killed / "latest").is_file())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = ckpt.read_meta(ckpt.latest_step_dir(killed))["step"]
    assert first < 10
    r = run_finetune([*args, "--ckpt-dir", str(killed), "--metrics-file", str(killed / "m.jsonl")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {killed / ckpt.step_dir_name(first)}" in r.stdout
    a, b = _metrics(straight / "m.jsonl"), _metrics(killed / "m.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in range(1, 11):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"], step
    sa, sb = ckpt.latest_step_dir(straight), ckpt.latest_step_dir(killed)
    for name in open_tensors(sa, ckpt.read_meta(sa), "model").names:
        ta = open_tensors(sa, ckpt.read_meta(sa), "model").read(name)
        assert torch.equal(ta, open_tensors(sb, ckpt.read_meta(sb), "model").read(name)), name


def test_chitchat_dialogues_train(base, tmp_path):
    """Real multi-turn human dialogues (chitchat-dataset 0.9.0) in sharegpt form."""
    rows = chitchat_sharegpt(tmp_path / "chitchat.jsonl", 80)
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(tmp_path / "cc"), "--lora.r", "4",
                      "--steps", "4", "--eval-every", "4", "--seq-len", "256", "--batch-size", "4", "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "80 rows" in r.stdout and "truncated" in r.stdout and "val_loss" in r.stdout


YAML = Path(__file__).parent / "data" / "mindformers" / "finetune_qwen3_lora.yaml"


def test_mindformers_finetune_yaml(base, tmp_path):
    data = write_rows(tmp_path / "alpaca.json", 30, "alpaca")
    data.write_text(json.dumps([json.loads(x) for x in data.read_text().splitlines()]))
    cfg = tmp_path / "finetune_qwen3.yaml"
    text = YAML.read_text().replace("./output", str(tmp_path / "out")).replace("/path/to/Qwen3", str(base))
    cfg.write_text(text.replace("/path/to/alpaca_data.json", str(data)))
    r = run_finetune(["--from-mindformers-yaml", str(cfg), "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    cmd = next(line for line in r.stdout.splitlines() if line.startswith("mff command:"))
    for part in (f"--init-from {base}", "--lora.r 8", "--lora.alpha 16.0", "--lora.targets 'q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa' o_proj "
                 "'gate_proj|up_proj|gate_up_proj' down_proj", f"--data.path {data}", "--data.limit 20",
                 "--data.template mindformers-alpaca", "--data.pack", "--seq-len 384", "--epochs 1.0", "--batch-size 2",
                 "--optim.lr 0.0001", "--optim.schedule constant", "--warmup-ratio 0.0", "--data.no-shuffle"):
        assert part in cmd, part
    assert "mff.recipes.finetune" in cmd
    ignored = r.stdout.split("ignored MindFormers keys", 1)[1]
    assert ".*word_embeddings (LoRA on the embedding is not supported)" in ignored
    assert "model.model_config.qkv_concat (the model config comes from the --init-from checkpoint)" in ignored
    assert "LoRA r 8, alpha 16" in r.stdout and ckpt.latest_step_dir(tmp_path / "out") is not None


def _fails(args, tmp_path, match, code=2):
    r = run_finetune(args, tmp_path)
    assert r.returncode == code, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert match in lines[0], lines[0]
    return lines[0]


def test_bad_input(base, rows, tmp_path):
    out = tmp_path / "out"
    common = ["--init-from", str(base), "--ckpt-dir", str(out), *FAST]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    _fails([*common, "--data.path", str(bad)], tmp_path, "bad.jsonl:1: the row has no assistant turn")
    bad.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}) + "\n")
    _fails([*common, "--data.path", str(bad)], tmp_path, "unknown role 'from': 'robot'")
    bad.write_text(json.dumps({"question": "hi", "answer": "x"}) + "\n")
    _fails([*common, "--data.path", str(bad)], tmp_path, "cannot tell the row's format from its keys ['answer', 'question']")
    bad.write_text("")
    _fails([*common, "--data.path", str(bad)], tmp_path, "holds no rows (an empty file)")
    _fails([*common, "--data.path", str(rows), "--lora.r", "4", "--lora.targets", "q_prj"], tmp_path, "LoRA target 'q_prj' matches no weight")
    _fails([*common, "--data.path", str(rows), "--lora.targets", "q_proj"], tmp_path, "--lora.targets, --lora.dropout and --lora.rslora need --lora.r")
    _fails([*common, "--data.path", str(rows), "--lora.r", "0", "--lora.alpha", "8"], tmp_path, "--lora.r 0 must be >= 1")
    _fails([*common, "--data.path", str(rows), "--lora.r", "-2"], tmp_path, "--lora.r -2 must be >= 1")
    _fails([*common, "--data.path", str(rows), "--lora.r", "4", "--lora.alpha", "0"], tmp_path, "--lora.alpha 0.0 must be > 0")
    _fails([*common, "--data.path", str(rows), "--lora.r", "4", "--optim.name", "muon"], tmp_path, "--optim.name muon is for full fine-tuning")
    _fails(["--data.path", str(rows), "--ckpt-dir", str(out)], tmp_path, "--init-from is required")
    # a checkpoint without a chat template
    no_tpl = make_chat_checkpoint(tmp_path / "no_template")
    (no_tpl / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    _fails(["--init-from", str(no_tpl), "--ckpt-dir", str(out), "--data.path", str(rows), *FAST], tmp_path, "has no chat template")
    # an adapter made for another base: the tensor and both shapes
    other = make_chat_checkpoint(tmp_path / "wide", hidden_size=96)
    model, _ = mff.load(other)
    lm = mp.add_lora(model, r=4)
    mp.save_peft(lm, mp.init_adapters(lm), tmp_path / "wide_adapter")
    line = _fails([*common, "--data.path", str(rows), "--lora.init-from", str(tmp_path / "wide_adapter")], tmp_path, "has shape")
    assert "96" in line and "needs (" in line and "another base" in line  # the tensor, its shape and the shape the base needs
    assert not out.exists()  # no run folder, no half-written checkpoint
    # a LoRA folder rerun as full fine-tuning is refused, naming the folder
    r = run_finetune([*common, "--data.path", str(rows), "--lora.r", "4", "--steps", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    _fails([*common, "--data.path", str(rows), "--steps", "2"], tmp_path, "holds LoRA adapters (r 4); this run is full fine-tuning", 1)
    _fails([*common, "--data.path", str(rows), "--steps", "2", "--lora.r", "8"], tmp_path, "this run has r 8", 1)


def test_pretraining_and_fine_tuning_folders_are_not_continued_by_the_other_recipe(base, rows, tmp_path):
    """A pretraining run's --ckpt-dir given to finetune (the README once reused runs/tp2) is refused
    before anything is read from it, and the reverse, naming the folder and both recipes."""
    from tests.cli_util import make_corpus, run_cli, tiny_args

    pre = tmp_path / "pre"
    r = run_cli([*tiny_args(make_corpus(tmp_path / "corpus", 20)), "--steps", "2", "--ckpt-dir", str(pre)], tmp_path)
    assert r.returncode == 0, r.stderr
    line = _fails(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(pre), *FAST], tmp_path,
                  "is a checkpoint of a pretrain run; a finetune run cannot continue it", 1)
    assert str(pre) in line
    ft = tmp_path / "ft"
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(ft), "--steps", "1", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli([*tiny_args(tmp_path / "corpus"), "--steps", "3", "--ckpt-dir", str(ft)], tmp_path)
    assert r.returncode == 1 and "is a checkpoint of a finetune run; a pretrain run cannot continue it" in r.stderr, r.stderr


def test_a_failed_start_leaves_no_folder(base, rows, tmp_path):
    out = tmp_path / "out"
    _fails(["--init-from", str(base), "--ckpt-dir", str(out), "--data.path", str(rows), "--seq-len", "100000"], tmp_path, "--seq-len 100000")
    assert not out.exists()


@pytest.mark.parametrize("family,layout", [("qwen3", ["--parallel.tp", "2"]), ("qwen3_moe", ["--parallel.ep", "2"])])
def test_torchrun_lora_equals_one_process_and_resumes_on_one(family, layout, rows, tmp_path):
    """The recipe under torchrun (2 processes): the losses of the one-process run, a sharded
    checkpoint that one process resumes and exports."""
    from tests.dist_util import torchrun

    base = make_chat_checkpoint(tmp_path / "base", family)
    args = ["--init-from", str(base), "--data.path", str(rows), "--lora.r", "4", "--steps", "3", "--eval-every", "3", *FAST]
    one, two = tmp_path / "one", tmp_path / "two"
    r = run_finetune([*args, "--ckpt-dir", str(one), "--metrics-file", str(one / "m.jsonl")], tmp_path)
    assert r.returncode == 0, r.stderr
    r = torchrun(2, [*args, *layout, "--ckpt-dir", str(two), "--metrics-file", str(two / "m.jsonl")], tmp_path,
                 target=["-m", "mff.recipes.finetune"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _metrics(one / "m.jsonl"), _metrics(two / "m.jsonl")
    for step in (1, 2, 3):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-5)
    assert b[3]["val_loss"] == pytest.approx(a[3]["val_loss"], abs=1e-5)
    assert (ckpt.latest_step_dir(two) / "model-rank00001-of-00002.safetensors").is_file()
    r = run_finetune([*args[:-len(FAST)], *FAST, "--steps", "4", "--ckpt-dir", str(two)], tmp_path)  # one process continues
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr


def test_bf16_lora_run_loads_and_a_changed_base_is_refused(base, rows, tmp_path):
    """The base fingerprint is the same in fp32 and bf16; it covers every weight, so a base whose
    MLP weight changed is refused on resume; convert --to peft needs no base."""
    import shutil

    run = tmp_path / "bf16"
    args = ["--data.path", str(rows), "--ckpt-dir", str(run), "--lora.r", "4", "--steps", "2", *FAST]
    r = run_finetune(["--init-from", str(base), *args, "--precision", "bf16-mixed"], tmp_path)
    assert r.returncode == 0, r.stderr
    model, merged = mff.load(run)
    _, merged16 = mff.load(run, dtype=torch.bfloat16)
    assert merged16["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    changed = tmp_path / "changed"
    shutil.copytree(base, changed)
    _, p = mff.load(changed)
    p["model.layers.1.mlp.down_proj.weight"] += 1.0
    shutil.rmtree(changed)
    mff.save_hf(model, p, changed, extra_files={n: (base / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json")})
    _fails(["--init-from", str(changed), *args, "--precision", "bf16-mixed", "--steps", "3"], tmp_path, "trained on another base", 1)
    moved = tmp_path / "moved_base"
    shutil.move(str(base), moved)
    try:
        with pytest.raises(ckpt.CheckpointError, match="does not exist here"):
            mff.load(run)
        c = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(run), "--to", "peft", "--dst", str(tmp_path / "p")],
                           capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT)
        assert c.returncode == 0, c.stderr
        _, again = mff.load(moved, adapter=tmp_path / "p")
        torch.testing.assert_close(again["model.layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"])
    finally:
        shutil.move(str(moved), base)


def test_rows_with_unicode_separators_and_a_bom_are_read(tmp_path):
    from mff.data.sft_rows import read_rows, to_messages

    p = tmp_path / "u.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"instruction": "a\u2028b\u0085c", "output": "d"}, ensure_ascii=False) + "\n").encode())
    assert to_messages(read_rows([str(p)])[0])[0]["content"] == "a\u2028b\u0085c"
    p.write_text("[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(ValueError, match="u.jsonl:1: not valid JSON \\(nested too deeply\\)"):
        read_rows([str(p)])
    p.write_text(json.dumps({"instruction": "\ud800", "output": "x"}) + "\n")
    with pytest.raises(ValueError, match="u.jsonl:1: 'instruction' holds a lone surrogate"):
        to_messages(read_rows([str(p)])[0])


@pytest.mark.parametrize("change,match", [({"rank_pattern": {"[": 2}}, "rank_pattern holds '\\['"),
                                          ({"rank_pattern": [1, 2]}, "rank_pattern must be an object"),
                                          ({"lora_alpha": float("inf")}, "lora_alpha=inf must be a finite number"),
                                          ({"lora_dropout": "abc"}, "lora_dropout='abc' must be a number")])
def test_bad_peft_configs(base, tmp_path, change, match):
    model, _ = mff.load(base)
    lm = mp.add_lora(model, r=4)
    mp.save_peft(lm, mp.init_adapters(lm), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(mp.PeftFormatError, match=match):
        mp.read_peft(tmp_path / "a", model)


def test_a_chat_template_given_by_flag_is_kept_with_the_run(base, rows, tmp_path):
    tpl = tmp_path / "tpl.jinja"
    tpl.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
    run = tmp_path / "run"
    r = run_finetune(["--init-from", str(base), "--data.path", str(rows), "--ckpt-dir", str(run), "--lora.r", "2", "--steps", "1",
                      "--data.chat-template", str(tpl), *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "tokenizer_config.json").read_text())["chat_template"] == tpl.read_text()
