"""Training-step benchmark: mff's ``train_step`` against HF transformers, forward + backward + update.

    python bench/train_step.py [--threads 2 --batch 4 --seq 512 --steps 5 --warmup 2
                                --configs qwen3_bench deepseek3_bench --rows hf-fp32 mff-fp32 ...]

Quick smoke run (a few minutes: 16 processes, the compiled rows compile):
``python bench/train_step.py --seq 64 --steps 1 --warmup 1 --threads 1``.

For each benchmark config (``bench/configs.py``: qwen3_bench, deepseek3_bench) one full
training step (forward, backward, grad clipping to norm 1.0, AdamW update: lr 3e-4, betas
(0.9, 0.95), weight decay 0.1) on a batch of ``--batch`` x ``--seq`` input tokens runs with the
same random weights (mff's ``model.init(seed=0)``, written with ``mff.save_hf`` and loaded by
``transformers.AutoModelForCausalLM.from_pretrained``) and the same random token ids. Rows
(``--rows``, default all, run config by config in this order):

- ``hf-fp32``: HF transformers, fp32, ``model.train()``, ``attn_implementation="sdpa"``, the MoE
  experts on ``experts_implementation="grouped_mm"`` (DeepSeek-V3; transformers'
  ``torch.nn.functional.grouped_mm`` path), ``labels=input_ids`` (HF shifts internally: 511
  targets per row), ``torch.optim.AdamW(..., foreach=True)``, ``clip_grad_norm_(1.0)``.
- ``mff-fp32``, ``mff-fp32-compile``: :func:`mff.train.step.train_step`, fp32, blocks eager or
  under ``torch.compile`` (``model.with_execution(compile=True)``), after
  ``mff.backend.select_ops("cpu")`` (``torch._grouped_mm`` for the experts when it runs here);
  ids of length seq + 1 split into ``input_ids`` / ``labels`` (seq targets per row). DeepSeek-V3
  also updates the expert bias and adds its sequence-wise balance loss (aux_loss_alpha 1e-4).
- ``hf-bf16``: the HF step with the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``
  (fp32 params, grads and AdamW state; HF's grouped_mm casts its input to the fp32 expert
  weights, so the experts stay fp32 under autocast).
- ``mff-bf16``, ``mff-bf16-compile``: ``train_step(..., precision="bf16-mixed")`` (fp32 master
  params and state, bf16 compute), eager or compiled.
- ``tt-fp32``, ``tt-bf16``: torchtitan 0.3.0's Qwen3 / DeepSeek-V3 model on the same HF weights
  (:mod:`bench.torchtitan_peer`: what it needs to run on CPU, SDPA attention, its experts in bf16
  even in fp32), cross entropy of the fp32 logits, the same AdamW and clipping, the bf16 row under
  ``torch.autocast`` (torchtitan's mixed precision without FSDP). When torchtitan does not import,
  these rows say why.

Each (config, row) runs in its own subprocess (``--threads`` torch threads), so its peak RSS
(``ru_maxrss``, the whole process: weights, optimizer state, activations, compile caches) is its
own; the parent imports no torch so it adds little to its children's peak. A config's row
processes are all alive at once and take turns: each does its ``--warmup`` untimed steps (the
compiled rows pay their compile time here), then the rows run their ``--steps`` timed steps
round-robin, one step each in turn, so a change in the machine's speed during the run (a shared
VM's usual noise) hits every row alike. The step time is the median; tokens/s = batch x seq /
step time (both sides take ``batch x seq`` input tokens). MFU = ``model.train_flops_per_token(seq)`` (mff's count,
6 x activated params + causal attention, the same architecture on both sides) x tokens/s over
the matmul peak of the row's compute dtype (fp32 rows: fp32 peak; bf16 rows: bf16 peak),
measured in this run: the best of several 2048x2048 @ 2048x2048 matmuls per dtype with the
same thread count, in a child at the start and again at the end (the better one is used).

Targets of issue 19, reported and not asserted: fp32 mff >= 1.0x HF fp32 on qwen3_bench and
>= 1.3x on deepseek3_bench; bf16-mixed mff >= 2.0x HF fp32 and >= 1.4x HF bf16 autocast; ahead of
torchtitan in the same precision; mff peak RSS <= HF's (the HF row of the same precision when it
ran, else HF fp32).

Loss check: before training, each child computes the loss of the initial weights on the same
targets (HF: ``shift_labels`` = the seq targets mff uses; mff: the lm term of
:func:`mff.train.step.eval_loss`, no balance term); fp32 HF and mff should agree to ~1e-4.
The first train-step loss of each row is printed too (HF: 511 targets per row; mff: 512 plus,
for DeepSeek-V3, the balance term).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = {  # row -> (implementation, precision, compile)
    "hf-fp32": ("HF transformers", "fp32", False),
    "mff-fp32": ("mff eager", "fp32", False),
    "mff-fp32-compile": ("mff compiled", "fp32", True),
    "hf-bf16": ("HF transformers autocast", "bf16", False),
    "mff-bf16": ("mff eager", "bf16-mixed", False),
    "mff-bf16-compile": ("mff compiled", "bf16-mixed", True),
    "tt-fp32": ("torchtitan 0.3.0", "fp32", False),
    "tt-bf16": ("torchtitan 0.3.0 autocast", "bf16", False),
}
CONFIG_NAMES = ("qwen3_bench", "deepseek3_bench")  # bench/configs.py's CONFIGS (the parent does not import torch)
FP32_TARGET = {"qwen3_bench": 1.0, "deepseek3_bench": 1.3}  # x HF fp32 (issue 19)
BF16_TARGET = 2.0  # best bf16-mixed mff row, x HF fp32
BF16_AUTOCAST_TARGET = 1.4  # best bf16-mixed mff row, x HF bf16 autocast
LR, BETAS, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-4, (0.9, 0.95), 0.1, 1.0
RESULT = "RESULT "


# ---- children (torch imported here only) -----------------------------------------------------

def _setup(threads: int):
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(threads)
    return torch


def _token_ids(torch, vocab: int, batch: int, seq: int):
    """[batch, seq + 1] int64 ids, the same in every child."""
    return torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def child_peak(job: dict) -> dict:
    """Best matmul FLOP/s of a 2048^3 matmul per dtype."""
    import time

    torch = _setup(job["threads"])
    n, out = 2048, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        c = a @ b  # warm-up
        best = float("inf")
        for _ in range(job["repeats"]):
            t = time.perf_counter()
            torch.mm(a, b, out=c)
            best = min(best, time.perf_counter() - t)
        out[name] = 2 * n**3 / best
    return out


def child_prep(job: dict) -> dict:
    """Write each config's HF checkpoint (mff's seed-0 weights) and return FLOPs per token."""
    _setup(job["threads"])
    import mff
    from bench.configs import CONFIGS

    out = {}
    for name in job["configs"]:
        family, cfg = CONFIGS[name]
        model = mff.build(family, cfg)
        params = {k: v.detach() for k, v in model.init(seed=0).items()}
        mff.save_hf(model, params, Path(job["dir"]) / name)
        out[name] = {"flops_per_token": model.train_flops_per_token(job["seq"])}
    return out


def load_hf_model(torch, job: dict, cfg):
    """The config's HF checkpoint (written by :func:`child_prep`) in fp32 with sdpa attention and,
    for MoE, ``experts_implementation="grouped_mm"``; returns ``(model, experts implementation)``."""
    import transformers

    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if getattr(cfg, "n_routed_experts", 0):
        kwargs["experts_implementation"] = "grouped_mm"
    hf = transformers.AutoModelForCausalLM.from_pretrained(Path(job["dir"]) / job["config"], **kwargs)
    return hf, (hf.config._experts_implementation if "experts_implementation" in kwargs else "n/a (dense)")


def child_hf(job: dict) -> dict:
    torch = _setup(job["threads"])
    import contextlib

    from bench.configs import CONFIGS

    family, cfg = CONFIGS[job["config"]]
    hf, experts = load_hf_model(torch, job, cfg)
    hf.train()
    ids = _token_ids(torch, cfg.vocab_size, job["batch"], job["seq"])
    x = ids[:, :-1].contiguous()
    bf16 = job["precision"] == "bf16"

    def ctx():
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    with torch.no_grad(), ctx():  # the same targets as mff: x[:, t] predicts ids[:, t + 1]
        check = float(hf(input_ids=x, labels=x, shift_labels=ids[:, 1:].contiguous()).loss)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_GRAD_NORM)
        opt.step()
        return float(loss.detach())

    return step, {"check_loss": check, "note": f"sdpa, experts {experts}"}


def child_mff(job: dict) -> dict:
    torch = _setup(job["threads"])
    import mff
    from bench.configs import CONFIGS
    from mff.backend import select_ops
    from mff.optim import OptimConfig, init_state
    from mff.train.step import eval_loss, train_step

    ops = select_ops("cpu")
    family, cfg = CONFIGS[job["config"]]
    eager = mff.build(family, cfg).with_execution(ac="none", compile=False)
    model = eager.with_execution(ac="none", compile=job["compile"])
    params = model.init(seed=0)
    optim = OptimConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM)
    state = init_state(optim, params)
    ids = _token_ids(torch, cfg.vocab_size, job["batch"], job["seq"])
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    rate = getattr(cfg, "moe_router_bias_update_rate", 0.0)
    precision = job["precision"]
    check = eval_loss(eager, params, [batch], precision)  # eager: no extra compile for the no-grad graph

    def step() -> float:
        return train_step(model, params, state, [batch], LR, optim, bias_update_rate=rate, precision=precision).loss

    return step, {"check_loss": check, "note": f"grouped_mm {ops.names['grouped_mm']}" if getattr(cfg, "n_routed_experts", 0) else ""}


def child_tt(job: dict) -> dict:
    """torchtitan's model (:mod:`bench.torchtitan_peer`) on the same weights and tokens: fp32, or
    the forward under bf16 autocast (torchtitan's mixed precision without FSDP); the loss is
    torchtitan's (cross entropy of the fp32 logits, seq targets per row)."""
    torch = _setup(job["threads"])
    import contextlib

    import torch.nn.functional as F

    from bench import torchtitan_peer
    from bench.configs import CONFIGS

    reason = torchtitan_peer.available()
    if reason is not None:
        raise RuntimeError(f"torchtitan does not import here ({reason}); see bench/torchtitan_peer.py for what it needs")
    family, cfg = CONFIGS[job["config"]]
    model = torchtitan_peer.build(family, cfg, Path(job["dir"]) / job["config"])
    model.train()
    ids = _token_ids(torch, cfg.vocab_size, job["batch"], job["seq"])
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    bf16 = job["precision"] == "bf16"

    def ctx():
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def loss_of() -> torch.Tensor:
        with ctx():
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    with torch.no_grad():
        check = float(loss_of())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        return float(loss.detach())

    return step, {"check_loss": check, "note": "sdpa; experts torch._grouped_mm in bf16" if getattr(cfg, "n_routed_experts", 0) else "sdpa"}


def serve(step, info: dict) -> None:
    """Run steps on command: the parent writes ``step`` (one training step, answered with
    ``TIME <seconds> <loss>``) or ``done`` (answered with the RESULT line: peak RSS and ``info``)."""
    import time

    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            t = time.perf_counter()
            loss = step()
            print(f"TIME {time.perf_counter() - t} {loss}", flush=True)
        elif line.strip() == "done":
            print(RESULT + json.dumps(dict(info, rss_mb=_rss_mb())), flush=True)
            return


def run_child(job: dict) -> None:
    if job["kind"] in ("hf", "mff", "tt"):
        serve(*{"hf": child_hf, "mff": child_mff, "tt": child_tt}[job["kind"]](job))
        return
    fn = {"peak": child_peak, "prep": child_prep}[job["kind"]]
    print(RESULT + json.dumps(fn(job)), flush=True)


# ---- parent ----------------------------------------------------------------------------------

def spawn(job: dict, threads: int, script: str = __file__) -> dict:
    """Run ``job`` in a fresh interpreter (``script --child JOB``); its RESULT line as a dict, or {"error": ...}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, script, "--child", json.dumps(job)], capture_output=True, text=True, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    print(f"!! {job['kind']} {job.get('config', '')} {job.get('row', '')} failed (exit {proc.returncode}):", file=sys.stderr)
    print("\n".join("   " + t for t in tail), file=sys.stderr)
    last = next((t for t in reversed(tail) if t.strip()), "no output")
    return {"error": last.strip()[:120]}


class RowProcess:
    """One (config, row) child (``script --child JOB``) waiting for step commands (see :func:`serve`)."""

    def __init__(self, job: dict, threads: int, script: str = __file__):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.job = job
        self.proc = subprocess.Popen([sys.executable, script, "--child", json.dumps(job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.error = None
        self.first_loss: float | None = None
        self._expect("READY")

    def _expect(self, prefix: str) -> str | None:
        if self.error:
            return None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        tail = self.proc.stderr.read().strip().splitlines()[-15:]
        print(f"!! {self.job['config']} {self.job['row']} failed:", file=sys.stderr)
        print("\n".join("   " + t for t in tail), file=sys.stderr)
        self.error = next((t for t in reversed(tail) if t.strip()), "no output").strip()[:120]
        return None

    def step(self) -> tuple[float, float] | None:
        """One training step in the child: (seconds, loss), or None after a failure."""
        if self.error:
            return None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        out = self._expect("TIME ")
        if out is None:
            return None
        t, loss = (float(x) for x in out.split())
        if self.first_loss is None:
            self.first_loss = loss
        return t, loss

    def finish(self) -> dict:
        if self.error:
            return {"error": self.error}
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        out = self._expect(RESULT)
        self.proc.wait()
        return json.loads(out) if out is not None else {"error": self.error}


def run_rows(jobs: dict[str, dict], threads: int, steps: int, warmup: int, script: str = __file__) -> tuple[dict, dict]:
    """Start one :class:`RowProcess` per row (``jobs``: row -> job), all alive at once; each does
    its ``warmup`` untimed steps (compile time is paid here), then they take turns, one timed step
    each, ``steps`` rounds, so a change in the machine's speed hits every row alike. Returns
    ``(processes, step times)`` per row (a failed row has fewer times; finish the processes)."""
    procs = {}
    for row, job in jobs.items():
        procs[row] = RowProcess(job, threads, script)
        for _ in range(warmup):
            procs[row].step()
    times: dict = {row: [] for row in jobs}
    for _ in range(steps):
        for row in jobs:
            out = procs[row].step()
            if out is not None:
                times[row].append(out[0])
    return procs, times


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def targets(name: str, row: str, r: dict, res: dict) -> str:
    """Issue 19's targets for an mff row, each met / not met: fp32 rows against HF fp32 (x
    :data:`FP32_TARGET`) and torchtitan fp32 (ahead); bf16-mixed rows against HF fp32 (x
    :data:`BF16_TARGET`), HF bf16 autocast (x :data:`BF16_AUTOCAST_TARGET`) and torchtitan bf16
    (ahead); peak RSS against the HF row of the same precision (HF fp32 when that did not run)."""
    if not row.startswith("mff") or "tps" not in r:
        return ""

    def tps(other: str) -> float | None:
        return res.get((name, other), {}).get("tps")

    out = []
    fp32 = r["precision"] == "fp32"
    checks = ([("HF fp32", "hf-fp32", FP32_TARGET[name]), ("torchtitan fp32", "tt-fp32", None)] if fp32 else
              [("HF fp32", "hf-fp32", BF16_TARGET), ("HF bf16", "hf-bf16", BF16_AUTOCAST_TARGET), ("torchtitan bf16", "tt-bf16", None)])
    for label, other, goal in checks:
        if tps(other):
            if goal is None:
                out.append(f"> {label}: {'met' if r['tps'] > tps(other) else 'not met'}")
            else:
                out.append(f">= {goal}x {label}: {'met' if r['tps'] >= goal * tps(other) else 'not met'}")
    ref_row = "hf-bf16" if not fp32 and "rss_mb" in res.get((name, "hf-bf16"), {}) else "hf-fp32"
    ref = res.get((name, ref_row), {})
    if "rss_mb" in ref:
        out.append(f"RSS <= {ref_row}: {'met' if r['rss_mb'] <= ref['rss_mb'] else 'not met'}")
    return "; ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile happens here)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES), choices=CONFIG_NAMES)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--peak-repeats", type=int, default=10, help="matmuls per dtype for the peak")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    rows = [r for r in ROWS if r in args.rows]  # the fixed order: HF and mff alternating by precision
    base = {"threads": args.threads, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup}
    tokens = args.batch * args.seq
    print(f"threads {args.threads}, batch {args.batch} x seq {args.seq} = {tokens} tokens/step, "
          f"median of {args.steps} steps after {args.warmup} warm-up", flush=True)

    peak = spawn({"kind": "peak", "threads": args.threads, "repeats": args.peak_repeats}, args.threads)
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        prep = spawn({"kind": "prep", "threads": args.threads, "configs": args.configs, "seq": args.seq, "dir": d}, args.threads)
        if "error" in prep:
            sys.exit("could not write the HF checkpoints: " + prep["error"])
        for name in args.configs:
            jobs = {row: dict(base, kind=row.split("-")[0], config=name, row=row, precision=ROWS[row][1], compile=ROWS[row][2], dir=d)
                    for row in rows}
            procs, times = run_rows(jobs, args.threads, args.steps, args.warmup)
            for row in rows:
                impl, precision, _ = ROWS[row]
                r = procs[row].finish()
                r.update(impl=impl, precision=precision, first_loss=procs[row].first_loss)
                if "error" not in r and times[row]:
                    r["times"] = times[row]
                    r["step_s"] = median(times[row])
                    r["tps"] = tokens / r["step_s"]
                res[(name, row)] = r
                status = r.get("error") or (f"{r['tps']:.0f} tok/s, RSS {r['rss_mb']:.0f} MB, steps "
                                              + " ".join(f"{t:.3f}" for t in r["times"]) + " s")
                print(f"  {name} {row}: {status}", flush=True)
    peak_end = spawn({"kind": "peak", "threads": args.threads, "repeats": args.peak_repeats}, args.threads)
    peaks = {k: max(p.get(k, 0.0) for p in (peak, peak_end)) for k in ("fp32", "bf16")}
    print(f"matmul peak (2048^3, {args.threads} threads, best of start/end): "
          f"fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s")

    head = ["config", "implementation", "precision", "tokens/s", "x HF fp32", "MFU %", "peak RSS MB", "median step s",
            "loss check", "step-1 loss", "targets", "notes"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in args.configs:
        hf = res.get((name, "hf-fp32"), {})
        for row in rows:
            r = res[(name, row)]
            if "error" in r:
                cells = [name, r["impl"], r["precision"], "error", "", "", "", "", "", "", "", r["error"]]
            else:
                peak_flops = peaks["fp32" if r["precision"] == "fp32" else "bf16"]
                mfu = 100 * prep[name]["flops_per_token"] * r["tps"] / peak_flops if peak_flops else float("nan")
                x_hf = f"{r['tps'] / hf['tps']:.2f}" if "tps" in hf else ""
                cells = [name, r["impl"], r["precision"], f"{r['tps']:.0f}", x_hf, f"{mfu:.1f}", f"{r['rss_mb']:.0f}",
                         f"{r['step_s']:.3f}", f"{r['check_loss']:.6f}", f"{r['first_loss']:.6f}", targets(name, row, r, res), r["note"]]
            print("| " + " | ".join(cells) + " |")

    print("loss check (initial weights, the same targets):")
    for name in args.configs:
        for hf_row, mff_row, tol in (("hf-fp32", "mff-fp32", 1e-4), ("hf-bf16", "mff-bf16", 5e-2), ("tt-fp32", "mff-fp32", 2e-2),
                                     ("tt-bf16", "mff-bf16", 5e-2)):
            a, b = res.get((name, hf_row), {}), res.get((name, mff_row), {})
            if "check_loss" in a and "check_loss" in b:
                diff = abs(a["check_loss"] - b["check_loss"])
                print(f"  {name}: {hf_row} {a['check_loss']:.6f} vs {mff_row} {b['check_loss']:.6f}: "
                      f"|diff| {diff:.2e} ({'within' if diff <= tol else 'NOT within'} {tol:g})")


if __name__ == "__main__":
    main()
