"""A short training script for torch's launcher: a Megatron MLP on a mesh of the world size,
two AdamW steps on the torch backend, the loss printed by rank 0.

    python -m torch.distributed.run --nproc_per_node 2 tests/run/torchrun_step.py [--fail-rank R]
        [--hang-rank R] [--destroy] [--state-dict-on-rank0] [--timeout S]

``--fail-rank R`` makes rank R raise inside a program node of the second step; ``--hang-rank R``
makes it sleep there instead (alive, never arriving at the collective that follows);
``--state-dict-on-rank0`` calls the (collective) ``pm.state_dict()`` on rank 0 only. A rank
that raises prints how long it took to stop and waits (at most 60 s) for the others to stop
too before re-raising, so every rank's error reaches stderr before the launcher ends the job;
``--destroy`` ends with ``torch.distributed.destroy_process_group()`` (without it, the
process groups are left for shardwise's exit handler, as many scripts do). At exit, after
shardwise's handler, each rank prints how many gloo threads are still alive: any left would
run into interpreter finalisation, where they abort the process now and then.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.run.backend import TorchBackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--hang-rank", type=int, default=None)
    ap.add_argument("--destroy", action="store_true")
    ap.add_argument("--state-dict-on-rank0", action="store_true")
    ap.add_argument("--timeout", type=float, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    atexit.register(_report_gloo_threads)  # registered before shardwise's handler, so runs after it
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    mesh = sw.Mesh((world,), ("tp",))
    backend = TorchBackend(mesh) if a.timeout is None else TorchBackend(mesh, timeout=a.timeout)
    pm = sw.parallelize(model, mesh, (x,), loss_fn=lambda o, t: ((o - t) ** 2).mean(), backend=backend,
                        param_placements={"0.weight": [sw.Shard(0)], "0.bias": [sw.Shard(0)], "2.weight": [sw.Shard(1)]})
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    t0 = time.monotonic()
    try:
        for step in range(2):
            if step == 1 and a.fail_rank == rank:
                break_node(pm, rank)
            if step == 1 and a.hang_rank == rank:
                break_node(pm, rank, action=_Sleep())
            t0 = time.monotonic()
            loss = pm.step(x, y)
            opt.step()
            opt.zero_grad()
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
        if a.state_dict_on_rank0:
            t0 = time.monotonic()
            if rank == 0:
                pm.state_dict()
            else:  # alive and busy elsewhere (the hard case for a timeout) until rank 0 stopped
                _stopped_together([0])
    except Exception as e:
        print(f"rank {rank} stopped after {time.monotonic() - t0:.2f}s: {type(e).__name__}", file=sys.stderr,
              flush=True)
        # so that every rank prints its own error before the launcher stops the others
        _stopped_together([r for r in range(world) if r != a.hang_rank])
        raise
    if a.destroy:
        dist.destroy_process_group()


def _report_gloo_threads() -> None:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    left = [n for n in names if "gloo" in n]
    print(f"rank {os.environ.get('RANK')}: gloo threads left at exit: {len(left)} {left}", file=sys.stderr, flush=True)


def _stopped_together(ranks) -> None:
    """Say this rank stopped, then wait (60 s at most) until ``ranks`` have said so too."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    try:
        store.set(f"test/stopped/{dist.get_rank()}", "1")
        store.wait([f"test/stopped/{r}" for r in ranks], datetime.timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - a peer's launcher may be gone already
        pass


def break_node(pm, rank: int, node: str = "addmm_1", action=None) -> None:
    """Make ``rank``'s step program raise ValueError (or call ``action``) at ``node`` (by default the matmul feeding
    the step's first all-reduce, so the other ranks are left waiting in that collective). The
    program the backend runs next: guarded on a plan's first run, plain after (run/execute.Executable)."""
    gm = pm._executable(pm.plan).program(rank)
    target = next((n for n in gm.graph.nodes if n.name == f"{node}_unchecked"), None) or next(
        n for n in gm.graph.nodes if n.name == node)
    target.target = action or _Boom(rank)
    gm.recompile()


class _Sleep:
    __name__ = "sleep"

    def __call__(self, *args, **kwargs):
        time.sleep(3600)


class _Boom:
    __name__ = "boom"

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, *args, **kwargs):
        raise ValueError(f"deliberate failure on rank {self.rank}")


if __name__ == "__main__":
    main()
