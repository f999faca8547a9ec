"""Streaming MindSpore .ckpt import (issue 8, acceptance 6): reading a generated checkpoint of more
than 1 GB (one tensor above MindSpore's 512 MiB slice, so stored as two records) into a dict keeps
the peak RSS increase over the RSS just before the import below 1.2 x the output size. The writer
streams too: its peak increase stays below 1.2 x the largest tensor plus 64 MiB."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_util import ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the RSS peak")

COMMON = """
import json, sys, torch
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
# name -> element count (float32); "big" is 600 MB > 512 MiB, written as two records
SIZES = {"big": 150_000_000, "a": 40_000_000, "b": 40_000_000, "c": 40_000_000, "scalar": 1}
def pattern(name, n):  # a cheap, name-dependent pattern to check the read-back against
    return torch.arange(n, dtype=torch.int32).view(torch.float32).add_(len(name))
"""

MAKE = COMMON + """
from mff.ckpt.mindspore import write_ckpt
before = status("VmRSS:")
reset_peak()
n = write_ckpt(sys.argv[1], ((k, (lambda k=k, n=n: pattern(k, n))) for k, n in SIZES.items()), metadata={"step_num": 3})
print(json.dumps({"bytes": n, "before": before, "peak": status("VmHWM:")}))
"""

READ = COMMON + """
from mff.ckpt.mindspore import read_ckpt, SMALL_RECORD
import mff.ckpt.mindspore as ms
if len(sys.argv) > 2:
    ms.SMALL_RECORD = int(sys.argv[2])  # for measuring the protobuf-only path by hand
before = status("VmRSS:")
reset_peak()
out = read_ckpt(sys.argv[1])
peak = status("VmHWM:")
size = sum(v.numel() * v.element_size() for v in out.values() if isinstance(v, torch.Tensor))
ok = all(torch.equal(out[k].reshape(-1)[:: 9_999_991], pattern(k, n)[:: 9_999_991]) for k, n in SIZES.items())
ok = ok and out["big"].reshape(-1)[-1].view(torch.int32).item() == torch.tensor(SIZES["big"] - 1, dtype=torch.int32).view(torch.float32).add(3).view(torch.int32).item()
print(json.dumps({"before": before, "peak": peak, "output": size, "ok": ok, "step_num": out["step_num"].item()}))
"""


@pytest.mark.slow
def test_ckpt_import_peak_memory(tmp_path):
    path = tmp_path / "big.ckpt"
    t0 = time.perf_counter()
    w = subprocess.run([sys.executable, "-c", MAKE, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert w.returncode == 0, w.stderr
    t1 = time.perf_counter()
    made = json.loads(w.stdout.strip().splitlines()[-1])
    assert made["bytes"] == path.stat().st_size > 1e9
    r = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    t2 = time.perf_counter()
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["ok"] and m["step_num"] == 3
    write_increase, read_increase = made["peak"] - made["before"], m["peak"] - m["before"]
    largest = 150_000_000 * 4
    print(f"\nckpt {made['bytes'] / 1e9:.3f} GB: write {t1 - t0:.1f} s, peak RSS increase {write_increase / 1e9:.3f} GB "
          f"(largest tensor {largest / 1e9:.3f} GB); read {t2 - t1:.1f} s, output {m['output'] / 1e9:.3f} GB, "
          f"peak RSS increase {read_increase / 1e9:.3f} GB, limit {1.2 * m['output'] / 1e9:.3f} GB")
    assert read_increase < 1.2 * m["output"]
    assert write_increase < 1.2 * largest + (64 << 20)
