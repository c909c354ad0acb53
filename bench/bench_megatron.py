"""Tensor-parallel MLP: shardwise's Megatron placements against hand-written Megatron code
(column-parallel fc1, row-parallel fc2, Megatron's f/g autograd functions around them: one
all_reduce of the output forward, one of the input gradient backward), same weights and data.

    python bench/bench_megatron.py [--nproc 2] [--steps 20] [--warmup 3]

Per rank the two training steps (forward + backward, no optimizer) are interleaved step by
step with a barrier around each (shardwise.tools.bench._interleaved), median over ``steps``, max over
ranks; both losses and fc1's weight gradient are checked against one device (rtol 1e-4).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

SIZE = {"d_model": 256, "hidden": 1024, "batch": 32}


class _ReduceForward(torch.autograd.Function):
    """Megatron's g: all_reduce the row-parallel partial sums; the gradient passes through."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReduceBackward(torch.autograd.Function):
    """Megatron's f: identity forward; all_reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class MegatronMLP(torch.nn.Module):
    """This rank's shard of ``shardwise.tools.bench.MLP``: fc1 rows, fc2 columns, fc2's bias whole."""

    def __init__(self, full, rank: int, world: int):
        super().__init__()
        h = full.fc1.weight.shape[0] // world
        rows = slice(rank * h, (rank + 1) * h)
        self.w1 = torch.nn.Parameter(full.fc1.weight.detach()[rows].clone())
        self.b1 = torch.nn.Parameter(full.fc1.bias.detach()[rows].clone())
        self.w2 = torch.nn.Parameter(full.fc2.weight.detach()[:, rows].clone())
        self.b2 = torch.nn.Parameter(full.fc2.bias.detach().clone())

    def forward(self, x):
        x = _ReduceBackward.apply(x)
        return _ReduceForward.apply(F.gelu(F.linear(x, self.w1, self.b1)) @ self.w2.t()) + self.b2


def _body(rank: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.tools.bench import _build, _close, _interleaved, _shardwise, _single_device, mse

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model, x, y = _build("mlp", SIZE)
    ref_loss, ref_grads = _single_device(copy.deepcopy(model), x, y)
    hand = MegatronMLP(model, rank, world)
    spec = {"fc1.weight": [sw.Shard(0)], "fc1.bias": [sw.Shard(0)], "fc2.weight": [sw.Shard(1)]}
    pm = _shardwise(copy.deepcopy(model), x, y, ("tp",), param_placements=spec)
    out = {}

    def peer():
        hand.zero_grad(set_to_none=True)
        loss = mse(hand(x), y)
        loss.backward()
        out["hand"] = loss.detach()

    def mine():
        pm.zero_grad()
        out["sw"] = pm.step(x, y)

    peer_t, sw_t = _interleaved(peer, mine, steps, warmup)
    h = ref_grads["fc1.weight"].shape[0] // world
    want = ref_grads["fc1.weight"][rank * h:(rank + 1) * h]
    ok = (_close(out["hand"], ref_loss) and _close(out["sw"], ref_loss) and _close(hand.w1.grad, want)
          and _close(pm.gradients()["fc1.weight"], ref_grads["fc1.weight"]))
    return {"hand_s": statistics.median(peer_t), "sw_s": statistics.median(sw_t), "ok": ok}


def run(nproc: int = 2, steps: int = 20, warmup: int = 3) -> dict:
    """{hand_s, sw_s, ratio, ok}: medians, max over ranks."""
    from shardwise.run.launch import spawn

    per_rank = spawn(_body, nproc, steps, warmup, timeout=600)
    hand, mine = max(r["hand_s"] for r in per_rank), max(r["sw_s"] for r in per_rank)
    return {"hand_s": hand, "sw_s": mine, "ratio": mine / hand, "ok": all(r["ok"] for r in per_rank)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    r = run(a.nproc, a.steps, a.warmup)
    print(f"Megatron MLP {SIZE}, {a.nproc} gloo processes: hand-written {r['hand_s'] * 1e3:.2f} ms, shardwise "
          f"{r['sw_s'] * 1e3:.2f} ms, {r['ratio']:.2f}x; matches one device: {'yes' if r['ok'] else 'NO'}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
