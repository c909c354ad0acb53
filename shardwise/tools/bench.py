"""shardwise against torch's own distributed training, side by side in the same processes.

    python bench/bench_vs_dtensor.py [--nproc 2] [--steps 10]     # or: shardwise bench

One ``spawn`` of ``nproc`` gloo processes runs every configuration; in each, every rank
times a training step (forward + backward, no optimizer) of the peer and of shardwise on
the same model (same initial weights, same data), the two interleaved step by step so
machine noise hits both alike:

- ``mlp_tp`` / ``block_tp``: Megatron tensor parallelism of an MLP (Linear-GELU-Linear) and
  of a pre-LN transformer block (causal attention + GELU MLP); the peer is DTensor
  (``parallelize_module`` with ColwiseParallel / RowwiseParallel), its collectives counted
  by ``CommDebugMode`` over one step.
- ``mlp_dp``: data parallelism (batch sharded); the peer is ``DistributedDataParallel``
  (DTensor has no DDP), its collectives are its gradient buckets (one all_reduce each).
  shardwise is handed the full batch (``inputs="global"``).
- ``mlp_dp_local``: the same, with each rank handed its own rows as DDP is
  (``inputs="local"``: one small all-gather a step tells the ranks their pieces still make the
  planned batch).

Time per step is the median over ``steps`` after ``warmup``, with a barrier before and after
each timed step (so it covers the slowest rank), then the max over ranks. shardwise's
collectives, bytes sent per rank and estimated peak memory per rank come from
``pm.plan.stats()``. Both runs' losses (and gradients) are checked against the
single-device run (rtol 1e-4); a mismatch is reported in the table and by ``ok(rows)``.
``main`` then runs the one-device attention benchmark (shardwise/ops/attention/benchmark.py:
shardwise.attention vs aten SDPA, time and peak memory) and prints planning times of GPT-2
small's shapes at 2 to 24 layers (shardwise/tools/timing.py; minutes).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.units import fmt_bytes
from ..core.errors import ConfigError

RTOL, ATOL = 1e-4, 1e-5
DEFAULT_SIZES = {
    "mlp": {"d_model": 256, "hidden": 1024, "batch": 32},
    "block": {"d_model": 256, "heads": 8, "seq": 64, "batch": 4},
}
CONFIGS = ("mlp_tp", "mlp_dp", "mlp_dp_local", "block_tp")


class BenchConfigError(ConfigError):
    """Benchmark arguments that cannot run (checked before any process starts)."""


# -- models ------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN causal self-attention + GELU MLP with residuals. q, k, v are separate Linears and
    heads are counted from the local width (``view(b, t, -1, head_dim)``), so the same forward
    runs on one device, under DTensor's local outputs and under shardwise's global trace."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def mse(out, y):
    return F.mse_loss(out, y)


# Megatron layouts: nn.Linear weight is [out, in]; column-parallel = Shard(0) of weight and bias,
# row-parallel = Shard(1) of the weight (its bias stays replicated).
TP_PLANS = {
    "mlp": {"fc1": "col", "fc2": "row"},
    "block": {"q": "col", "k": "col", "v": "col", "proj": "row", "up": "col", "down": "row"},
}


def _build(kind: str, size: dict):
    """Model, input and target, identical on every rank (seeded generator)."""
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "mlp":
            model = MLP(size["d_model"], size["hidden"])
            shape = (size["batch"], size["d_model"])
        else:
            model = Block(size["d_model"], size["heads"])
            shape = (size["batch"], size["seq"], size["d_model"])
    return model, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- measuring ---------------------------------------------------------------------------------
def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _interleaved(peer, mine, steps: int, warmup: int) -> tuple[list, list]:
    """Per-step times of both, alternating which goes first."""
    peer_times, sw_times = [], []
    for i in range(warmup + steps):
        order = ((peer, peer_times), (mine, sw_times)) if i % 2 == 0 else ((mine, sw_times), (peer, peer_times))
        for fn, out in order:
            dt = _timed(fn)
            if i >= warmup:
                out.append(dt)
    return peer_times, sw_times


def _close(a, b) -> bool:
    return a is not None and b is not None and torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL)


def _single_device(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = mse(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _op_name(op) -> str:
    name = str(op).split(".")[-1]
    for suffix in ("_into_tensor", "_tensor", "_single"):
        name = name.removesuffix(suffix)
    return name


def _shardwise(model, x, y, mesh_names, **kwargs):
    import shardwise as sw

    mesh = sw.Mesh((_world(),), mesh_names)
    return sw.parallelize(model, mesh, (x,), loss_fn=mse, backend="torch", example_targets=(y,), **kwargs)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _steps(peer_model, peer_x, peer_y, pm, x, y):
    """One training step of the peer (on its inputs) and one of shardwise (``pm`` on the global
    ones), as functions; each puts its loss in the dict returned with them."""
    losses = {}

    def peer():
        peer_model.zero_grad(set_to_none=True)
        loss = mse(peer_model(peer_x), peer_y)
        loss.backward()
        losses["peer"] = loss.detach()

    def mine():
        pm.zero_grad(set_to_none=True)  # pm.step adds into .grad like backward(), as the peers' do
        losses["shardwise"] = pm.step(x, y)

    return peer, mine, losses


def _tp_case(kind: str, size: dict, steps: int, warmup: int) -> dict:
    import shardwise as sw
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, x, y = _build(kind, size)
    ref, sw_model = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss, ref_grads = _single_device(ref, x, y)

    plan = TP_PLANS[kind]
    dmesh = init_device_mesh("cpu", (_world(),))
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    dt = parallelize_module(model, dmesh, {m: styles[s]() for m, s in plan.items()})

    specs = {}
    for m, s in plan.items():
        specs[f"{m}.weight"] = [sw.Shard(0 if s == "col" else 1)]
        if s == "col":
            specs[f"{m}.bias"] = [sw.Shard(0)]
    pm = _shardwise(sw_model, x, y, ("tp",), param_placements=specs)
    peer, mine, losses = _steps(dt, x, y, pm, x, y)
    with warnings.catch_warnings(), CommDebugMode() as comm:
        # CommDebugMode's global backward pre-hook warns when no module input requires grad
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        peer()
    peer_comm = Counter()
    for op, n in comm.get_comm_counts().items():
        peer_comm[_op_name(op)] += n
    times = _interleaved(peer, mine, steps, warmup)

    peer_grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in dt.named_parameters()}
    return _row(f"{kind}_tp", "DTensor TP", *times, dict(peer_comm), pm, ref_loss, losses,
                _grads_ok(ref_grads, peer_grads), _grads_ok(ref_grads, pm.gradients()))


def _dp_case(kind: str, size: dict, steps: int, warmup: int, local: bool = False) -> dict:
    import shardwise as sw
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x, y = _build(kind, size)
    world, rank = _world(), dist.get_rank()
    ref, sw_model = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss, ref_grads = _single_device(ref, x, y)

    ddp = DDP(model)
    xl, yl = x.chunk(world)[rank], y.chunk(world)[rank]
    sx, sy = (xl, yl) if local else (x, y)  # local: each rank its own rows, as DDP is handed them
    pm = _shardwise(sw_model, sx, sy, ("dp",), inputs="local" if local else "global",
                    input_placements={0: [sw.Shard(0)]}, target_placements={0: [sw.Shard(0)]})
    peer, mine, losses = _steps(ddp, xl, yl, pm, sx, sy)
    times = _interleaved(peer, mine, steps, warmup)
    peer_loss = losses["peer"].clone()
    dist.all_reduce(peer_loss)  # the global mean: DDP's per-rank losses are means over equal shards
    losses["peer"] = peer_loss / world
    buckets = ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") or ddp._get_ddp_logging_data()["bucket_sizes"]
    peer_comm = {"all_reduce": len(str(buckets).split())}
    peer_grads = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
    return _row(f"{kind}_dp_local" if local else f"{kind}_dp", "DDP", *times, peer_comm, pm, ref_loss, losses,
                _grads_ok(ref_grads, peer_grads), _grads_ok(ref_grads, pm.gradients()))


def _grads_ok(want: dict, got: dict) -> bool:
    return set(want) <= set(got) and all(_close(got[n], g) for n, g in want.items())


def _row(config, peer_name, peer_times, sw_times, peer_comm, pm, ref_loss, losses, peer_grads_ok, sw_grads_ok) -> dict:
    st = pm.plan.stats()
    peer_s, sw_s = statistics.median(peer_times), statistics.median(sw_times)
    return {
        "config": config, "peer": peer_name,
        "peer_s": peer_s, "shardwise_s": sw_s, "ratio": sw_s / peer_s,
        "peer_collectives": dict(peer_comm), "shardwise_collectives": dict(st["collectives"]),
        "comm_bytes": st["comm_bytes"], "peak_memory_bytes": st["peak_memory_bytes"],
        "loss_ref": float(ref_loss), "loss_peer": float(losses["peer"]), "loss_shardwise": float(losses["shardwise"]),
        "loss_match": _close(losses["peer"], ref_loss) and _close(losses["shardwise"], ref_loss),
        "grads_match": peer_grads_ok and sw_grads_ok,
        "mismatches": [what for what, good in (
            ("peer loss", _close(losses["peer"], ref_loss)), ("shardwise loss", _close(losses["shardwise"], ref_loss)),
            ("peer gradients", peer_grads_ok), ("shardwise gradients", sw_grads_ok)) if not good],
    }


def _rank_body(rank: int, configs, sizes, steps: int, warmup: int) -> list:
    rows = []
    for config in configs:
        kind, mode = config.split("_", 1)
        if mode == "tp":
            rows.append(_tp_case(kind, sizes[kind], steps, warmup))
        else:
            rows.append(_dp_case(kind, sizes[kind], steps, warmup, local=mode == "dp_local"))
    return rows


def _merge(per_rank: list) -> list:
    """One row per config: times are the max over ranks; a match must hold on every rank."""
    rows = []
    for same in zip(*per_rank):
        row = dict(same[0])
        row.update({k: max(r[k] for r in same) for k in ("peer_s", "shardwise_s", "comm_bytes", "peak_memory_bytes")})
        row.update({k: all(r[k] for r in same) for k in ("loss_match", "grads_match")})
        row["ratio"] = row["shardwise_s"] / row["peer_s"]
        row["mismatches"] = sorted({m for r in same for m in r["mismatches"]})
        rows.append(row)
    return rows


def _check_sizes(nproc: int, configs, sizes: dict) -> None:
    """Even shards only: DDP averages per-rank mean losses (uneven batches weigh samples unequally)
    and the block's per-rank heads come from its local width."""
    bad = []
    for config in configs:
        kind, mode = config.split("_", 1)
        key = "batch" if mode.startswith("dp") else "hidden" if kind == "mlp" else "heads"  # what the ranks split
        if sizes[kind][key] % nproc:
            bad.append(f"{config}: {key}={sizes[kind][key]}")
    if bad:
        raise BenchConfigError(f"benchmark sizes must divide evenly by nproc={nproc}: {', '.join(bad)}",
                               fix="pick an nproc that divides the sizes (e.g. 2 or 4)")


