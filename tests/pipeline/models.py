"""Models and checks shared by the pipeline tests.

- ``hf(name, layers, batch)``: zoo GPT-2 / Llama with labels ignored (-100) unevenly over the batch.
- ``pipe(schedule, m)``: an sw.Pipeline (interleaved runs 2 stages per rank).
- ``Net``: a small residual MLP of ``n`` blocks (fast exactness checks, composition).
- ``BusyNet``: blocks whose forward, input gradient and weight gradient each take a fixed wall
  time (custom ops that sleep, as a GPU kernel keeps its CPU thread idle): the schedules'
  timelines measured on an oversubscribed CPU without contention distorting them. Its rules
  live in ``BUSY_RULES`` (pass ``registry=BUSY_RULES``).
- ``UnequalLM``: a large embedding and LM head around small blocks (the planner's split).
- ``MoENet``: residual Mixture-of-Experts blocks (the experts op) for pipeline x expert parallel.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.core.layout import Partial, Replicate, Shard
from shardwise.ops.moe import moe_experts
from shardwise.rules import Registry
from shardwise.rules.registry import Strategy1D
from tests.models import zoo

ADAM = {"steps": 2, "lr": 1e-3, "optim_kwargs": {"eps": 1e-6}}  # GPT-2's key bias gradient is float noise


def hf(name: str, layers: int = 2, batch: int = 6, seq: int = 8, dropout: bool = False):
    """(model, inputs) of a zoo HF model whose labels ignore positions unevenly across the batch
    (every microbatch split of 6 rows gets a different count of -100)."""
    kw = {"dropout": dropout} if dropout else {}
    model, inputs, _, _ = zoo.MODELS[name](batch=batch, seq=seq, layers=layers, **kw)
    labels = inputs[-1]
    labels[0, :5] = -100
    labels[min(3, batch - 1), 2:] = -100
    labels[batch - 1, seq - 1] = -100
    return model, inputs


def pipe(schedule: str, m: int, **kw) -> sw.Pipeline:
    return sw.Pipeline("pp", microbatches=m, schedule=schedule, stages_per_rank=2 if schedule == "interleaved" else 1,
                       **kw)


class Net(nn.Module):
    """in -> n residual GELU blocks -> out; mse loss_fn below."""

    def __init__(self, n: int = 4, d: int = 8, d_in: int = 6, d_out: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))
        self.out = nn.Linear(d, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch: int = 7, d_in: int = 6, d_out: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)


# -- blocks of fixed wall time ---------------------------------------------------------------------
@torch.library.custom_op("swtest::busy_scale", mutates_args=())
def busy_scale(x: torch.Tensor, w: torch.Tensor, seconds: float) -> torch.Tensor:
    """x * w (w over the last dim), after ``seconds`` of wall time."""
    time.sleep(seconds)
    return x * w


@busy_scale.register_fake
def _(x, w, seconds):
    return torch.empty_like(x)


@torch.library.custom_op("swtest::busy_grad_w", mutates_args=())
def busy_grad_w(g: torch.Tensor, x: torch.Tensor, seconds: float) -> torch.Tensor:
    """The weight gradient of busy_scale: sum of g * x over every dim but the last."""
    time.sleep(seconds)
    return (g * x).reshape(-1, x.shape[-1]).sum(0)


@busy_grad_w.register_fake
def _(g, x, seconds):
    return g.new_empty(x.shape[-1:])


def _busy_backward(ctx, g):
    x, w = ctx.saved_tensors
    return busy_scale(g, w, ctx.seconds), busy_grad_w(g, x, ctx.seconds), None


def _busy_setup(ctx, inputs, output):
    x, w, seconds = inputs
    ctx.save_for_backward(x, w)
    ctx.seconds = seconds


busy_scale.register_autograd(_busy_backward, setup_context=_busy_setup)

BUSY_RULES = Registry()
R = Replicate()
sw.rule(torch.ops.swtest.busy_scale.default, registry=BUSY_RULES)(
    lambda call: [Strategy1D((R,), (R, R))] + [Strategy1D((Shard(d),), (Shard(d), R))
                                              for d in range(call.ins[0].ndim - 1)])
sw.rule(torch.ops.swtest.busy_grad_w.default, registry=BUSY_RULES)(
    lambda call: [Strategy1D((R,), (R, R))] + [Strategy1D((Partial(),), (Shard(d), Shard(d)))
                                              for d in range(call.ins[0].ndim - 1)])


class BusyNet(nn.Module):
    """``n`` blocks x -> busy_scale(x, w_k): each block's forward, input gradient and weight gradient
    take ``seconds`` of wall time per microbatch."""

    def __init__(self, n: int = 4, d: int = 16, seconds: float = 0.02):
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(d))  # so the first block's input gradient is taken too
        self.blocks = nn.ModuleList(_Busy(d, seconds) for _ in range(n))

    def forward(self, x):
        x = x * self.scale
        for b in self.blocks:
            x = b(x)
        return x


class _Busy(nn.Module):
    def __init__(self, d: int, seconds: float):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.9, 1.1, d))
        self.seconds = seconds

    def forward(self, x):
        return busy_scale(x, self.w, self.seconds)


def total(out):
    return out.sum()


# -- unequal layers ------------------------------------------------------------------------------------
class UnequalLM(nn.Module):
    """A large embedding and LM head (vocab x dim) around ``n`` small MLP blocks."""

    def __init__(self, vocab: int = 2048, dim: int = 64, n: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
                                    for _ in range(n))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def ce(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())


# -- Mixture of Experts ----------------------------------------------------------------------------------
class MoENet(nn.Module):
    """in -> ``n`` residual Mixture-of-Experts blocks (a router, top-``k`` of ``experts`` SiLU-gated
    expert MLPs as one ``shardwise.moe_experts`` op) -> out; tokens are rows, mse loss_fn."""

    def __init__(self, n: int = 2, d: int = 8, inter: int = 4, experts: int = 4, k: int = 2, d_in: int = 6,
                 d_out: int = 3, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(_MoE(d, inter, experts, k) for _ in range(n))
        self.out = nn.Linear(d, d_out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


class _MoE(nn.Module):
    def __init__(self, d: int, inter: int, experts: int, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, d))
        self.down = nn.Parameter(torch.empty(experts, d, inter))

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        return moe_experts(x, idx, w, self.gate_up, self.down, "silu", 0)
