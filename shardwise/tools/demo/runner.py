"""``shardwise demo``: train the demo GPT sharded on a mesh, then the same steps on one device,
and say whether the two runs match.

    shardwise demo                                   # (2, 2) mesh ("dp", "tp"), the planner's choice
    shardwise demo --parallel tp --steps 50          # Megatron on "tp", batch on "dp"
    shardwise demo --backend torch --nproc 4         # 4 gloo processes instead of threads

The data (sorting digits, task.py) is made on the fly from a seed, so both runs see the same
batches; both start from the same weights and use AdamW. Losses and final parameters are
compared with rtol 1e-4 (float32; the sharded run sums in another order, so they agree to
rounding, not bit for bit).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ...core.errors import ShardingError
from . import task
from .model import GPT, GPTConfig, lm_loss

PARALLEL = ("auto", "dp", "tp", "sp", "fsdp")
# The demo's ranks are CPU threads: at a GPU's compute rate (CostModel()'s) the ILP rightly
# finds that a model this small is cheapest computed whole on every rank; at a CPU core's rate
# (1 GFLOP/s here, with CostModel()'s links), splitting the work across ranks pays.
DEMO_FLOPS = 1e9
RTOL, ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class DemoOptions:
    mesh: tuple = (2, 2)
    names: tuple = ("dp", "tp")
    steps: int = 150
    parallel: str = "auto"
    backend: str = "threads"
    nproc: int | None = None
    batch: int = 32
    length: int = 8
    lr: float = 3e-3
    seed: int = 0
    full_plan: bool = False

    def check(self) -> None:
        if len(self.mesh) != len(self.names):
            raise ShardingError(f"--mesh {'x'.join(map(str, self.mesh))} has {len(self.mesh)} dims but --names "
                                f"gives {len(self.names)}", fix="give one name per mesh dim, e.g. --mesh 2x2 --names dp,tp")
        if self.parallel not in PARALLEL:
            raise ShardingError(f"unknown --parallel {self.parallel!r}", fix=f"use one of {', '.join(PARALLEL)}")
        size = math.prod(self.mesh)
        if self.backend == "threads" and self.nproc is not None:
            raise ShardingError("--nproc starts processes, which only the torch backend uses",
                                fix=f"add --backend torch (with --nproc {size}), or drop --nproc")
        if self.backend == "torch" and self.nproc not in (None, size):
            raise ShardingError(f"--nproc {self.nproc} does not match the mesh's {size} ranks",
                                fix=f"use --nproc {size} or another --mesh")
        if self.steps < 1:
            raise ShardingError(f"--steps must be at least 1, got {self.steps}", fix="e.g. --steps 100")


def build_model(opts: DemoOptions) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)
        return GPT(GPTConfig(vocab=task.VOCAB, max_len=2 * opts.length))


def batch_at(opts: DemoOptions, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: made on the fly from the seed, the same for every run."""
    return task.batch(opts.batch, opts.length, torch.Generator().manual_seed(opts.seed * 1_000_003 + step))


def layout(opts: DemoOptions, model) -> dict:
    """parallelize() keyword arguments for ``--parallel``: the first mesh dim carries the batch,
    the last one the model (Megatron), the sequence (sp) or the parameter shards (fsdp)."""
    from ...module import recipes
    from ...core.layout import Shard

    data, model_dim = opts.names[0], opts.names[-1]
    two_d = len(opts.names) > 1
    batch_on = {data: Shard(0)}
    every = {n: Shard(0) for n in opts.names}
    if opts.parallel == "auto":
        from ...core.cost import CostModel

        return dict(input_placements={0: batch_on}, param_placements="auto", planner="ilp",
                    cost_model=CostModel(flops=DEMO_FLOPS))
    if opts.parallel == "dp":
        return dict(input_placements={0: every})
    if opts.parallel == "tp":
        return dict(input_placements={0: batch_on} if two_d else {}, param_placements=recipes.megatron(model, model_dim))
    if opts.parallel == "sp":
        return dict(input_placements={0: {**(batch_on if two_d else {}), model_dim: Shard(1)}})
    return dict(input_placements={0: every}, param_placements=recipes.fsdp(model, opts.names))


