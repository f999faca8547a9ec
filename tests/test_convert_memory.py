"""Streaming conversion: converting a generated 2-shard checkpoint of more than 1 GB keeps the
peak RSS increase below 1.2 x (output size + largest shard)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli_util import ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the RSS peak")

MAKE = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    import mff
    from mff.ckpt.safetensors_io import write_sharded
    from mff.models.llama import LlamaConfig
    out = Path(sys.argv[1])
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=14, num_attention_heads=8,
                      num_key_value_heads=8, max_position_embeddings=512)
    model = mff.build("llama", cfg)
    shapes = model.param_shapes()
    out.mkdir()
    (out / "config.json").write_text(json.dumps(model.family.to_hf_config(cfg)))
    total = sum(s.numel() for s in shapes.values()) * 4
    gen = torch.Generator().manual_seed(0)
    write_sharded(out, [(k, s, torch.float32) for k, s in shapes.items()],
                  lambda k: torch.randn(shapes[k], generator=gen) * 0.02, max_shard_size=total // 2 + 2**20)
""")

CONVERT = textwrap.dedent("""
    import json, sys
    from mff.recipes.convert import ConvertConfig, convert
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    convert(ConvertConfig(src=sys.argv[1], dst=sys.argv[2], to=sys.argv[3]))
    print(json.dumps({"before": before, "peak": status("VmHWM:")}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("to", ["mff", "hf"])
def test_convert_peak_memory(tmp_path_factory, to):
    src = tmp_path_factory.getbasetemp() / "big-src"
    if not src.exists():
        subprocess.run([sys.executable, "-c", MAKE, str(src)], check=True, cwd=ROOT)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) == 2
    largest = max(p.stat().st_size for p in shards)
    assert sum(p.stat().st_size for p in shards) > 1e9
    dst = tmp_path_factory.mktemp("dst") / "out"
    r = subprocess.run([sys.executable, "-c", CONVERT, str(src), str(dst), to], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    output = sum(p.stat().st_size for p in dst.rglob("*.safetensors"))
    increase = m["peak"] - m["before"]
    print(f"\nconvert --to {to}: output {output / 1e9:.3f} GB, largest shard {largest / 1e9:.3f} GB, "
          f"peak RSS increase {increase / 1e9:.3f} GB, limit {1.2 * (output + largest) / 1e9:.3f} GB")
    assert increase < 1.2 * (output + largest)
