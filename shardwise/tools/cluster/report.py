"""The calculator's answers as text, JSON (DESIGN.md's keys) and a self-contained HTML page.

    print(text(est))          data(est) -> dict        html(ests) -> str
    print(compare_text(rows))
"""
from __future__ import annotations

import html as _html
import json

from ...core.layout import Replicate
from ...core.units import fmt_bytes, fmt_seconds
from ...lower.rows import fmt_placements, short_placement
from ...lower.allocator import ALLOCATOR_NAMES
from . import models

MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "activations")
# compare_text's reserved column for a pipeline row: the allocator is not replayed on per-stage peaks
PIPELINE_RESERVED = "n/a (pipeline: per-stage peaks)"


def _pl(placements, mesh) -> dict:
    """{mesh dim name: placement} as the CLI's --placements files write them ("S(0)", "R")."""
    return {name: short_placement(p) for name, p in zip(mesh.names, placements)}


def data(est) -> dict:
    """The estimate as JSON-ready data: "tokens_per_s_per_gpu", "mfu", "step_time_s",
    "peak_memory_bytes" (per GPU), "fits", "mesh", "placements" and the rest by name."""
    lay, job, fig = est.layout, est.job, est.layout.figures
    step, pipe = fig.step, lay.pipeline
    parts = {"compute_s": step.compute_s, "forward_s": step.compute_fwd_s, "backward_s": step.compute_bwd_s,
             "recompute_s": fig.recompute_s, "communication_s": step.comm_s,
             "exposed_communication_s": step.exposed_comm_s, "optimizer_s": lay.optimizer_s, "bubble_s": 0.0}
    if pipe is not None:  # the busiest pipeline rank's step: m microbatches of its stages, and its idle time
        m = pipe.timeline_microbatches
        parts.update(compute_s=pipe.compute_s, forward_s=None, backward_s=None, recompute_s=pipe.recompute_s,
                     communication_s=None, exposed_communication_s=pipe.exposed_comm_s, bubble_s=pipe.bubble_s,
                     p2p_s=pipe.p2p_s * m)
    out = {
        "model": job.model or job.config_path, "gpu": job.gpu, "gpus": job.gpus, "gpus_per_node": job.gpus_per_node,
        "mesh": {"shape": list(est.mesh.shape), "names": list(est.mesh.names)},
        "seq": job.seq, "local_batch": job.local_batch, "global_batch": est.global_batch,
        "mixed_precision": job.precision, "activation_checkpointing": job.checkpoint,
        "layout": lay.name,
        "placements": {name: _pl(p, est.mesh) for name, p in lay.placements.items()},
        "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu, "mfu": est.mfu,
        "step_time_s": est.step_time_s,
        "step": parts,
        "peak_memory_bytes": lay.memory["peak"],
        "memory_bytes": {k: lay.memory[k] for k in MEMORY_KINDS},
        "memory_budget_bytes": est.budget, "fits": est.fits,
        "reserved_memory_bytes": lay.memory.get("reserved"), "allocator": job.allocator,
        "flops_per_gpu": fig.flops, "recompute_flops": fig.recompute_flops,
        "comm_bytes_per_gpu": fig.comm_bytes, "comm_bytes_by_dim": fig.comm_bytes_by_dim,
        "comm_bytes_by_dtype": fig.comm_bytes_by_dtype,
        "collectives": fig.collectives,
        "candidates": [{"layout": c.name, "step_time_s": c.step_time_s, "peak_memory_bytes": c.memory["peak"],
                        "fits": c.memory["peak"] <= est.budget, "plan_s": c.plan_s,
                        "flops_per_gpu": c.figures.flops, "replicated_compute": dict(c.replicated),
                        "excess_work": c.excess_work, "vs_recipes": dict(c.vs_recipes), "note": c.note}
                       for c in est.candidates],
        "planned_blocks": job.planned, "blocks": fig.layers, "seconds": est.seconds,
    }
    if pipe is not None:
        out["pipeline"] = {"pp": job.pp, "schedule": job.schedule, "microbatches": pipe.timeline_microbatches,
                           "stages_per_rank": job.pipe.v(), "stage_blocks": pipe.stage_blocks,
                           "bubble_fraction": pipe.bubble_fraction, "bubble_s": pipe.bubble_s,
                           "p2p_bytes_per_message": pipe.p2p_bytes, "in_flight": pipe.in_flight,
                           "rank_blocks": pipe.rank_blocks}
    return out