@dataclass
class RunResult:
    losses: list = field(default_factory=list)
    state: dict = field(default_factory=dict)
    seconds: float = 0.0
    plan_seconds: float = 0.0
    brief: str = ""
    summary: str = ""


def train_single(opts: DemoOptions) -> RunResult:
    """The reference: the same model, batches and optimizer on one device."""
    model = build_model(opts)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    res, t0 = RunResult(), time.perf_counter()
    for step in range(opts.steps):
        x, y = batch_at(opts, step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        res.losses.append(loss.item())
    res.seconds = time.perf_counter() - t0
    res.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


def parallelize_demo(opts: DemoOptions, model, backend: str):
    from ...module.parallel_module import parallelize
    from ...core.mesh import Mesh

    x, y = batch_at(opts, 0)
    return parallelize(model, Mesh(tuple(opts.mesh), tuple(opts.names)), (x,), loss_fn=lm_loss,
                       example_targets=(y,), backend=backend, **layout(opts, model))


def plan_texts(pm, opts: DemoOptions) -> tuple[str, str]:
    from ..report import brief, plan_data

    return brief(plan_data(pm.plan, "shardwise demo")), (pm.plan.summary() if opts.full_plan else "")


def train_sharded(opts: DemoOptions, progress=None, on_plan=None) -> RunResult:
    """Plan, then train on the threads backend; ``on_plan(result)`` once planned (plan texts
    filled in), ``progress(step, loss, tokens_per_s)`` after each step."""
    model = build_model(opts)
    t0 = time.perf_counter()
    pm = parallelize_demo(opts, model, "threads")
    res = RunResult(plan_seconds=time.perf_counter() - t0)
    res.brief, res.summary = plan_texts(pm, opts)
    if on_plan is not None:
        on_plan(res)
    opt = pm.optimizer(torch.optim.AdamW, lr=opts.lr)
    t0 = time.perf_counter()
    for step in range(opts.steps):
        x, y = batch_at(opts, step)
        s0 = time.perf_counter()
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad()
        res.losses.append(loss.item())
        if progress is not None:
            progress(step, res.losses[-1], x.numel() / max(time.perf_counter() - s0, 1e-9))
    res.seconds = time.perf_counter() - t0
    res.state = pm.state_dict()
    return res


@dataclass
class Comparison:
    max_loss_diff: float
    max_param_diff: float  # largest |difference| of any parameter entry
    worst_param: str
    max_rel_param_diff: float  # largest ||difference|| / ||parameter|| over the tensors
    match: bool


def compare(sharded: RunResult, single: RunResult) -> Comparison:
    """Losses step by step (rtol 1e-4) and every final parameter tensor (relative norm of the
    difference below 1e-4: after many AdamW steps single entries carry the rounding of a
    different summation order, which the optimizer's normalisation makes step-sized)."""
    ok = len(sharded.losses) == len(single.losses) and set(sharded.state) == set(single.state)
    loss_diff = 0.0
    for a, b in zip(sharded.losses, single.losses):
        loss_diff = max(loss_diff, abs(a - b))
        ok &= abs(a - b) <= ATOL + RTOL * abs(b)
    worst, param_diff, rel = "", 0.0, 0.0
    for name, want in single.state.items():
        got = sharded.state.get(name)
        if got is None or got.shape != want.shape or not want.numel():
            ok &= got is not None and got.shape == want.shape
            continue
        d = (got.double() - want.double())
        if float(d.abs().max()) >= param_diff:
            worst, param_diff = name, float(d.abs().max())
        r = float(d.norm() / max(float(want.double().norm()), ATOL))
        rel = max(rel, r)
        ok &= r <= RTOL
    return Comparison(loss_diff, param_diff, worst, rel, bool(ok))


def accuracy(opts: DemoOptions, state: dict) -> float:
    """Share of sorted digits the trained weights predict on a fresh batch."""
    model = build_model(opts)
    model.load_state_dict(state)
    x, y = task.batch(256, opts.length, torch.Generator().manual_seed(opts.seed + 777))
    with torch.no_grad():
        return task.accuracy(model(x), y)


__all__ = ["DemoOptions", "PARALLEL", "train_single", "train_sharded", "compare", "accuracy", "layout",
           "batch_at", "build_model", "RunResult", "Comparison"]
