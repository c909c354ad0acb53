"""Rule verifier: every strategy of a rule, checked numerically against one device (this package's
other modules: the sweep, its samples, the backward-op check, core ATen coverage).

For each mesh and each n-d strategy the rule offers for a call, the inputs are laid out
as the strategy asks (Partial inputs as random parts that reduce to the value), the rule's
local call runs on every rank (threads backend), the outputs are collected with their
placements and compared with the single-device result.

Each strategy is checked on contiguous local tensors and on the strided views the program
slices (``Layout.local_view`` of a full-size tensor: ``narrow`` on every sharded dim, as the
backends hand inputs to the program). Some CPU kernels read
an input as contiguous without checking (``native_layer_norm_backward``'s mean and rstd); a
strategy is right only if both runs are. A failure on the strided run alone says so.

    shardwise verify-rules --op aten.mm.default
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import torch
import torch.utils._pytree as pytree

from ...core.layout import Layout, Partial, Replicate, Shard
from ...core.mesh import Mesh
from ...rules.registry import (DEFAULT, LocalCtx, OpCall, Registry, Strategy, expand, flatten_outputs, run_local,
                               with_blocks)
from ...run.collectives import using_generator
from ...run.threads import run_threads

DEFAULT_MESHES = ((2,), (3,), (2, 2))


@dataclass
class StrategyResult:
    mesh: tuple
    strategy: Strategy
    ok: bool
    max_err: float
    error: str = ""

    def __repr__(self) -> str:
        status = "ok" if self.ok else f"FAIL {self.error}"
        return f"mesh={self.mesh} {self.strategy}: max_err={self.max_err:.2e} {status}"


@dataclass
class RuleReport:
    op: object
    call: OpCall | None
    results: list = field(default_factory=list)
    error: str = ""
    dropped: list = field(default_factory=list)  # (mesh, strategy, why) the local-shape check dropped

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.results) and all(r.ok for r in self.results)

    @property
    def failures(self) -> list:
        return [r for r in self.results if not r.ok]

    def __repr__(self) -> str:
        head = f"verify {self.op}: {'ok' if self.ok else 'FAILED'}, {len(self.results)} strategies"
        lines = [head] + ([f"  error: {self.error}"] if self.error else [])
        lines += [f"  {r}" for r in self.results]
        return "\n".join(lines)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): exact for integers and bool, dtype-aware for floats."""
    if not dtype.is_floating_point and not dtype.is_complex:
        return 0.0, 0.0
    dtype = dtype.to_real()  # complex: its parts' dtype (real and imaginary parts compared apart)
    return {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}.get(dtype, (2e-2, 2e-2))


def _partial_parts(x: torch.Tensor, n: int, op: str, gen: torch.Generator) -> list[torch.Tensor]:
    """n tensors that reduce with ``op`` to ``x`` (exactly for max/min, up to rounding for sum)."""
    if op == "sum":
        if x.dtype == torch.bool:
            return [x.clone()] + [torch.zeros_like(x) for _ in range(n - 1)]
        if x.is_floating_point() or x.is_complex():
            # Parts on the value's own scale, so rounding per part stays within the dtype's tolerance
            # (complex: random real and imaginary parts).
            scale = float(x.detach().abs().double().mean().nan_to_num(1.0)) if x.numel() else 1.0
            parts = [(torch.randn(x.shape, generator=gen, dtype=x.dtype if x.is_complex() else None) * scale)
                     .to(x.dtype) for _ in range(n - 1)]
        else:
            parts = [torch.randint(-3, 4, x.shape, generator=gen).to(x.dtype) for _ in range(n - 1)]
        return [x - sum(parts, torch.zeros_like(x))] + parts if parts else [x.clone()]
    if x.dtype == torch.bool:
        return [x.clone() for _ in range(n)]
    delta = torch.rand(x.shape, generator=gen).to(x.dtype) + 1 if x.is_floating_point() else 1
    others = [x - delta if op == "max" else x + delta for _ in range(n - 1)]
    return [x.clone()] + others


