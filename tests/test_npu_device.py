"""The recipes on an Ascend node in miniature: the stand-in registered as torch's npu device
module in a subprocess (tests/npu_standin.py: register_device_standin; tensors on its npu device
compute on the CPU). The device resolves to npu, torch.npu.set_device(LOCAL_RANK) comes before the
HCCL process group, the op table is the NPU one (every fused kernel called, with its argument
contract checked), precision defaults to bf16-mixed, the MFU peak is the Atlas table's, and
pretrain takes its first steps and generate decodes from its checkpoint. Without torch_npu the
recipes end with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from tests.npu_standin import register_device_standin
    m = register_device_standin(name="Ascend910B3", count=2)
    import torch
    from mff import backend
    from mff.train.metrics import device_peak_flops
    device_type = backend.resolve_device("npu", env={{}})
    info = backend.init_distributed(device_type)
    peak, source = device_peak_flops(info.device)
    print(json.dumps({{"device_type": device_type, "device": str(info.device), "backend": info.backend,
                      "events": m.events, "names": backend.ops.names, "peak": peak, "source": source}}))
""")


def test_the_standin_device_module_sees_set_device_before_the_hccl_group():
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["device_type"] == "npu" and got["device"] == "npu:1" and got["backend"] == "hccl"
    # LOCAL_RANK's NPU is made current first; the HCCL group is created after, on that device
    assert got["events"] == [["set_device", 1], ["hccl process group", 0, 1, 1]]
    assert got["names"]["attention"] == "npu_fusion_attention" and got["names"]["rope"] == "npu_rotary_mul"
    assert got["peak"] == 313e12 and "Ascend910B3" in got["source"]


def test_the_recipes_without_torch_npu_end_with_one_line(tmp_path):
    for cmd in (["mff.recipes.pretrain", "--device", "npu"], ["mff.recipes.generate", "--device", "npu", "--ckpt", str(tmp_path), "--prompt", "hi"]):
        r = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("error: --device npu: torch_npu is not installed") and "Traceback" not in r.stderr


RECIPES = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tests.npu_standin import register_device_standin
    m = register_device_standin(name="Ascend910B2")
    import mff.recipes.pretrain, mff.recipes.generate
    rc = mff.recipes.pretrain.main(["--model", "deepseek3", "--size", "tiny", "--device", "npu", "--steps", "2", "--batch-size", "2",
                                    "--seq-len", "32", "--ckpt-dir", {run!r}, "--eval-every", "0"])
    assert rc == 0, rc
    print("EVENTS", m.events)
    print("KERNELS", sorted({{c[0] for c in m.calls}}))
    m.calls.clear()
    rc = mff.recipes.generate.main(["--ckpt", {run!r}, "--device", "npu", "--prompt", "Once upon a time", "--max-new-tokens", "3"])
    assert rc == 0, rc
    print("GENERATE KERNELS", sorted({{c[0] for c in m.calls}}))
""")


def test_pretrain_and_generate_run_on_the_standin_npu_device(tmp_path):
    run = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", RECIPES.format(root=str(ROOT), run=run)], capture_output=True, text=True, timeout=900,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "device npu:0 x 1 (hccl)" in out and "precision bf16-mixed" in out and "Ascend910B2 bf16 cited figure, unverified" in out
    assert "step     1/2 | loss" in out and "step     2/2 | loss" in out
    assert "EVENTS [('set_device', 0), ('hccl process group', 0, 1, 0)]" in out
    every = ("'npu_fusion_attention', 'npu_grouped_matmul', 'npu_moe_token_permute', 'npu_moe_token_unpermute', 'npu_rms_norm', "
             "'npu_rotary_mul', 'npu_swiglu'")
    assert f"KERNELS [{every}]" in out
    assert "GENERATE KERNELS ['npu_fusion_attention'" in out and "'npu_rotary_mul'" in out.split("GENERATE KERNELS")[1]
    assert (tmp_path / "run" / "step_00000002" / "model.safetensors").is_file()