def text(est) -> str:
    """What a person reads: the layout, memory per GPU by kind, the step's parts, throughput, fit."""
    d, job, lay = data(est), est.job, est.layout
    cfg = job.config()
    mesh = " x ".join(f"{n} {s}" for n, s in zip(est.mesh.names, est.mesh.shape))
    mem = lay.memory
    lines = [
        f"{job.model or job.config_path}: {models.describe(cfg)}",
        f"{job.gpus} x {job.gpu} ({job.gpus_per_node} per node), mesh {mesh}; global batch {est.global_batch} x "
        f"{job.seq} tokens ({job.local_batch} per data-parallel rank); {job.precision} precision; activation "
        f"checkpointing {job.checkpoint}",
        f"layout: {lay.name} ({_layout_words(lay.name)}{_replicated_words(lay)}); candidates: "
        + ", ".join(f"{c.name} {fmt_seconds(c.step_time_s)} / {fmt_bytes(int(c.memory['peak']))}"
                    + ("" if c.memory["peak"] <= est.budget else " (does not fit)") + _replicated_words(c, short=True)
                    for c in est.candidates),
        "memory per GPU: at the peak, " + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(int(mem[k]))}" for k in MEMORY_KINDS)
        + f" = {fmt_bytes(int(mem['peak']))} of {fmt_bytes(int(est.budget))}: "
        + ("fits" if est.fits else "DOES NOT FIT") + _reserved_words(est),
        f"step: {fmt_seconds(d['step_time_s'])} = compute {fmt_seconds(d['step']['compute_s'])} (recompute "
        f"{fmt_seconds(d['step']['recompute_s'])}) + exposed communication "
        f"{fmt_seconds(d['step']['exposed_communication_s'])}"
        + (f" (of {fmt_seconds(d['step']['communication_s'])})" if d["step"]["communication_s"] is not None else "")
        + " + "
        f"optimizer {fmt_seconds(d['step']['optimizer_s'])} + bubbles {fmt_seconds(d['step']['bubble_s'])}"
        + _pipeline_words(d),
        f"throughput: {est.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {est.mfu:.1%}",
        f"(planned {job.planned} of {d['blocks']} blocks and stamped to full depth in {est.seconds:.1f} s)",
        "placements (first block's and the rest):",
    ]
    planner = next((c for c in est.candidates if c.name == "planner"), None)
    if planner is not None and planner.vs_recipes:  # calc.never_worse: by how much the planner wins over each
        wins = ", ".join(f"{r} x{f:.3f}" for r, f in planner.vs_recipes.items())
        lines.insert(-1, f"planner vs recipes (their step time over the planner's): {wins}"
                     + (f"; {planner.note}" if planner.note else ""))
    for name, pl in _shown(lay.placements):
        lines.append(f"  {name:<48} {fmt_placements(pl)}")
    return "\n".join(lines)


def _replicated_words(lay, short: bool = False) -> str:
    """What a layout computes whole on every rank of some mesh dims, on purpose (calc.Layout.replicated),
    and the work it does beyond the step's where that is not on purpose (calc.Layout.excess_work)."""
    out = ""
    if lay.replicated:
        dims = " x ".join(f"{n} {s}" for n, s in lay.replicated.items())
        out = f" (computes whole on {dims})" if short else f"; every rank of {dims} computes the same step"
    if lay.excess_work is not None:  # invariants.mark_excess_work: not what its name promises
        out += (f" (does {lay.excess_work:.2f}x the step's work: some ranks compute what others do too, not "
                f"chosen while another candidate does not)")
    return out


def _reserved_words(est) -> str:
    """What the caching allocator would hold beside the live peak, and what holding more than the budget means."""
    reserved = est.layout.memory.get("reserved")
    if reserved is None:
        return " (the caching allocator's reserve is not modelled under a pipeline)"
    out = (f"; PyTorch's caching allocator would reserve {fmt_bytes(int(reserved))} "
           f"({ALLOCATOR_NAMES[est.job.allocator]})")
    if reserved > est.budget >= est.layout.memory["peak"]:
        out += ": more than the budget, so expect allocation retries (torch's num_alloc_retries), not an OOM"
    return out


