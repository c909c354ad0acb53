"""``shardwise demo --backend torch``: the same training on real gloo processes, one per rank
(run/launch.spawn), each running only its own rank's program with torch.distributed
collectives. Rank 0 reports the losses, the gathered final state and the plan.
"""
from __future__ import annotations

import math
import time

import torch

from .runner import DemoOptions, RunResult, batch_at, build_model, parallelize_demo, plan_texts


def _rank_main(rank: int, opts: DemoOptions) -> dict | None:
    model = build_model(opts)
    t0 = time.perf_counter()
    pm = parallelize_demo(opts, model, "torch")
    plan_s = time.perf_counter() - t0
    opt = pm.optimizer(torch.optim.AdamW, lr=opts.lr)
    losses, t0 = [], time.perf_counter()
    every = max(1, opts.steps // 10)
    for step in range(opts.steps):
        x, y = batch_at(opts, step)
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step % every == 0 or step == opts.steps - 1):
            tps = x.numel() * (step + 1) / max(time.perf_counter() - t0, 1e-9)
            print(f"  step {step + 1:>4}/{opts.steps}  loss {losses[-1]:.4f}  {tps:,.0f} tokens/s", flush=True)
    seconds = time.perf_counter() - t0
    state = pm.state_dict()  # collective: every rank takes part
    if rank != 0:
        return None
    brief, summary = plan_texts(pm, opts)
    return {"losses": losses, "state": state, "seconds": seconds, "plan_seconds": plan_s, "brief": brief,
            "summary": summary}


def train_processes(opts: DemoOptions) -> RunResult:
    from ...run.launch import spawn

    return RunResult(**spawn(_rank_main, math.prod(opts.mesh), opts, timeout=600.0)[0])
