"""Rule sweep: every registered op, on sampled calls, every strategy on meshes (2,), (3,), (2, 2).

    shardwise verify-rules                        # fast: at most 2 samples per op
    shardwise verify-rules --full                 # every harvested sample (the full sweep)
    shardwise verify-rules --op softmax           # ops whose name contains 'softmax'
    shardwise verify-rules --op aten.mm --list-strategies

Samples come from ``verify.samples`` (training snippets with uneven sizes, torch's OpInfo
samples, a hand table). Each sample is checked by ``verify.verify_rule``: inputs laid out as
every strategy asks, the rule's local call run per rank on the threads backend, outputs
collected and compared with the single-device result: dtype-aware tolerance (a float32
strategy over it is rechecked in float64, where rounding vanishes and a wrong rule does
not), exact for integers and bools, and exact for views and other data movement (the view
family) unless a Partial('sum') input had to be split into parts. Prints a coverage table,
one row per op, and every failure in detail (op, sample, mesh, strategy, error).

Two kinds of op cannot be compared by value, and are checked by shape instead ("shape-only"):
every strategy is expanded and each rank's local call, run on meta tensors with the rank's
local input shapes, must produce the planned local output shapes and dtypes:
  * uninitialised outputs (empty, empty_like, empty_strided, new_empty, new_empty_strided):
    their values are whatever memory held, on one device and on each rank alike;
  * ops with no CPU kernel in this torch and no decomposition (the efficient SDPA ops).
An op with no CPU kernel but a torch decomposition (``_fused_rms_norm_backward``) is checked
by value, with the decomposition registered as its CPU kernel for the length of the check.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from ...core.layout import Partial
from ...core.mesh import Mesh
from ...rules.registry import OpCall, Registry, local_shape_refusal
from . import DEFAULT_MESHES, STRIDED, RuleReport, StrategyResult, expand_noting, verify_rule
from .samples import Sample, collect_samples

aten = torch.ops.aten
FAST_CAP, FULL_PER_INFO, FAST_PER_INFO = 2, 24, 8
UNINITIALISED = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                           aten.new_empty.default, aten.new_empty_strided.default})


@dataclass
class Failure:
    op: object
    sample: str
    mesh: tuple | None
    strategy: object
    error: str

    def __str__(self) -> str:
        where = f"mesh={self.mesh} {self.strategy}" if self.mesh is not None else "(whole sample)"
        return f"{self.op}  {self.sample}\n    {where}\n    {self.error}"


@dataclass
class OpStats:
    """One row of the coverage table."""

    op: object
    samples: int = 0
    strategies: int = 0
    failures: list = field(default_factory=list)
    max_err: float = 0.0
    note: str = ""
    reports: list = field(default_factory=list)  # (Sample, RuleReport) per sample checked


@dataclass
class SweepReport:
    rows: dict
    seconds: float = 0.0
    mode: str = "fast"

    @property
    def failures(self) -> list:
        return [f for r in self.rows.values() for f in r.failures]

    @property
    def unsampled(self) -> list:
        return [op for op, r in self.rows.items() if r.samples == 0]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.unsampled

    def totals(self) -> str:
        rows = self.rows.values()
        shape_only = sum(r.note.startswith("shape-only") for r in rows)
        return (f"TOTAL ({self.mode}): {len(self.rows)} ops, {sum(r.samples for r in rows)} samples, "
                f"{sum(r.strategies for r in rows)} strategies verified, {len(self.failures)} failures, "
                f"{len(self.unsampled)} ops without a sample, {shape_only} shape-only, {self.seconds:.1f}s")

    def table(self) -> str:
        head = ("op", "samples", "strategies", "failures", "max err", "note")
        lines = [head]
        for op in sorted(self.rows, key=str):
            r = self.rows[op]
            err = "-" if r.samples == 0 or r.note.startswith("shape-only") else f"{r.max_err:.1e}"
            lines.append((str(op), str(r.samples), str(r.strategies), str(len(r.failures)), err, r.note))
        w = [max(len(line[i]) for line in lines) for i in range(5)]
        fmt = lambda line: "  ".join(  # noqa: E731
            [line[0].ljust(w[0])] + [c.rjust(w[i + 1]) for i, c in enumerate(line[1:5])] + [line[5]]).rstrip()
        out = [fmt(lines[0]), "-" * (sum(w) + 8 + 4)] + [fmt(line) for line in lines[1:]]
        return "\n".join(out + [self.totals()])

    @property
    def strided_only(self) -> list:
        """Ops whose kernels are right on contiguous locals but wrong on the strided views the
        program slices (each needs its rule to hand the kernel contiguous tensors)."""
        return sorted({f.op for f in self.failures if f.error.startswith(STRIDED)}, key=str)

    def failure_text(self) -> str:
        parts = [f"FAIL {f}" for f in self.failures]
        parts += [f"NO SAMPLE {op}: add one to tools/verify/samples.py's table" for op in sorted(self.unsampled, key=str)]
        if self.strided_only:
            parts.append("WRONG ON STRIDED LOCAL INPUTS ONLY: " + ", ".join(map(str, self.strided_only)))
        return "\n".join(parts)

    def dropped_text(self) -> str:
        """The strategies local-shape checks dropped (the planner never sees them), per op and mesh:
        a rule whose local args raise for a strategy it offers shows up here, not as fewer strategies."""
        once = {(op, m, st): why for op in sorted(self.rows, key=str) for _, rep in self.rows[op].reports
                for m, st, why in rep.dropped}  # each (op, mesh, strategy) once over the samples
        return "\n".join(f"DROPPED {op} mesh={m}: {why[:240]}\n    {st}" for (op, m, st), why in once.items())

    def strategy_text(self) -> str:
        """Every strategy tried, per op, sample and mesh."""
        out = []
        for op in sorted(self.rows, key=str):
            out.append(f"{op}")
            for sample, rep in self.rows[op].reports:
                out.append(f"  sample {sample.describe()}")
                if rep.error:
                    out.append(f"    error: {rep.error}")
                for mesh in dict.fromkeys(r.mesh for r in rep.results):
                    res = [r for r in rep.results if r.mesh == mesh]
                    out.append(f"    mesh {mesh}: {len(res)} strategies")
                    out += [f"      {r.strategy}: {'ok' if r.ok else 'FAIL ' + r.error}"
                            + ("" if math.isinf(r.max_err) else f" (max err {r.max_err:.1e})") for r in res]
        return "\n".join(out)


# -- checking one sample --------------------------------------------------------------------
def _has_cpu_kernel(op) -> bool:
    name = getattr(op, "name", lambda: None)()
    return name is None or torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU")


def _decomposition(op):
    from torch._decomp import decomposition_table

    return None if _has_cpu_kernel(op) else decomposition_table.get(op)


@contextlib.contextmanager
def decomposition_as_cpu_kernel(op):
    """For an op without a CPU kernel: torch's decomposition stands in as its CPU kernel while
    the block runs (every rank thread sees it), and is removed afterwards."""
    lib = torch.library.Library(op.namespace, "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl(op, _decomposition(op), "CPU")
        yield
    finally:
        lib._destroy()


def how_checked(op, sample: Sample) -> str:
    """'value', 'value vs decomposition (...)' or 'shape-only (...)': how a sample of ``op`` is checked."""
    if op in UNINITIALISED:
        return "shape-only (uninitialised values)"
    if any(t.device.type == "meta" for t in sample.tensors()) or not _has_cpu_kernel(op):
        return "value vs decomposition (no CPU kernel)" if _decomposition(op) else "shape-only (no CPU kernel)"
    return "value"


def shape_only_report(op, args, kwargs, registry: Registry, meshes) -> RuleReport:
    """Like verify_rule, for ops whose values cannot be compared: every expanded strategy's
    local shapes (and dtypes) instead."""
    want = op(*args, **kwargs)
    call = OpCall.from_values(op, args, kwargs, want)
    report = RuleReport(op, call)
    try:
        rule = registry.get(op)
        for shape in meshes:
            mesh = Mesh(shape)
            for st in expand_noting(call, rule, mesh, report):
                err = local_shape_refusal(call, rule, st, mesh) or ""
                report.results.append(StrategyResult(mesh.shape, st, not err, 0.0 if not err else math.inf, err))
    except Exception as e:  # noqa: BLE001
        report.error = f"{type(e).__name__}: {e}"
    return report


ROUNDING = "float32 rounding: exact in float64"
_LOW = (torch.float32, torch.float16, torch.bfloat16, torch.complex64)


def _verify(op, args, kwargs, how: str, registry, meshes, seed) -> RuleReport:
    guard = decomposition_as_cpu_kernel(op) if how.startswith("value vs") else contextlib.nullcontext()
    with guard:
        return verify_rule(op, *args, registry=registry, meshes=meshes, seed=seed, **kwargs)


def recheck_in_float64(op, sample: Sample, report: RuleReport, how: str, registry, meshes, seed) -> RuleReport:
    """A strategy over the float32 tolerance that passes in float64 lost to rounding (a sum
    that cancels, Partial parts on the scale of the summands), not to its rule: a wrong rule
    is wrong in every dtype. Such results become ok, with ROUNDING as their note."""
    over = [r for r in report.results if not r.ok and r.error.endswith("over tolerance")]
    if not over or not any(t.dtype in _LOW for t in sample.tensors()):
        return report
    to64 = lambda x: (x.to(torch.complex128 if x.is_complex() else torch.float64)  # noqa: E731
                      if isinstance(x, torch.Tensor) and x.dtype in _LOW else x)
    args, kwargs = pytree.tree_map(to64, sample.fresh())
    try:
        ok64 = {(r.mesh, r.strategy) for r in _verify(op, args, kwargs, how, registry, meshes, seed).results if r.ok}
    except Exception:  # noqa: BLE001 - no float64 kernel: keep the float32 verdict
        return report
    report.results = [StrategyResult(r.mesh, r.strategy, True, r.max_err, ROUNDING)
                      if r in over and (r.mesh, r.strategy) in ok64 else r for r in report.results]
    return report


def exact_ops() -> frozenset:
    """Data-movement ops (the view family): their results must match bit for bit."""
    from ...rules import view

    return frozenset(op for row in view.ROWS for op in row.ops)


def require_exact(report: RuleReport) -> RuleReport:
    """A view moves values without arithmetic: any error is a wrong element, unless a
    Partial('sum') input was split into parts that are summed again (rounding)."""
    def sums(st):
        return any(p == Partial("sum") for ps in st.ins for p in ps)

    report.results = [StrategyResult(r.mesh, r.strategy, False, r.max_err, f"not exact (max err {r.max_err:.1e})")
                      if r.ok and r.max_err > 0 and not sums(r.strategy) else r for r in report.results]
    return report


def check_sample(op, sample: Sample, registry: Registry, meshes=DEFAULT_MESHES, seed: int = 0) -> RuleReport:
    """verify_rule for one sample (or its shape-only check); a crash is a report with an error."""
    args, kwargs = sample.fresh()
    how = how_checked(op, sample)
    try:
        if how.startswith("shape-only"):
            return shape_only_report(op, args, kwargs, registry, meshes)
        report = _verify(op, args, kwargs, how, registry, meshes, seed)
        if op in exact_ops():
            return require_exact(report)
        return recheck_in_float64(op, sample, report, how, registry, meshes, seed)
    except Exception as e:  # noqa: BLE001 - the single-device call itself failed
        return RuleReport(op, None, error=f"{type(e).__name__}: {e}"[:300])


# -- the sweep ------------------------------------------------------------------------------
def check_op(op, samples, registry: Registry, meshes=DEFAULT_MESHES, seed: int = 0) -> OpStats:
    row = OpStats(op, note="no sample" if not samples else "")
    notes, rounding = set(), 0
    for s in samples:
        rep = check_sample(op, s, registry, meshes, seed)
        row.samples += 1
        row.reports.append((s, rep))
        notes.add(how_checked(op, s))
        row.strategies += sum(r.ok for r in rep.results)
        rounding += sum(r.error == ROUNDING for r in rep.results)
        if rep.error or not rep.results:
            row.failures.append(Failure(op, s.describe(), None, None, rep.error or "no strategy at all"))
        for r in rep.results:
            if not r.ok:
                row.failures.append(Failure(op, s.describe(), r.mesh, r.strategy, r.error))
            elif math.isfinite(r.max_err):
                row.max_err = max(row.max_err, r.max_err)
    notes.discard("value")
    if rounding:
        notes.add(f"{rounding} passed in float64 only (float32 rounding)")
    row.note = row.note or "; ".join(sorted(notes))
    return row


def sweep(registry: Registry | None = None, ops=None, op_filter: str | None = None, full: bool = False,
          meshes=DEFAULT_MESHES, seed: int = 0, samples: dict | None = None, progress=None) -> SweepReport:
    """Check every op of ``registry`` (default: all built-in rules) whose name contains
    ``op_filter``. Fast mode checks at most FAST_CAP samples per op; ``full`` all of them.
    ``progress(op, strategies checked so far)`` is called before each op."""
    from ...rules import DEFAULT, load_all

    registry = registry or load_all(DEFAULT)
    every = sorted(ops if ops is not None else registry.ops(), key=str)
    ops = [op for op in every if not op_filter or op_filter in str(op)]
    t0 = time.perf_counter()
    if samples is None and ops:
        # harvested for every op, filtered or not, so --op reruns exactly the samples of a full run
        samples = collect_samples(every, cap=None if full else FAST_CAP,
                                  per_info=FULL_PER_INFO if full else FAST_PER_INFO)
    samples = samples or {}
    rows = {}
    checked = 0
    for op in ops:
        if progress:
            progress(op, checked)
        rows[op] = check_op(op, samples.get(op, []), registry, meshes, seed)
        checked += rows[op].strategies
    return SweepReport(rows, time.perf_counter() - t0, "full" if full else "fast")


def run_cli(op: str | None = None, full: bool = False, list_strategies: bool = False, out=None) -> int:
    """``shardwise verify-rules``: prints the coverage table (and failures); 1 on any failure."""
    from ..progress import sweep_progress  # a progress bar on stderr; torch's known warnings dropped

    out = out or sys.stdout
    with sweep_progress(op) as progress:
        report = sweep(op_filter=op, full=full, progress=progress)
    if not report.rows:
        print(f"no registered op matches {op!r}", file=out)
        return 2
    if list_strategies:
        print(report.strategy_text(), file=out)
    print(report.table(), file=out)
    if report.dropped_text():
        print("\nstrategies dropped by local-shape checks:\n" + report.dropped_text(), file=out)
    if not report.ok:
        print("\n" + report.failure_text(), file=out)
    return 0 if report.ok else 1


__all__ = ["sweep", "run_cli", "check_op", "check_sample", "SweepReport", "OpStats", "Failure", "UNINITIALISED"]
