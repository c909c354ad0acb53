"""The calibrated cost model against the clock: GPT-2 (HF GPT2LMHeadModel, random weights; 4 layers,
width 256, 8 heads, vocab 1024, batch 8 x 256) on 2 gloo processes under four layouts: DP (batch
sharded), FSDP (every parameter Shard(0), gathered for use), Megatron (tensor parallel on one mesh
dim) and replicated (every rank the whole step).

    shardwise calibrate --nproc 2 --out bench/profile.json
    python bench/bench_calibrated.py --profile bench/profile.json [--steps 7] [--warmup 2] [--layers 4]

(without --profile the bench calibrates first, ``--quick``). One spawn of ``--nproc`` processes plans
every layout with ``sw.CostModel.from_profile(profile)`` and times its training step (forward +
backward, no optimizer) with a barrier before and after, the layouts interleaved step by step and
their order rotated so the machine's load falls on all alike; a step's time is the slowest
rank's, the figure the median over steps. Printed per layout: measured, modelled
(``pm.plan.stats()["est_step_time_s"]``, its compute and communication parts), the ratio
modelled / measured, the same ratio under the hand-set "cpu" preset, and whether the loss equals
one device's (rtol 1e-4). Then the median ratio, and every pair of layouts whose measured times
differ by more than 30%: ordered as the clock orders them or not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

SIZE = dict(n_layer=4, n_embd=256, n_head=8, vocab=1024, batch=8, seq=256)
LAYOUTS = ("dp", "fsdp", "megatron", "replicated")


def _gpt2(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=size["n_layer"], n_embd=size["n_embd"], n_head=size["n_head"], vocab_size=size["vocab"],
                     n_positions=size["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))
    return model, ids


class _LM(torch.nn.Module):
    """HF GPT-2 as ``forward(ids, labels) -> loss``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def _parallel(layout: str, model, ids, world: int, cost):
    import shardwise as sw

    batch = {0: [sw.Shard(0)], 1: [sw.Shard(0)]}
    if layout == "dp":
        kw = dict(mesh=sw.Mesh((world,), ("dp",)), input_placements=batch)
    elif layout == "fsdp":
        kw = dict(mesh=sw.Mesh((world,), ("dp",)), input_placements=batch, param_placements=sw.recipes.fsdp(model, "dp"))
    elif layout == "megatron":
        kw = dict(mesh=sw.Mesh((world,), ("tp",)), param_placements=sw.recipes.megatron(model, "tp"))
    else:
        kw = dict(mesh=sw.Mesh((world,), ("dp",)))
    mesh = kw.pop("mesh")
    return sw.parallelize(model, mesh, (ids, ids), backend="torch", cost_model=cost, planner="propagate", **kw)


def _rank(rank: int, profile: dict, size: dict, steps: int, warmup: int) -> dict:
    import copy
    import time
    import warnings

    import torch.distributed as dist

    import shardwise as sw
    from shardwise.search.steptime import step_time

    warnings.filterwarnings("ignore")
    world = dist.get_world_size()
    cost, preset = sw.CostModel.from_profile(profile), sw.CostModel.preset("cpu")
    model, ids = _gpt2(size)
    model = _LM(model)
    ref = copy.deepcopy(model)(ids, ids).detach()
    pms = {name: _parallel(name, copy.deepcopy(model), ids, world, cost) for name in LAYOUTS}
    drift = [_probe()]  # the machine's pace now and after timing, against the profile's
    times = {name: [] for name in LAYOUTS}
    losses = {}
    for i in range(warmup + steps):
        order = LAYOUTS[i % len(LAYOUTS):] + LAYOUTS[:i % len(LAYOUTS)]
        for name in order:
            pm = pms[name]
            dist.barrier()
            t0 = time.perf_counter()
            pm.zero_grad()
            losses[name] = pm.step(ids, ids)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    drift.append(_probe())
    out = {"_probe": drift}
    for name, pm in pms.items():
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each step: its slowest rank
        st = pm.plan.stats()
        out[name] = {"measured_s": statistics.median(t.tolist()), "est_s": st["est_step_time_s"],
                     "compute_s": st["compute_time_s"], "comm_s": st["exposed_comm_time_s"],
                     "preset_s": step_time(pm.plan.prop, preset, pm.plan.bucket_bytes).total_s,
                     "nodes": st["nodes"], "loss_ok": bool(torch.allclose(losses[name].float(), ref, rtol=1e-4)),
                     "spread": (min(t.tolist()), max(t.tolist()))}
    return out


