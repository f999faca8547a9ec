"""Local evaluation tasks for tests: random multiple-choice rows and texts, with lm-eval task
YAML files that both ``lm_eval --include_path`` and ``mff.recipes.eval --tasks FILE.yaml`` read."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.cli_util import WORDS


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_mc_task(folder: Path, n: int = 24, seed: int = 0, name: str = "tiny_mc") -> Path:
    """``folder/name.yaml`` + ``name.jsonl``: ``n`` 4-choice questions (answer = index)."""
    rng = random.Random(seed)
    rows = [{"question": _words(rng, 5, 12), "choices": [_words(rng, 1, 4) for _ in range(4)], "answer": rng.randrange(4)} for _ in range(n)]
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return folder / f"{name}.yaml"


def write_ppl_task(folder: Path, n: int = 6, seed: int = 1, name: str = "tiny_ppl", words: tuple[int, int] = (20, 160)) -> Path:
    """``folder/name.yaml`` + ``name.jsonl``: ``n`` texts scored by rolling log-likelihood."""
    rng = random.Random(seed)
    rows = [{"text": _words(rng, *words)} for _ in range(n)]
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder / f"{name}.yaml"
