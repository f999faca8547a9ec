"""A tiny corpus and a tiny model for end-to-end recipe tests (seconds per run on 2 cores)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORDS = ("alpha beta gamma delta model token expert router layer norm rotary latent cache "
         "train step loss grad shard mesh rank world device kernel matrix vector").split()


def make_corpus(folder: Path, n_docs: int = 60, seed: int = 0) -> Path:
    """``n_docs`` small .txt documents of pseudo-random sentences under ``folder``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(rng.randint(5, 15))]
        (folder / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def tiny_args(corpus: Path) -> list[str]:
    """Flags for a 2-layer, 64-wide DeepSeek-V3 with MoE and MTP on the tiny corpus."""
    return [
        "--model", "deepseek3", "--model.hidden-size", "64", "--model.intermediate-size", "128",
        "--model.moe-intermediate-size", "32", "--model.num-hidden-layers", "2", "--model.q-lora-rank", "32",
        "--model.kv-lora-rank", "16", "--model.vocab-size", "512", "--model.num-attention-heads", "2",
        "--seq-len", "32", "--batch-size", "4", "--data.path", str(corpus), "--data.vocab-size", "512",
        "--optim.warmup-steps", "2", "--eval-every", "0", "--threads", "1",
    ]


def cli_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a recipe subprocess: its own cache dir, and none of the process-group
    variables a test in this process may have set (a 1-process group holds its MASTER_PORT)."""
    env = dict(os.environ, MFF_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_cli(args: list[str], cache_dir: Path, **kw) -> subprocess.CompletedProcess:
    """``python -m mff.recipes.pretrain ARGS`` in a fresh process with its own cache dir."""
    return subprocess.run([sys.executable, "-m", "mff.recipes.pretrain", *args], capture_output=True, text=True, env=cli_env(cache_dir),
                          cwd=ROOT, **kw)


def run_cli_streaming(args: list[str], cache_dir: Path, every: int = 25) -> subprocess.CompletedProcess:
    """Like :func:`run_cli` with no time limit (CI has its own), echoing every ``every``-th step
    line and the last lines to the terminal (``sys.__stderr__``, past pytest's capture) while it
    runs, so a slow machine shows progress instead of a silent timeout."""
    with tempfile.TemporaryFile("w+") as err_file:  # a file, not a pipe: a full stderr pipe cannot block the child
        proc = subprocess.Popen([sys.executable, "-m", "mff.recipes.pretrain", *args], stdout=subprocess.PIPE, stderr=err_file,
                                text=True, env=cli_env(cache_dir), cwd=ROOT)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            words = line.split()
            if len(words) > 1 and words[0] == "step" and "/" in words[1] and int(words[1].split("/")[0]) % every == 0:
                sys.__stderr__.write(f"[{' '.join(args[:4])} ...] {line}")
                sys.__stderr__.flush()
        proc.wait()
        err_file.seek(0)
        err = err_file.read()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), err)


def popen_cli(args: list[str], cache_dir: Path) -> subprocess.Popen:
    """Like :func:`run_cli` but returns the running process."""
    env = cli_env(cache_dir)
    return subprocess.Popen([sys.executable, "-m", "mff.recipes.pretrain", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def trained_fixture(root: Path, steps: int, with_metrics: bool = False) -> tuple[Path, Path, Path]:
    """Make a tiny corpus under ``root`` and train ``steps`` steps into ``root/ckpt``.

    Returns ``(corpus, cache_dir, ckpt_dir)``; the metrics file, when asked for, is
    ``ckpt_dir/m.jsonl``."""
    corpus, cache, ckpt = make_corpus(root / "corpus"), root / "cache", root / "ckpt"
    extra = ["--metrics-file", str(ckpt / "m.jsonl")] if with_metrics else []
    r = run_cli(tiny_args(corpus) + ["--steps", str(steps), "--ckpt-dir", str(ckpt), *extra], cache, timeout=600)
    assert r.returncode == 0, r.stderr
    return corpus, cache, ckpt


def wait_for(proc: subprocess.Popen, ready, timeout: float = 300.0) -> None:
    """Poll until ``ready()`` is true while ``proc`` runs; fail if it ends or time runs out first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the test could signal it"
    assert ready(), f"not ready after {timeout} s"


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> hex), to prove nothing changed."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