PROBE = (512, 512, 512)


def _probe() -> float:
    """flop/s of one float32 matmul of PROBE's shape, as calibrate measures it (a point of its curve)."""
    from shardwise.tools.calibrate import kernels

    return kernels.matmul_points(torch.float32, [PROBE], kernels.overhead())[0][1]


def ordered_pairs(rows: dict, gap: float = 0.3) -> list:
    """(a, b, ordered) for every pair whose measured times differ by more than ``gap`` (a the faster):
    ordered when the model also has a faster than b."""
    out = []
    names = sorted(rows, key=lambda n: rows[n]["measured_s"])
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if rows[b]["measured_s"] > (1 + gap) * rows[a]["measured_s"]:
                out.append((a, b, rows[a]["est_s"] < rows[b]["est_s"]))
    return out


def report(rows: dict, profile: dict | None = None) -> str:
    probe = rows.pop("_probe", None)
    lines = [f"{'layout':<11} {'measured':>9} {'modelled':>9} {'compute':>8} {'comm':>8} {'ratio':>6} "
             f"{'preset':>7} {'loss':>5}  measured min..max"]
    for name, r in rows.items():
        lines.append(f"{name:<11} {r['measured_s']:9.3f} {r['est_s']:9.3f} {r['compute_s']:8.3f} {r['comm_s']:8.3f} "
                     f"{r['est_s'] / r['measured_s']:6.2f} {r['preset_s'] / r['measured_s']:7.2f} "
                     f"{'ok' if r['loss_ok'] else 'BAD':>5}  {r['spread'][0]:.3f}..{r['spread'][1]:.3f}")
    ratios = [r["est_s"] / r["measured_s"] for r in rows.values()]
    lines.append(f"ratio modelled / measured: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}.."
                 f"{max(ratios):.2f} (preset 'cpu': median "
                 f"{statistics.median(r['preset_s'] / r['measured_s'] for r in rows.values()):.2f})")
    for a, b, ok in ordered_pairs(rows):
        lines.append(f"{a} faster than {b} by the clock ({rows[b]['measured_s'] / rows[a]['measured_s']:.2f}x): "
                     f"{'ordered alike by the model' if ok else 'ORDERED THE OTHER WAY by the model'}")
    if probe is not None and profile is not None:
        at = dict((p[0], p[1]) for p in profile["compute"]["float32"]["matmul"]).get(2.0 * PROBE[0] * PROBE[1] * PROBE[2])
        lines.append(f"matmul {'x'.join(map(str, PROBE))} float32 on rank 0: {probe[0] / 1e9:.2f} GFLOP/s before "
                     f"timing, {probe[1] / 1e9:.2f} after" + (f"; the profile says {at / 1e9:.2f}" if at else ""))
        if at:  # a diagnostic, not the model: how much of the ratio is the machine's pace moving
            pace = statistics.mean(probe) / at
            normed = [r["est_s"] / pace / r["measured_s"] for r in rows.values()]
            lines.append(f"the machine ran {pace:.2f}x the profile's pace while timing; ratios scaled by it: median "
                         f"{statistics.median(normed):.2f}, range {min(normed):.2f}..{max(normed):.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a profile shardwise calibrate wrote (default: calibrate now, --quick)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=SIZE["n_layer"])
    args = ap.parse_args(argv)
    from shardwise.core.profile import read, source_line
    from shardwise.run.launch import spawn
    from shardwise.tools.calibrate import calibrate

    if args.profile:
        profile = read(args.profile)
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="shardwise-bench-"), "profile.json")
        profile = calibrate(args.nproc, path, quick=True, show_progress=sys.stderr.isatty())
    size = {**SIZE, "n_layer": args.layers}
    rows = spawn(_rank, args.nproc, profile, size, args.steps, args.warmup, timeout=1800)[0]
    print(f"GPT-2 {size}, {args.nproc} gloo processes, {args.steps} steps after {args.warmup} warmup")
    print(f"profile: {source_line(profile)}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)")
    print(report(rows, profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
