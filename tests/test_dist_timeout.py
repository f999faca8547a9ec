"""A rank that stops answering: with ``--parallel.timeout-s 30`` the other rank leaves within
60 s, non-zero, with mff's message naming the collective it waited in (acceptance 4)."""

from __future__ import annotations

import re
import time

import pytest

from tests.cli_util import ROOT, make_corpus, tiny_args
from tests.dist_util import torchrun


@pytest.mark.slow
def test_stalled_rank_makes_the_other_fail_with_the_operation_named(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    args = tiny_args(corpus) + ["--steps", "4", "--ckpt-dir", str(tmp_path / "ck"), "--parallel.dp-shard", "2", "--parallel.timeout-s", "30"]
    r = torchrun(2, args, tmp_path / "cache", timeout=240, env={"STALL_RANK": "1", "STALL_STEP": "2"},
                 target=[str(ROOT / "tests" / "stall_driver.py")])
    ended = time.time()
    assert r.returncode != 0
    stalled = re.search(r"stalling at (\d+\.\d+)", r.stderr)
    assert stalled, r.stderr[-3000:]
    assert ("error: rank 0: all_reduce (target token counts) in step 2 timed out after 30 s waiting for the other ranks; "
            "a rank stopped answering") in r.stderr, r.stderr[-3000:]
    waited = ended - float(stalled.group(1))
    assert 30 <= waited < 60, waited
    assert "Timed out waiting" not in r.stderr  # gloo's own message is replaced by mff's
