"""Train a small model on several processes with shardwise's torch backend.

    python -m torch.distributed.run --nproc_per_node 2 examples/torchrun_train.py
    python -m torch.distributed.run --nproc_per_node 4 examples/torchrun_train.py --inputs local --out ckpt.pt

Every process runs this whole script (torch's launcher starts them and sets RANK, WORLD_SIZE,
MASTER_ADDR, ...). Each builds the model with its own seed on purpose: parallelize broadcasts
rank 0's parameters and buffers to every rank (sync_module_states=True, DDP's convention), so
all ranks train rank 0's model. The mesh has one dim of the world size, data parallel.

--inputs global: every rank passes the whole batch; shardwise slices each rank's rows (and
    checks, on the first step, that every rank was handed the same batch).
--inputs local: each rank passes only its own rows, the DDP habit. Pieces follow torch.chunk
    (the first ranks get the larger pieces: 7 rows on 2 ranks are 4 + 3).

Collective calls (every rank makes them, in the same order): parallelize, pm.step, pm(x),
pm.clip_grad_norm_, pm.state_dict. Rank 0 prints one JSON line per step and, with --out,
saves the full state dict (state_dict(rank0_only=True): the other ranks get {}).
"""
import argparse
import json

import torch
import torch.distributed as dist

import shardwise as sw


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def batches(steps, batch, seed=1):  # the same full batches on every rank
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(steps)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", choices=("global", "local"), default="global")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=7)
    ap.add_argument("--out", default=None, help="rank 0 saves the trained state dict here")
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(rank)  # different weights per rank on purpose: parallelize broadcasts rank 0's
    model = Net()
    mesh = sw.Mesh((world,), ("dp",))

    def mine(t):  # "local": this rank's rows (its torch.chunk piece); "global": the whole batch
        if args.inputs == "global":
            return t
        return sw.Layout(t.shape, t.dtype, [sw.Shard(0)]).local_view(t, mesh, rank)

    data = [(mine(x), mine(y)) for x, y in batches(args.steps, args.batch)]
    pm = sw.parallelize(model, mesh, (data[0][0],), loss_fn=loss_fn, example_targets=(data[0][1],),
                        backend="torch", inputs=args.inputs,
                        input_placements={"x": {"dp": sw.Shard(0)}}, target_placements={0: {"dp": sw.Shard(0)}})
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(1234)  # the dropout stream: the same on every rank, as on one device
    for step, (x, y) in enumerate(data):
        loss = pm.step(x, y)
        norm = pm.clip_grad_norm_(1.0)  # the global norm (torch's over pm.parameters() over-counts)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "grad_norm": norm.item()}), flush=True)
    pm.eval()
    out = pm(data[0][0])  # full outputs on every rank, dropout off
    state = pm.state_dict(rank0_only=True)  # collective: every rank calls it; ranks > 0 get {}
    if rank == 0:
        print(json.dumps({"eval_out_sum": out.sum().item()}), flush=True)
        if args.out:
            torch.save(state, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
