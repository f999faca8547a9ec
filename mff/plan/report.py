"""The text a plan prints (:func:`format_plan`), from the dict :func:`mff.plan.make_plan` returns."""

from __future__ import annotations

__all__ = ["format_plan"]

_WORKING = {
    True: "the stage's params gathered whole over the data axes for the step, their bf16 casts and whole grads",
    False: "weights gathered whole over the data axes where used, kept for the backward, and bf16 casts of the shards",
}


def _b(n: float) -> str:
    return f"{n / 1e9:,.1f}B"


def _n(count: int, one: str, many: str | None = None) -> str:
    """``1 micro-batch``, ``4 micro-batches``."""
    return f"{count:,} {one if count == 1 else (many or one + 's')}"


def _rank(plan: dict, section: str, pp: int) -> str:
    """Which pp rank a section's figures are for, in words."""
    r = plan[section]["pp_rank"]
    if pp == 1:
        return "every device"
    loaded, slow = plan["memory_gib"]["pp_rank"], plan["estimate"]["slowest_pp_rank"]
    roles = (["the most loaded"] if r == loaded else []) + (["the slowest"] if r == slow else [])
    return f"pp rank {r}, {' and '.join(roles)} of {pp}"


def format_plan(plan: dict) -> str:
    """The plan as lines of text: model, hardware, layout, memory per device (of the most loaded
    pp rank), compute and communication (of the slowest pp rank, which the step estimate uses),
    every pp rank's totals, the bubble and the step estimate; a layout that does not fit (planned
    with ``refuse=False``) starts with ``does not fit: ...``."""
    m, hw, lay, mem, est = plan["model"], plan["hardware"], plan["layout"], plan["memory_gib"], plan["estimate"]
    mesh = lay["mesh"]
    pp = mesh["pp"]
    out = [f"does not fit: {mem['does_not_fit']}"] if not mem.get("fits", True) else []
    out += [
        f"model: {m['family']} {m['size']}: {_b(m['params'])} params, {_b(m['activated_params'])} activated per token, "
        f"{m['train_flops_per_token'] / 1e9:,.1f} GFLOP per token trained at seq {lay['seq_len']}",
        f"hardware: {lay['devices']:,} x {hw['name']}: {hw['peak_flops'] / 1e12:,.0f} TFLOP/s dense bf16, {hw['hbm_gib']:g} GiB at "
        f"{hw['hbm_bytes_per_s'] / 1e12:g} TB/s, {hw['links']} ({hw['source'].split(':')[0]})",
    ]
    sched = (f"{lay['schedule']}, {_n(len(lay['stages']), 'stage')} ({lay['stages_per_rank']} per rank) of "
             f"{','.join(str(b - a) for a, b in lay['stages'])} layers; " if pp > 1 else "")
    mb = (f"{_n(lay['microbatch_sequences'], 'sequence')} of {lay['seq_len']:,} tokens")
    if pp > 1:
        per = (f"{_n(lay['passes'], 'pipeline pass', 'pipeline passes')} (--grad-accum) x "
               f"{_n(lay['microbatches_per_pass'], 'micro-batch', 'micro-batches')} of {mb}")
    else:
        per = f"{_n(lay['passes'], 'micro-batch', 'micro-batches')} (--grad-accum) of {mb}"
    out.append(f"layout: {' x '.join(f'{k} {v}' for k, v in mesh.items())} = {lay['devices']:,} devices; data-parallel "
               f"{lay['data_parallel']}; {sched}{per} per data-parallel rank per step; {lay['precision']}, ac {lay['ac']}, "
               f"{lay['optimizer']}")
    of = f" of {_rank(plan, 'memory_gib', pp)}" if pp > 1 else ""
    out.append(f"memory per device (GiB){of}, at {mem['moment']}: {mem['why']}:")
    held = mem["in_flight_microbatches"]
    stages = f" over its {lay['stages_per_rank']} stages" if lay["stages_per_rank"] > 1 and pp > 1 else ""
    notes = {
        **mem.get("notes", {}),
        "working_copies": _WORKING[pp > 1],
        "activations": f"{_n(held, 'micro-batch', 'micro-batches')} of activations held{stages}; one micro-batch "
                       f"{mem['activations_per_microbatch']:.2f} with ac {lay['ac']}, {mem['activations_per_microbatch_no_ac']:.2f} without",
    }
    for key in ("params", "optimizer", "grads", "new_grads", "working_copies", "activations"):
        if key == "new_grads" and not mem[key]:
            continue
        note = f"   ({notes[key]})" if key in notes and mem[key] else ""
        out.append(f"  {key.replace('_', ' '):15s} {mem[key]:8.2f}{note}")
    out.append(f"  {'total':15s} {mem['total']:8.2f}   of {mem['capacity']:g} GiB (at the other moment, {mem['other_moment']}: "
               f"{mem['other_moment_total']:.2f})")
    comp, comm = plan["compute"], plan["communication"]
    why = ", whose time per micro-batch sets the pipeline's pace in the estimate" if pp > 1 else ""
    of = f" of {_rank(plan, 'communication', pp)}" if pp > 1 else ""
    out.append(f"compute and communication per device and step{of}{why}:")
    recompute = f" x {comp['recompute_factor']:.2f} recomputation (ac full)" if comp["recompute_factor"] != 1 else ""
    out.append(f"  compute: {comp['flops_per_token_per_device'] / 1e9:,.1f} GFLOP per token on each device{recompute}: "
               f"{comp['seconds']:,.2f} s at {100 * est['compute_efficiency']:g}% of the peak")
    rows = comm["rows"]
    if rows:
        out.append("  communication (GB sent; seconds at the links' bandwidth):")
        for r in rows:
            out.append(f"    {r['axes']:15s} {r['op']:34s} {'per step' if r['per'] == 'step' else 'per micro-batch':16s}"
                       f"{r['gb']:10.2f} {r['seconds']:8.3f} s")
        out.append(f"    {'total':15s} {'':34s} {'':16s}{comm['total_gb']:10.2f} {comm['total_seconds']:8.3f} s")
    if pp > 1:
        out.append("per pp rank (memory at the rank's peak, GiB; compute and communication before overlap, seconds per step):")
        width = max(len(r["holds"]) for r in plan["per_pp_rank"])
        out.append(f"  {'rank':>4s}  {'holds':{width}s}  {'memory':>8s}  {'compute':>8s}  {'comm':>8s}  {'once/step':>9s}")
        for r in plan["per_pp_rank"]:
            out.append(f"  {r['pp_rank']:4d}  {r['holds']:{width}s}  {r['memory_gib']:8.2f}  {r['compute_s']:8.2f}  {r['comm_s']:8.2f}  "
                       f"{r['once_comm_s']:9.2f}")
        p, mbs, v = pp, lay["microbatches_per_pass"], lay["stages_per_rank"]
        form = f"(p - 1) / (v m + p - 1), v {v}" if lay["schedule"] == "interleaved-1f1b" else "(p - 1) / (m + p - 1)"
        out.append(f"pipeline bubble: {100 * plan['pipeline']['bubble_fraction']:.1f}% of the step time ({lay['schedule']}: "
                   f"{form}, p {p}, m {mbs})")
    exposed_once = est.get("exposed_once_comm_s", 0.0)
    split = ""
    if pp > 1:
        slow, once = est["slowest_pp_rank"], est["once_pp_rank"]
        split = (f" (pp rank {slow}'s per micro-batch {est['exposed_comm_s'] - exposed_once:,.2f} + "
                 f"{'its' if once == slow else f'pp rank {once}'}'s once a step {exposed_once:,.2f}"
                 f"{', the longest' if once != slow else ''})")
        split = split.replace("its's", "its")
    comp_of = f" (pp rank {est['slowest_pp_rank']})" if pp > 1 else ""
    out.append(f"estimate (compute at {100 * est['compute_efficiency']:g}% of the peak, overlap {est['overlap']}): step "
               f"{est['step_s']:,.2f} s = compute {est['compute_s']:,.2f}{comp_of} + exposed communication {est['exposed_comm_s']:,.2f}"
               f"{split} + bubble {est['bubble_s']:,.2f} + optimizer {est['optimizer_s']:,.2f}; "
               f"{est['tokens_per_s_per_device']:,.0f} tokens/s per device; MFU {100 * est['mfu']:.1f}%")
    return "\n".join(out)
