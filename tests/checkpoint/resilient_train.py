"""A fault-tolerant training script: dropout, AdamW, FSDP-style shards, a Checkpointer every 3 steps;
a restarted group resumes from the newest complete checkpoint and ends with the same bits.

    shardwise run tests/checkpoint/resilient_train.py --nproc 2 --max-restarts 1 -- OUT \\
        [--steps 12] [--kill-rank R --kill-step S [--corrupt-newest]] [--sync]

``--kill-rank R --kill-step S``: on the first attempt, rank R kills itself (SIGKILL) during step S,
after its forward and backward; with ``--corrupt-newest`` it first waits for the save in flight
and truncates a shard file of the newest checkpoint. Rank 0 appends ``attempt step loss`` (the
loss as float.hex) to OUT/losses.txt; at the end OUT/final.pt holds the full parameters and
optimizer state, and every attempt's resume is in OUT/resumed.txt.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist

import shardwise as sw


class Batches:
    """An endless stream of seeded batches; its position (the generator state) is its state_dict."""

    def __init__(self, seed: int, n: int = 8):
        self.gen, self.n = torch.Generator().manual_seed(seed), n

    def next(self):
        return torch.randn(self.n, 8, generator=self.gen), torch.randn(self.n, 4, generator=self.gen)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])


def mse(out, y):
    return ((out - y) ** 2).mean()


def build(world: int):
    torch.manual_seed(0)  # the same weights on every rank (and the same dropout streams)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(32, 4))
    x = torch.zeros(8, 8)
    params = {n: [sw.Shard(0)] for n, _ in model.named_parameters()}
    pm = sw.parallelize(model, sw.Mesh((world,), ("dp",)), (x,), input_placements={0: [sw.Shard(0)]},
                        param_placements=params, loss_fn=mse, backend="torch")
    return pm, pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def truncate_newest(ck) -> None:
    ck.wait()  # the save in flight is now in place: damage the newest one
    newest = ck.checkpoints[-1]
    shard = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[0]
    path = os.path.join(newest, shard)
    os.truncate(path, os.path.getsize(path) // 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-step", type=int, default=None)
    ap.add_argument("--corrupt-newest", action="store_true")
    ap.add_argument("--sync", action="store_true", help="save in the foreground")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    pm, opt = build(world)
    loader = Batches(seed=1)
    ck = sw.Checkpointer(os.path.join(a.out, "ckpt"), every=3, keep=3, async_save=not a.sync)
    start = ck.resume(pm, opt)
    if start:
        loader.load_state_dict(ck.extra["data"])
    if rank == 0:
        with open(os.path.join(a.out, "resumed.txt"), "a") as f:
            f.write(f"{attempt} {start} {ck.resumed_from}\n")
    for step in range(start + 1, a.steps + 1):
        x, y = loader.next()
        loss = pm.step(x, y)
        if attempt == 0 and rank == a.kill_rank and step == a.kill_step:
            if a.corrupt_newest:
                truncate_newest(ck)
            os.kill(os.getpid(), signal.SIGKILL)
        pm.clip_grad_norm_(1.0)
        opt.step()
        pm.zero_grad()
        if rank == 0:
            with open(os.path.join(a.out, "losses.txt"), "a") as f:
                f.write(f"{attempt} {step} {loss.item().hex()}\n")
        ck.step(step, extra=lambda: {"data": loader.state_dict()})
    ck.close()
    final = {"model": pm.state_dict(), "optim": pm.optimizer_state_dict(opt)}
    if rank == 0:
        torch.save(final, os.path.join(a.out, "final.pt"))


if __name__ == "__main__":
    main()
