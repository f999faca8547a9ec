"""Fine-tuning step benchmark: mff LoRA and full fine-tuning against HF transformers + PEFT.

    python bench/finetune.py [--threads 2 --batch 4 --seq 512 --steps 5 --warmup 2 --r 16
                              --configs qwen3_bench deepseek3_bench --rows hf-peft-lora mff-lora hf-full mff-full]

Quick smoke run: ``python bench/finetune.py --seq 64 --steps 1 --warmup 1``.

For each benchmark config (``bench/configs.py``) one optimizer step (forward, backward, grad
clipping to 1.0, AdamW lr 1e-4, betas (0.9, 0.999), no weight decay) on ``--batch`` x ``--seq``
tokens, fp32, from the same weights (mff's ``model.init(seed=0)`` written with ``mff.save_hf``)
and the same token ids, labels on every token. Rows:

- ``hf-peft-lora``: ``transformers`` (sdpa; DeepSeek-V3 experts on ``grouped_mm``) wrapped by
  ``peft.get_peft_model`` with ``LoraConfig(r, lora_alpha=2r)`` on every projection mff's
  ``--lora.targets all`` adapts: the attention and dense / shared-expert MLP projections and, for
  MoE, the stacked experts through ``target_parameters`` (the MLP projections of MoE models go
  there too, as 2-D parameters: peft 0.21 would otherwise rewrite them into the experts,
  huggingface/peft#3711). ``torch.optim.AdamW(foreach=True)`` over the trainable params.
- ``mff-lora``: ``mff.peft.add_lora(model, r, 2r)`` (the same targets), frozen base, AdamW on
  the adapters through :func:`mff.train.step.train_step`.
- ``hf-full``, ``mff-full``: the same step training every weight (HF with torch AdamW).

Each row runs in its own process (peak RSS is its own) and the rows take turns step by step
(the machinery of ``bench/train_step.py``); the figure is the median step. Printed per row:
tokens/s, the ratio to the HF row of the same kind, peak RSS, the params in the optimizer, the
first step's loss (equal across rows: LoRA starts with B = 0). Targets of issue 14, reported and
not asserted: mff LoRA >= 1.3x HF+PEFT tokens/s; mff LoRA peak RSS below mff full by at least
the base's AdamW state (2 x 4 bytes per base param); the LoRA optimizer state holds only the adapters.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.train_step import (  # noqa: E402
    CONFIG_NAMES,
    RESULT,
    _setup,
    _token_ids,
    child_peak,
    child_prep,
    load_hf_model,
    median,
    run_rows,
    serve,
    spawn,
)

ROWS = {"hf-peft-lora": ("HF transformers + PEFT", "lora"), "mff-lora": ("mff", "lora"), "hf-full": ("HF transformers", "full"),
        "mff-full": ("mff", "full")}
LR, BETAS, MAX_GRAD_NORM = 1e-4, (0.9, 0.999), 1.0
_MLP = ("gate_proj", "up_proj", "down_proj")


def _peft_targets(model) -> tuple[list[str], list[str]]:
    """PEFT's ``target_modules`` / ``target_parameters`` for the weights mff adapts (``all``)."""
    import mff.peft as mp

    lm = mp.add_lora(model, r=1)
    moe = any(t.endswith(".experts.gate_up_proj") for t in lm.lora.targets)
    modules, params = set(), set()
    for t in lm.lora.targets:
        owner, _, pname = t.rpartition(".")
        leaf = owner.rpartition(".")[2]
        if pname != "weight":
            params.add(".".join(t.split(".")[3:]))  # mlp.experts.gate_up_proj
        elif moe and leaf in _MLP:
            params.add(".".join(t.split(".")[3:]))  # mlp.gate_proj.weight, mlp.shared_experts.up_proj.weight
        else:
            modules.add(leaf)
    return sorted(modules), sorted(params)


