"""Streaming MindFormers import (issue 8, acceptance 6, through the name/layout maps): importing a
generated Mcore ``.ckpt`` of more than 1 GB into mff params keeps the peak RSS increase over the
RSS just before the import below 1.2 x the output size (the params)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_util import ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the RSS peak")

CONFIG = dict(vocab_size=16000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8,
              num_key_value_heads=4, head_dim=128, max_position_embeddings=512, tie_word_embeddings=False)

MAKE = f"""
import sys, torch, mff
from mff.ckpt.mindformers import save_mindformers
from mff.models.qwen3 import Qwen3Config
model = mff.build("qwen3", Qwen3Config(**{CONFIG!r}))
gen = torch.Generator().manual_seed(0)
params = {{k: torch.empty(s).uniform_(-1, 1, generator=gen) for k, s in model.param_shapes().items()}}
save_mindformers(sys.argv[1], model, params)
# spot values to check the import against: row 3 of layer 0's q_proj and of the embedding
print(params["model.layers.0.self_attn.q_proj.weight"][3, :4].tolist(), params["model.embed_tokens.weight"][3, :4].tolist())
"""

IMPORT = f"""
import json, sys, torch
from mff.ckpt.mindformers import load_mindformers
from mff.models.qwen3 import Qwen3Config
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
cfg = Qwen3Config(**{CONFIG!r})
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
ck = load_mindformers(sys.argv[1], "qwen3", cfg)
peak = status("VmHWM:")
out = sum(t.numel() * t.element_size() for t in ck.params.values())
spots = [ck.params["model.layers.0.self_attn.q_proj.weight"][3, :4].tolist(), ck.params["model.embed_tokens.weight"][3, :4].tolist()]
print(json.dumps({{"before": before, "peak": peak, "output": out, "spots": spots}}))
"""


@pytest.mark.slow
def test_mindformers_import_peak_memory(tmp_path):
    path = tmp_path / "big.ckpt"
    t0 = time.perf_counter()
    w = subprocess.run([sys.executable, "-c", MAKE, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert w.returncode == 0, w.stderr
    assert path.stat().st_size > 1e9
    t1 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", IMPORT, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    t2 = time.perf_counter()
    m = json.loads(r.stdout.strip().splitlines()[-1])
    want = [json.loads(part) for part in w.stdout.strip().splitlines()[-1].replace("] [", "]|[").split("|")]
    assert m["spots"] == want
    increase = m["peak"] - m["before"]
    print(f"\nMcore .ckpt {path.stat().st_size / 1e9:.3f} GB: write {t1 - t0:.1f} s; import {t2 - t1:.1f} s, params {m['output'] / 1e9:.3f} GB, "
          f"peak RSS increase {increase / 1e9:.3f} GB ({increase / m['output']:.2f} x), limit 1.2 x")
    assert increase < 1.2 * m["output"]