def run_benchmark(nproc: int = 2, steps: int = 10, warmup: int = 3, sizes: dict | None = None,
                  configs=CONFIGS, timeout: float = 300.0) -> list[dict]:
    """Run every config in one spawn of ``nproc`` gloo processes; one dict per config.

    ``sizes`` overrides ``DEFAULT_SIZES`` per model kind ("mlp", "block"), key by key."""
    from ..run.launch import spawn

    merged = {k: dict(v) for k, v in DEFAULT_SIZES.items()}
    for kind, over in (sizes or {}).items():
        merged.setdefault(kind, {}).update(over)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise BenchConfigError(f"unknown benchmark configs {unknown}", fix=f"choose from {list(CONFIGS)}")
    if steps < 1 or warmup < 0:
        raise BenchConfigError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}",
                               fix="e.g. --steps 10 --warmup 2")
    _check_sizes(nproc, configs, merged)
    per_rank = spawn(_rank_body, nproc, tuple(configs), merged, steps, warmup, timeout=timeout)
    rows = _merge(per_rank)
    for row in rows:
        row.update(nproc=nproc, steps=steps, warmup=warmup, size=merged[row["config"].split("_")[0]])
    return rows


def ok(rows) -> bool:
    """Every run matched the single-device loss and gradients, and every time is finite."""
    return all(r["loss_match"] and r["grads_match"] and math.isfinite(r["ratio"]) for r in rows)


