"""Issue 5, acceptance 1-2: three fp32 training steps on a parallel layout give the losses, the
grad norms and the final params of the single-process run within 1e-5. Issue 14, acceptance 5:
the same for LoRA adapters (frozen base) under dp-shard=2, tp=2 and ep=2: losses and every
adapter within 1e-5, the adapters placed like their base weights.

One torchrun launch per layout runs every family the layout must cover
(tests/layout_worker.py); the single-process reference runs once per session.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.cli_util import ROOT, cli_env
from tests.dist_util import free_port

WORKER = str(ROOT / "tests" / "layout_worker.py")
GLOBAL_BATCH = 4  # tests/layout_worker.py
MOE = ("deepseek3", "qwen3_moe")
DENSE = ("qwen3", "glm4")
ALL = MOE + DENSE



def _launch(out, families, nproc: int, flags: list[str]) -> dict:
    env = cli_env(out.parent / "cache")
    if nproc == 1:
        cmd = [sys.executable, WORKER]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}", WORKER]
    r = subprocess.run([*cmd, str(out), "--families", ",".join(families), *flags], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run with micro-batches of R rows (made once per R)."""
    made: dict[int, dict] = {}

    def get(rows: int) -> dict:
        if rows not in made:
            made[rows] = _launch(tmp_path_factory.mktemp("ref") / "ref.pt", ALL, 1,
                                 ["--micro-rows", str(rows), "--lora", "4", "--lora-families", ",".join(LORA)])
        return made[rows]

    return get


# LoRA (the first three layouts): MLA + experts + shared experts (deepseek3), softmax-routed experts
# (qwen3_moe), GQA with GLM-4's fused gate_up under tp (glm4)
LORA = ("deepseek3", "qwen3_moe", "glm4")
LAYOUTS = [
    pytest.param(2, ["--dp-shard", "2", "--lora", "4", "--lora-families", ",".join(LORA)], ALL, id="dp_shard2"),
    pytest.param(2, ["--tp", "2", "--lora", "4", "--lora-families", ",".join(LORA)], ALL, id="tp2"),
    pytest.param(2, ["--ep", "2", "--lora", "4", "--lora-families", ",".join(LORA)], MOE, id="ep2"),
    pytest.param(4, ["--dp-shard", "2", "--tp", "2"], MOE, id="dp_shard2xtp2"),
    pytest.param(4, ["--ep", "2", "--dp-shard", "2"], MOE, id="ep2xdp_shard2"),
]


@pytest.mark.parametrize("nproc,flags,families", LAYOUTS)
def test_layout_matches_one_process(reference, tmp_path, nproc, flags, families):
    opts = dict(zip(flags[::2], flags[1::2]))
    lora = int(opts.pop("--lora", 0))
    lora_families = opts.pop("--lora-families", "").split(",")
    sizes = {k: int(v) for k, v in opts.items()}
    rows = GLOBAL_BATCH * sizes.get("--tp", 1) // nproc  # rows per data-parallel rank
    got = _launch(tmp_path / "got.pt", families, nproc, [*flags, "--micro-rows", str(rows)])
    for flag, size in sizes.items():
        assert got["mesh"][flag.removeprefix("--").replace("-", "_")] == size
    assert (got["ep_dispatches"] > 0) == (sizes.get("--ep", 1) > 1)  # real expert parallelism: tokens sent by all-to-all
    for family in [*families, *[f + "+lora" for f in families if lora and f in lora_families]]:
        ref, run = reference(rows)[family], got[family]
        assert run["losses"] == pytest.approx(ref["losses"], abs=1e-5), family
        assert run["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5), family
        assert run["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(run["params"][k], v, atol=1e-5, rtol=0, msg=f"{family} {k}")