def child_hf(job: dict):
    torch = _setup(job["threads"])
    import mff
    from bench.configs import CONFIGS

    family, cfg = CONFIGS[job["config"]]
    hf, experts = load_hf_model(torch, job, cfg)
    note = f"sdpa, experts {experts}"
    if job["kind_"] == "lora":
        import peft

        modules, params = _peft_targets(mff.build(family, cfg))
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=job["r"], lora_alpha=2 * job["r"], target_modules=modules,
                                                     target_parameters=params or None))
        note += f"; peft {peft.__version__}, {len(modules)} module names + {len(params)} parameter names"
    hf.train()
    trained = [p for p in hf.parameters() if p.requires_grad]
    ids = _token_ids(torch, cfg.vocab_size, job["batch"], job["seq"])
    x = ids[:, :-1].contiguous()
    y = ids[:, 1:].contiguous()
    opt = torch.optim.AdamW(trained, lr=LR, betas=BETAS, weight_decay=0.0, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = hf(input_ids=x, labels=x, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, MAX_GRAD_NORM)
        opt.step()
        return float(loss.detach())

    return step, {"optimized": sum(p.numel() for p in trained), "note": note}


def child_mff(job: dict):
    torch = _setup(job["threads"])
    import mff
    import mff.peft as mp
    from bench.configs import CONFIGS
    from mff.backend import select_ops
    from mff.optim import OptimConfig, init_state
    from mff.train.step import train_step

    ops = select_ops("cpu")
    family, cfg = CONFIGS[job["config"]]
    model = mff.build(family, cfg)
    params = model.init(seed=0)
    if job["kind_"] == "lora":
        for t in params.values():
            t.requires_grad_(False)
        model = mp.add_lora(model, r=job["r"], alpha=2 * job["r"])
        params = {**params, **mp.init_adapters(model, seed=0)}
    optim = OptimConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, warmup_steps=0)
    state = init_state(optim, params)
    ids = _token_ids(torch, cfg.vocab_size, job["batch"], job["seq"])
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    rate = getattr(cfg, "moe_router_bias_update_rate", 0.0) if job["kind_"] == "full" else 0.0

    def step() -> float:
        return train_step(model, params, state, [batch], LR, optim, bias_update_rate=rate).losses["lm"]

    optimized = sum(t.numel() for t in state["exp_avg"].values())
    return step, {"optimized": optimized, "note": f"grouped_mm {ops.names['grouped_mm']}" if getattr(cfg, "n_routed_experts", 0) else ""}


def run_child(job: dict) -> None:
    if job["kind"] in ("hf", "mff"):
        step, info = {"hf": child_hf, "mff": child_mff}[job["kind"]](job)
        serve(step, info)
        return
    fn = {"peak": child_peak, "prep": child_prep}[job["kind"]]
    print(RESULT + json.dumps(fn(job)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (alpha = 2 r)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES), choices=CONFIG_NAMES)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    rows = [r for r in ROWS if r in args.rows]
    tokens = args.batch * args.seq
    print(f"threads {args.threads}, batch {args.batch} x seq {args.seq} = {tokens} tokens/step, LoRA r {args.r} alpha {2 * args.r}, "
          f"median of {args.steps} steps after {args.warmup} warm-up", flush=True)
    res: dict = {}
    base = {"threads": args.threads, "batch": args.batch, "seq": args.seq, "r": args.r}
    with tempfile.TemporaryDirectory() as d:
        prep = spawn({"kind": "prep", "threads": args.threads, "configs": args.configs, "seq": args.seq, "dir": d}, args.threads, __file__)
        if "error" in prep:
            sys.exit("could not write the HF checkpoints: " + prep["error"])
        for name in args.configs:
            jobs = {row: dict(base, kind=row.split("-")[0], kind_=ROWS[row][1], config=name, row=row, dir=d) for row in rows}
            procs, times = run_rows(jobs, args.threads, args.steps, args.warmup, __file__)
            for row in rows:
                r = procs[row].finish()
                r.update(impl=ROWS[row][0], kind=ROWS[row][1], first_loss=procs[row].first_loss)
                if "error" not in r and times[row]:
                    r["step_s"] = median(times[row])
                    r["tps"] = tokens / r["step_s"]
                res[(name, row)] = r
                status = r.get("error") or f"{r['tps']:.0f} tok/s, RSS {r['rss_mb']:.0f} MB, steps " + " ".join(f"{t:.3f}" for t in times[row])
                print(f"  {name} {row}: {status}", flush=True)

    head = ["config", "implementation", "training", "tokens/s", "x HF", "peak RSS MB", "params in optimizer", "step-1 loss", "targets", "notes"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in args.configs:
        for row in rows:
            r = res[(name, row)]
            if "error" in r:
                print(f"| {name} | {r['impl']} | {r['kind']} | error | | | | | | {r['error']} |")
                continue
            ref = res.get((name, f"hf-{'peft-lora' if r['kind'] == 'lora' else 'full'}"), {})
            x = f"{r['tps'] / ref['tps']:.2f}" if "tps" in ref and not row.startswith("hf") else ""
            goals = []
            if row == "mff-lora":
                if "tps" in ref:
                    goals.append(f">= 1.3x HF+PEFT: {'met' if r['tps'] >= 1.3 * ref['tps'] else 'not met'}")
                full = res.get((name, "mff-full"), {})
                if "rss_mb" in full:
                    state_mb = 8 * full["optimized"] / 2**20
                    goals.append(f"RSS <= mff full - {state_mb:.0f} MB base AdamW state: "
                                 f"{'met' if r['rss_mb'] <= full['rss_mb'] - state_mb else 'not met'}")
                    goals.append(f"optimizer holds adapters only: {'yes' if r['optimized'] < full['optimized'] / 10 else 'no'}")
            print(f"| {name} | {r['impl']} | {r['kind']} | {r['tps']:.0f} | {x} | {r['rss_mb']:.0f} | {r['optimized']:,} | "
                  f"{r['first_loss']:.6f} | {'; '.join(goals)} | {r['note']} |")


if __name__ == "__main__":
    main()