# -- report ------------------------------------------------------------------------------------
def _fmt_comm(c: dict) -> str:
    return ", ".join(f"{n}x {k}" for k, n in sorted(c.items())) or "none"


def format_report(rows) -> str:
    """A table: times per step, the ratio shardwise / peer, collectives, bytes, memory, checks."""
    head = ("config", "peer", "peer ms/step", "sw ms/step", "sw/peer", "peer collectives",
            "sw collectives", "sw comm/rank", "sw peak mem/rank", "loss match")
    body = []
    for r in rows:
        match = "yes" if r["loss_match"] and r["grads_match"] else (
            "LOSS MISMATCH" if not r["loss_match"] else "GRAD MISMATCH")
        body.append((r["config"], r["peer"], f"{r['peer_s'] * 1e3:.2f}", f"{r['shardwise_s'] * 1e3:.2f}",
                     f"{r['ratio']:.2f}x", _fmt_comm(r["peer_collectives"]), _fmt_comm(r["shardwise_collectives"]),
                     fmt_bytes(int(r["comm_bytes"])), fmt_bytes(int(r["peak_memory_bytes"])), match))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths]), *map(line, body)]
    if rows:
        r = rows[0]
        out.append(f"nproc={r['nproc']} (gloo, CPU), median of {r['steps']} steps after {r['warmup']} warmup, "
                   "max over ranks; ratio < 1 means shardwise is faster")
        out.append("sizes: " + "; ".join(f"{r['config']}: {r['size']}" for r in rows))
        out.append("losses (single device / peer / shardwise): " + "; ".join(
            f"{r['config']}: {r['loss_ref']:.6g} / {r['loss_peer']:.6g} / {r['loss_shardwise']:.6g}" for r in rows))
    for r in rows:
        if not (r["loss_match"] and r["grads_match"]):
            out.append(f"!!! MISMATCH in {r['config']} against the single-device run (rtol {RTOL}, atol {ATOL}): "
                       f"{', '.join(r.get('mismatches') or ['?'])} !!!")
    return "\n".join(out)


def main(nproc: int = 2, steps: int = 10, warmup: int = 3) -> int:
    """Run, print the report; 0 when every run matched one device, 1 otherwise (the CLI's exit code)."""
    print(f"shardwise vs torch (DTensor / DDP): {nproc} gloo processes, {steps} steps after {warmup} warmup ...",
          flush=True)
    try:
        rows = run_benchmark(nproc=nproc, steps=steps, warmup=warmup)
    except BenchConfigError as e:  # sizes vs nproc, steps: a usage error, not a crash
        print(f"shardwise bench: {e}")
        return 2
    print(format_report(rows))
    from ..ops.attention.benchmark import main as attention_main  # one device: attention vs aten SDPA

    attention_rc = attention_main()
    from .timing import main as planning_main  # planning time against depth (GPT-2 small's shapes)

    planning_main()
    return 0 if ok(rows) and attention_rc == 0 else 1