def lay_out(x: torch.Tensor, mesh: Mesh, placements, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank locals of ``x`` for ``placements``; Partial as random parts (rank order)."""
    lay = Layout(x.shape, x.dtype, placements)
    out = [lay.local_view(x, mesh, rank).clone() for rank in range(mesh.size)]
    # Ranks that differ only along Replicate mesh dims must hold the same parts.
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            cache: dict = {}
            for g in mesh.groups(m):
                c = mesh.coord(g[0])
                key = tuple(c[k] for k, q in enumerate(placements) if k != m and not isinstance(q, Replicate))
                if key not in cache:
                    cache[key] = _partial_parts(out[g[0]], len(g), p.op, gen)
                for r, part in zip(g, cache[key]):
                    out[r] = part.clone()
    return out


def strided_like(local: torch.Tensor, lay, mesh: Mesh, rank: int) -> torch.Tensor:
    """``local`` (rank's contiguous chunk of ``lay``) as the strided view the program would hold:
    written into a full-size tensor at its place and taken back out with ``Layout.local_view``,
    the code the backends slice inputs with."""
    return lay.local_view(torch.zeros(lay.shape, dtype=local.dtype), mesh, rank).copy_(local)


def _strided_locals(tensors, placements, mesh: Mesh, per_input) -> list | None:
    """Per-input, per-rank strided views of ``per_input``, or None when every one of them
    would be contiguous anyway (nothing new to check)."""
    out, any_strided = [], False
    for t, p, locs in zip(tensors, placements, per_input, strict=True):
        lay = Layout(t.shape, t.dtype, p)
        views = [strided_like(x, lay, mesh, r) for r, x in enumerate(locs)]
        any_strided |= any(not v.is_contiguous() for v in views)
        out.append(views)
    return out if any_strided else None


def _compare(got: torch.Tensor, want: torch.Tensor, tol_dtype=None) -> tuple[bool, float, str]:
    if tuple(got.shape) != tuple(want.shape):
        return False, float("inf"), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return False, float("inf"), f"dtype {got.dtype} != {want.dtype}"
    if want.numel() == 0:
        return True, 0.0, ""
    rtol, atol = tolerance(tol_dtype or want.dtype)
    g, w = _as_real(got), _as_real(want)
    both_nan = torch.isnan(g) & torch.isnan(w)
    err = torch.where(both_nan, torch.zeros_like(g), (g - w).abs())
    err = torch.nan_to_num(err, nan=float("inf"))
    bound = atol + rtol * w.abs().nan_to_num(0.0)
    bad = err > bound
    same_inf = torch.isinf(g) & torch.isinf(w) & (g == w)
    bad &= ~same_inf
    m = float(torch.where(same_inf, torch.zeros_like(err), err).max())
    return (not bool(bad.any())), m, "" if not bad.any() else f"max abs err {m:.3e} over tolerance"


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """float64 values to compare: a complex tensor as its (real, imaginary) pairs, so both parts
    count (``double()`` would keep the real part alone)."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj().resolve_neg()).double()
    return t.double()


def _least_precise(dtypes) -> torch.dtype:
    """The float dtype with the loosest tolerance (inputs rounded in parts bound the output's accuracy)."""
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=lambda d: tolerance(d)) if floats else dtypes[0]


def check_strategy(call, rule, st: Strategy, mesh: Mesh, tensors, want_outs, seed=0) -> StrategyResult:
    """One strategy on contiguous locals and on the program's strided views, in one threads run
    (starting rank threads is most of a check's time). A crash is retried on contiguous locals
    alone, to say whether only the strided views cause it."""
    gen = torch.Generator().manual_seed(seed)
    per_input = [lay_out(t, mesh, p, gen) for t, p in zip(tensors, st.ins, strict=True)]
    strided = _strided_locals(tensors, st.ins, mesh, per_input)
    runs = [per_input] + ([strided] if strided is not None else [])
    try:
        per_run = _run_locals(call, rule, st, mesh, runs, seed)
    except Exception as e:  # noqa: BLE001 - a failing strategy is a result, not a crash
        err = f"{type(e).__name__}: {e}"[:300]
        if len(runs) == 1:
            return StrategyResult(mesh.shape, st, False, float("inf"), err)
        alone = check_strategy_on(call, rule, st, mesh, tensors, want_outs, per_input, seed)
        return alone if not alone.ok else StrategyResult(mesh.shape, st, False, float("inf"), f"{STRIDED}: {err}")
    results = [_judge(call, st, mesh, tensors, want_outs, per_rank) for per_rank in per_run]
    if not results[0].ok:
        return results[0]
    if len(results) > 1 and not results[1].ok:
        return StrategyResult(mesh.shape, st, False, results[1].max_err, f"{STRIDED}: {results[1].error}")
    return StrategyResult(mesh.shape, st, True, max(r.max_err for r in results))


STRIDED = "on strided local inputs only (contiguous ones pass)"


def check_strategy_on(call, rule, st: Strategy, mesh: Mesh, tensors, want_outs, per_input, seed) -> StrategyResult:
    """The strategy on the given locals only (per input, per rank)."""
    try:
        per_rank = _run_locals(call, rule, st, mesh, [per_input], seed)[0]
    except Exception as e:  # noqa: BLE001
        return StrategyResult(mesh.shape, st, False, float("inf"), f"{type(e).__name__}: {e}"[:300])
    return _judge(call, st, mesh, tensors, want_outs, per_rank)


def _run_locals(call, rule, st: Strategy, mesh: Mesh, runs, seed) -> list:
    """The rule's local call on every rank, once per set of locals in ``runs``: [run][rank] -> outputs."""
    def body(rank):
        ctx = LocalCtx(call, st, mesh, rank)
        lc = rule.local_call(ctx)
        got = []
        for per_input in runs:
            # Random ops: every rank draws from the state the single-device call started from.
            with using_generator(torch.Generator().manual_seed(seed)):
                out = flatten_outputs(run_local(lc, [locs[rank] for locs in per_input]))
            for i, (o, t) in enumerate(zip(out, call.outs)):
                if t is not None and list(o.shape) != ctx.local_out_shape(i):
                    raise AssertionError(f"output {i}: local shape {list(o.shape)} != planned {ctx.local_out_shape(i)}")
            got.append(out)
        return got

    per_rank = run_threads(body, mesh, timeout=30)
    return [[outs[k] for outs in per_rank] for k in range(len(runs))]


def _judge(call, st: Strategy, mesh: Mesh, tensors, want_outs, per_rank) -> StrategyResult:
    """Collect each output with its placements and compare with the single-device result."""
    from ...run.shards import collect

    worst, ok, msg = 0.0, True, ""
    for i, want in enumerate(want_outs):
        if call.outs[i] is None:
            continue
        got = collect([outs[i] for outs in per_rank], mesh, st.outs[i])
        o, err, m = _compare(got, want, _least_precise([want.dtype] + [t.dtype for t in tensors]))
        worst, ok, msg = max(worst, err), ok and o, msg or (f"output {i}: {m}" if m else "")
    return StrategyResult(mesh.shape, st, ok, worst, msg)


# (unit, groups): unit shards (blocks of 2 or 3) and shards in 2 or 3 groups
BLOCKS = ((2, 1), (3, 1), (1, 2), (1, 3))


# on two mesh dims at once: units on one (a flattened batch), groups on the other (a fused projection)
BLOCK_PAIRS = (((2, 1), (1, 2)), ((1, 2), (2, 1)))


def unit_variants(call, rule, mesh: Mesh, expanded: list) -> list:
    """The rule's strategies (``expanded``) restated with unit and grouped shards, as the planner does
    for inputs that arrive as such shards (on one mesh dim, or on two: ``BLOCK_PAIRS``): those
    variants must be right too."""
    cuts = [((m, block),) for m in range(mesh.ndim) for block in BLOCKS]
    cuts += [((m, a), (n, b)) for m, n in combinations(range(mesh.ndim), 2) for a, b in BLOCK_PAIRS]
    out = []
    for st in expanded:
        for cut in cuts:
            v = with_blocks(call, rule, st, cut, mesh)
            if v is not None and v not in out:
                out.append(v)
    return out


def expand_noting(call, rule, mesh: Mesh, report: RuleReport) -> list:
    """``expand``, noting in ``report`` the strategies its local-shape check drops (and why)."""
    dropped: list = []
    out = expand(call, rule, mesh, dropped)
    report.dropped += [(mesh.shape, st, why) for st, why in dropped]
    return out


def verify_rule(op: Any, *args: Any, registry: Registry | None = None, meshes: tuple = DEFAULT_MESHES, seed: int = 0,
                **kwargs: Any) -> RuleReport:
    """Check every strategy of ``op``'s rule on ``meshes`` for this call. Returns a RuleReport."""
    from ...rules import load_all

    load_all()
    registry = registry or DEFAULT
    torch.manual_seed(seed)
    want = op(*args, **kwargs)
    want_outs = flatten_outputs(want)
    call = OpCall.from_values(op, args, kwargs, want)
    report = RuleReport(op, call)
    tensors = [x for x in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(x, torch.Tensor)]
    try:
        rule = registry.get(op)
        for shape in meshes:
            mesh = Mesh(shape)
            sts = expand_noting(call, rule, mesh, report)
            for st in sts + unit_variants(call, rule, mesh, sts):
                report.results.append(check_strategy(call, rule, st, mesh, tensors, want_outs, seed))
    except Exception as e:  # noqa: BLE001
        report.error = f"{type(e).__name__}: {e}"
    return report


__all__ = ["verify_rule", "RuleReport", "StrategyResult", "Replicate", "Shard", "STRIDED"]
