"""The text a plan prints (:func:`format_plan`), from the dict :func:`mff.plan.make_plan` returns."""

from __future__ import annotations

__all__ = ["format_plan"]

_WORKING = {
    True: "the stage's params gathered whole over the data axes for the step, their bf16 casts and whole grads",
    False: "weights gathered whole over the data axes where used, kept for the backward, and bf16 casts of the shards",
}


def _b(n: float) -> str:
    return f"{n / 1e9:,.1f}B"


def format_plan(plan: dict) -> str:
    """The plan as lines of text: model, hardware, layout, memory per device, communication per
    axis, the bubble and the step estimate."""
    m, hw, lay, mem, est = plan["model"], plan["hardware"], plan["layout"], plan["memory_gib"], plan["estimate"]
    mesh = lay["mesh"]
    pp = mesh["pp"]
    out = [
        f"model: {m['family']} {m['size']}: {_b(m['params'])} params, {_b(m['activated_params'])} activated per token, "
        f"{m['train_flops_per_token'] / 1e9:,.1f} GFLOP per token trained at seq {lay['seq_len']}",
        f"hardware: {lay['devices']:,} x {hw['name']}: {hw['peak_flops'] / 1e12:,.0f} TFLOP/s dense bf16, {hw['hbm_gib']:g} GiB at "
        f"{hw['hbm_bytes_per_s'] / 1e12:g} TB/s, {hw['links']} ({hw['source'].split(':')[0]})",
    ]
    sched = (f"{lay['schedule']}, {len(lay['stages'])} stages ({lay['stages_per_rank']} per rank) of "
             f"{','.join(str(b - a) for a, b in lay['stages'])} layers; " if pp > 1 else "")
    out.append(f"layout: {' x '.join(f'{k} {v}' for k, v in mesh.items())} = {lay['devices']:,} devices; data-parallel "
               f"{lay['data_parallel']}; {sched}per step and data-parallel rank {lay['passes']} x {lay['microbatches_per_pass']} "
               f"micro-batches of {lay['microbatch_sequences']} x {lay['seq_len']} tokens; {lay['precision']}, ac {lay['ac']}, "
               f"{lay['optimizer']}")
    who = f"pp rank {mem['pp_rank']} (the most loaded of {pp})" if pp > 1 else "every device"
    out.append(f"memory per device (GiB), {who}, at {mem['moment']}:")
    notes = {
        "working_copies": _WORKING[pp > 1],
        "activations": f"{mem['in_flight_microbatches']} stage-micro-batches held; one micro-batch {mem['activations_per_microbatch']:.2f}"
                       f" with ac {lay['ac']}, {mem['activations_per_microbatch_no_ac']:.2f} without",
    }
    for key in ("params", "optimizer", "grads", "working_copies", "activations"):
        note = f"   ({notes[key]})" if key in notes and mem[key] else ""
        out.append(f"  {key.replace('_', ' '):15s} {mem[key]:8.2f}{note}")
    out.append(f"  {'total':15s} {mem['total']:8.2f}   of {mem['capacity']:g} GiB")
    rows = plan["communication"]["rows"]
    if rows:
        out.append(f"communication per device and step, {who if pp > 1 else 'every device'} (GB sent; seconds at the links' bandwidth):")
        for r in rows:
            out.append(f"  {r['axes']:15s} {r['op']:34s} {r['gb']:10.2f} {r['seconds']:8.3f} s")
    if pp > 1:
        p, mb, v = pp, lay["microbatches_per_pass"], lay["stages_per_rank"]
        form = f"(p - 1) / (v m + p - 1), v {v}" if lay["schedule"] == "interleaved-1f1b" else "(p - 1) / (m + p - 1)"
        out.append(f"pipeline bubble: {100 * plan['pipeline']['bubble_fraction']:.1f}% of the step time ({lay['schedule']}: "
                   f"{form}, p {p}, m {mb})")
    out.append(f"estimate (compute at {100 * est['compute_efficiency']:g}% of the peak, overlap {est['overlap']}): step "
               f"{est['step_s']:,.2f} s = compute {est['compute_s']:,.2f} + exposed communication {est['exposed_comm_s']:,.2f} + bubble "
               f"{est['bubble_s']:,.2f} + optimizer {est['optimizer_s']:,.2f}; {est['tokens_per_s_per_device']:,.0f} tokens/s per device; "
               f"MFU {100 * est['mfu']:.1f}%")
    return "\n".join(out)
