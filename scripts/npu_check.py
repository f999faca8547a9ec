"""The first thing to run on an Ascend machine: mff's fused NPU ops against their torch twins.

    python scripts/npu_check.py            # on an NPU node, from the repository root
    python scripts/npu_check.py --device 1 # another NPU of the node

With torch_npu and an NPU: for every model family (tiny, fp32 and bf16) the logits and every
param grad of one forward+backward with the NPU op table (``MFF_NPU_FUSED=1``) are compared with
the same run on the same NPU with every op on its torch twin (``MFF_NPU_FUSED=0``), for a plain
causal batch, a packed batch (document masks) and a left-padded prefill into a KV cache; the
largest differences are printed per family and case with the kernels that ran and every
fallback taken, and the exit code is 1 when an fp32 difference exceeds ``--tol``. Then the CPU
stand-in tests run too (they check the argument contracts the kernels are called with).

Without an NPU: says so, runs the stand-in tests (``tests/test_npu_ops.py``, CPU) and exits
with their status (0 when they pass).

Exit codes: 0 all passed; 1 an fp32 fused-vs-twin difference above --tol or a failed stand-in test.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _npu_present() -> tuple[bool, str]:
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # not installed, or built for another torch
        return False, f"torch_npu does not import ({type(e).__name__}: {e})"
    import torch

    n = torch.npu.device_count()
    if n == 0:
        return False, "torch_npu imports but sees no NPU (check the driver and ASCEND_RT_VISIBLE_DEVICES)"
    return True, f"{n} NPU(s), {torch.npu.get_device_name(0)}"


def _standin_tests() -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_npu_ops.py")]
    print("running the CPU stand-in tests:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _batches(model, torch, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    plain = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    packed = dict(plain, document_ids=torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 3 + [2] * 4]),
                  position_ids=torch.tensor([list(range(5)) + list(range(11)), list(range(9)) + list(range(3)) + list(range(4))]))
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[0, :4] = False
    padded = {"input_ids": ids, "attention_mask": valid}
    move = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
    return {"causal": move(plain), "packed": move(packed), "left-padded KV cache": move(padded)}


def _run(model, params, batch, case, torch, device):
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    if case == "left-padded KV cache":
        out = model.forward(params, batch, model.init_cache(2, 24, dtype=next(iter(params.values())).dtype, device=device))
        loss = out.logits.float()[batch["attention_mask"]].mean()
    else:
        out = model.forward(params, batch)
        loss = out.loss
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return out.logits.detach().float(), {k: g for k, g in zip(params, grads) if g is not None}


def device_parity(device, tol: float, torch_npu_module=None, families=None) -> int:
    """Fused vs twin on ``device`` for every family and case (printed); 0 when the largest fp32
    difference is within ``tol``, else 1. ``torch_npu_module``: a stand-in (tests, on CPU)."""
    import torch

    import mff
    from mff import backend
    from mff.backend import npu as npu_ops

    worst_fp32 = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for family in families or mff.models.FAMILIES:
            model = mff.build(family, size="tiny")
            params = model.init(seed=0, device=device, dtype=dtype)
            for case, batch in _batches(model, torch, device).items():
                backend.select_ops("npu", torch_npu_module=torch_npu_module, env={"MFF_NPU_FUSED": "0"})
                ref_logits, ref_grads = _run(model, params, batch, case, torch, device)
                npu_ops.fallbacks.clear()
                table = backend.select_ops("npu", torch_npu_module=torch_npu_module, env={"MFF_NPU_FUSED": "1"})
                logits, grads = _run(model, params, batch, case, torch, device)
                d_logits = float((logits - ref_logits).abs().max())
                d_grads = max((float((grads[k].float() - ref_grads[k].float()).abs().max()) for k in ref_grads), default=0.0)
                if dtype == torch.float32:
                    worst_fp32 = max(worst_fp32, d_logits, d_grads)
                kernels = sorted(v for v in table.names.values() if v.startswith("npu_"))
                fell = "; ".join(f"{op}: {why} (x{n})" for (op, why), n in npu_ops.fallbacks.seen.items()) or "none"
                print(f"{str(dtype).replace('torch.', ''):9s} {family:10s} {case:21s} max |fused - twin|: logits {d_logits:.3g}, "
                      f"grads {d_grads:.3g}; kernels {', '.join(kernels)}; fallbacks {fell}", flush=True)
    backend.select_ops(device.type if torch_npu_module is None else "cpu")
    verdict = "PASS" if worst_fp32 <= tol else "FAIL"
    print(f"{verdict}: largest fp32 difference {worst_fp32:.3g} (tolerance {tol:g})")
    return 0 if worst_fp32 <= tol else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=int(os.environ.get("LOCAL_RANK", "0")), help="NPU index (default LOCAL_RANK or 0)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest fp32 fused-vs-twin difference accepted (default 1e-4)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    present, what = _npu_present()
    if not present:
        print(f"npu_check: found no NPU: {what}. Only the CPU stand-in tests can run here.", flush=True)
        return _standin_tests()
    print(f"npu_check: {what}; fused ops vs their torch twins on NPU {args.device}", flush=True)
    import torch

    torch.npu.set_device(args.device)
    rc = device_parity(torch.device("npu", args.device), args.tol)
    return _standin_tests() or rc


if __name__ == "__main__":
    sys.exit(main())