def _pipeline_words(d: dict) -> str:
    p = d.get("pipeline")
    if p is None:
        return " (no pipeline)"
    return (f" (pp {p['pp']}, {p['schedule']}, {p['stages_per_rank']} stage(s) per rank of "
            f"{max(p['stage_blocks'])} blocks at most, {p['microbatches']} microbatches: bubble "
            f"{p['bubble_fraction']:.1%} of the GPUs' time, p2p {fmt_bytes(int(p['p2p_bytes_per_message']))} per "
            f"message; the heaviest rank holds {p['rank_blocks']} blocks and {p['in_flight']} microbatch stashes)")


def _layout_words(name: str) -> str:
    return {"planner": "every parameter placed by the ILP", "fsdp": "every parameter sharded on the data dims",
            "fsdp+tp": "Megatron on tp, FSDP on the data dims",
            "dp+tp": "Megatron on tp, parameters whole on the data dims"}.get(name, name)


def _shown(placements: dict) -> list:
    """Parameters outside the blocks and those of the first block (the others repeat it)."""
    out = []
    for name, pl in placements.items():
        parts = name.split(".")
        idx = next((p for p in parts if p.isdigit()), None)
        if idx is None or idx == "0":
            out.append((name, pl))
    return out


def compare_text(rows: list) -> str:
    """Several meshes side by side, ranked (calc.compare's order)."""
    head = (f"{'rank':>4} {'mesh':<14} {'layout':<8} {'global batch':>12} {'step':>9} {'tok/s/GPU':>10} {'MFU':>6} "
            f"{'peak/GPU':>11} {'reserved':>11}  fits")
    lines = [head]
    for i, e in enumerate(rows, 1):
        mesh = "x".join(map(str, e.mesh.shape)) + " " + ",".join(e.mesh.names)
        reserved = e.layout.memory.get("reserved")
        reserved = PIPELINE_RESERVED if reserved is None else fmt_bytes(int(reserved))
        lines.append(f"{i:>4} {mesh:<14} {e.layout.name:<8} {e.global_batch:>12,} {fmt_seconds(e.step_time_s):>9} "
                     f"{e.tokens_per_s_per_gpu:>10,.0f} {e.mfu:>6.1%} {fmt_bytes(int(e.layout.memory['peak'])):>11} "
                     f"{reserved:>11}  {'yes' if e.fits else 'NO'}")
    return "\n".join(lines)


def html(rows: list) -> str:
    """A self-contained page: one table row per estimate, memory by kind as bars."""
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:4px 8px;"
             "border-bottom:1px solid #ddd;text-align:right}.bar{display:inline-block;height:10px}")
    colors = dict(zip(MEMORY_KINDS, ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2")))
    body = []
    for e in rows:
        d = data(e)
        total = max(d["memory_budget_bytes"], d["peak_memory_bytes"])
        bars = "".join(f'<span class="bar" title="{k}: {fmt_bytes(int(v))}" style="width:{300 * v / total:.0f}px;'
                       f'background:{colors[k]}"></span>' for k, v in d["memory_bytes"].items())
        mesh = "x".join(map(str, e.mesh.shape)) + " " + ",".join(e.mesh.names)
        reserved = d["reserved_memory_bytes"]
        reserved = "not modelled" if reserved is None else fmt_bytes(int(reserved))
        body.append(f"<tr><td>{_html.escape(mesh)}</td><td>{e.layout.name}</td><td>{fmt_seconds(e.step_time_s)}</td>"
                    f"<td>{e.tokens_per_s_per_gpu:,.0f}</td><td>{e.mfu:.1%}</td><td>{bars} "
                    f"{fmt_bytes(int(d['peak_memory_bytes']))}</td><td>{reserved}</td>"
                    f"<td>{'yes' if e.fits else 'no'}</td></tr>")
    first = rows[0]
    title = _html.escape(f"{first.job.model or first.job.config_path} on {first.job.gpus} x {first.job.gpu}")
    legend = " ".join(f'<span class="bar" style="width:10px;background:{c}"></span> {k.replace("_", " ")}'
                      for k, c in colors.items())
    detail = _html.escape(text(first))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{style}</style></head>"
            f"<body><h1>{title}</h1><table><tr><th>mesh</th><th>layout</th><th>step</th><th>tokens/s/GPU</th>"
            f"<th>MFU</th><th>memory per GPU</th><th>reserved (caching allocator)</th><th>fits</th></tr>"
            f"{''.join(body)}</table><p>{legend}</p>"
            f"<pre>{detail}</pre><script type='application/json' id='data'>"
            f"{_html.escape(json.dumps([data(e) for e in rows]))}</script></body></html>")


__all__ = ["data", "text", "compare_text", "html", "Replicate"]
