"""PyTorch's OpInfo database through shardwise, against one device (``shardwise verify-rules --opinfo``).

For every OpInfo of ``op_db`` with float32 samples on CPU, up to N samples each: a small module
calls the op on the sample (``OpModule``), ``sw.parallelize`` runs it on a 2-rank mesh (threads
backend) with the primary input sharded (a) on dim 0, (b) on the last dim, (c) on a dim whose size
does not divide by 2 (when the sample has one; cases with the same dim are run once), and its
loss and every gradient are compared with the same module's eager step on one device, under the
same seed. Each case is one of:

  exact        loss and gradients equal one device's (within TOLERANCE; see ``compare``)
  wrong        a number differs: a bug
  unsupported  UnsupportedOpError: an aten op without a rule (the ops are kept)
  refused      another typed shardwise error (ShardingError, TraceError: they name the op)
  crash        any other exception: a bug

and an unsupported case is run again with ``replicate_fallback=`` naming its ops, classified the
same way (a wrong number or a crash there is a bug too). ``opinfo_dtensor`` counts, in a
subprocess, the same cases DTensor can shard.
"""
from __future__ import annotations

import copy
import itertools
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .samples import _usable

KINDS = ("exact", "wrong", "unsupported", "refused", "crash")
SEED = 1234
# float32: the sharded step sums in another order than one device (partial sums, gathered pieces);
# a difference of ~1e-6 relative to the summed magnitudes is rounding, 1e-4 leaves room for a few
# thousand terms. A case over it in float32 is run again in float64 (ROUNDING_CHECK), where rounding
# shrinks by 1e9 and a wrong rule does not.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
ROUNDING_CHECK = "float32 rounding (exact in float64)"
# OpInfos whose outputs are uninitialised memory, on one device and on each rank alike: their
# values (the loss, and the anchor's gradient, which is the loss) are not compared, gradients are.
UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"})
UNCOMPARED = "uninitialised values: loss not compared"


# -- the cases -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One OpInfo sample with its primary input sharded on ``dim`` (None: nothing to shard)."""

    op: str                 # the OpInfo's full name (name.variant)
    sample: int             # index among the op's usable float32 samples
    dim: int | None
    size: int = 0           # the dim's size
    shape: tuple = ()       # the primary input's shape

    @property
    def label(self) -> str:
        if self.dim is None:
            return "0-d"
        return f"Shard({self.dim}) of {list(self.shape)}" + ("" if self.size % 2 == 0 else " uneven")


@dataclass
class Outcome:
    kind: str
    detail: str = ""
    ops: tuple = ()          # unsupported ops (their names)
    max_err: float = 0.0


@dataclass
class Row:
    case: Case
    plain: Outcome
    fallback: Outcome | None = None   # the run with replicate_fallback naming plain.ops
    random: bool = False              # the op's outputs change with the seed

    @property
    def final(self) -> Outcome:
        return self.fallback or self.plain


def full_name(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def op_infos(op_filter: str | None = None) -> list:
    """The OpInfos with float32 CPU samples, by name (``op_filter``: name contains it)."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = [i for i in op_db if torch.float32 in i.supported_dtypes("cpu")]
    return [i for i in out if not op_filter or op_filter in full_name(i)]


def float32_samples(info, n: int) -> list:
    """Up to ``n`` usable samples as (input, args, kwargs), generated under a fixed seed so that
    every process sees the same ones; samples whose primary input can be sharded (not 0-d, not
    empty) first, among the first few the OpInfo gives."""
    torch.manual_seed(0)
    out = []
    try:
        gen = iter(info.sample_inputs("cpu", torch.float32, requires_grad=bool(info.supports_autograd)))
        for s in itertools.islice(gen, 4 * n + 4):
            first = pytree.tree_leaves(s.input)[:1]
            if first and isinstance(first[0], torch.Tensor) and _usable(s.args, {**s.kwargs, "input": s.input}):
                out.append((s.input, s.args, s.kwargs))
    except Exception:  # noqa: BLE001 - sample generators that fail on CPU give no (more) cases
        pass
    shardable = lambda s: pytree.tree_leaves(s[0])[0].numel() > 1  # noqa: E731
    return sorted(out, key=lambda s: not shardable(s))[:n]


def cases_of(op: str, sample: int, primary: torch.Tensor, dims: str = "all") -> list[Case]:
    """dim 0, the last dim and the first dim of odd size (> 1), each once; ``dims="first"``: dim 0
    and the odd one only when dim 0 is even (the fast subset)."""
    shape = tuple(primary.shape)
    if not shape:
        return [Case(op, sample, None, 0, shape)]
    odd = next((d for d, n in enumerate(shape) if n % 2 and n > 1), None)
    want = [0] if dims == "first" else [0, len(shape) - 1]
    if odd is not None and (dims != "first" or odd != 0):
        want.append(odd)
    return [Case(op, sample, d, shape[d], shape) for d in dict.fromkeys(want)]


# -- the module ------------------------------------------------------------------------------------
class _Shared:
    """A value copies of the module share (deepcopy of a pytree spec warns in torch 2.13)."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class OpModule(torch.nn.Module):
    """``fn(input, *args, **kwargs)`` of one sample as a module without inputs: the sample's tensors
    that require grad are parameters (``t0`` is the primary input), the others buffers; the loss
    is ``sum((out_i * w_i).sum())`` over every output (integer and bool ones as float, non-finite
    values zeroed where one device has them), with fixed weights ``w_i``, so every gradient counts."""

    def __init__(self, fn, sample, weights, nonfinite):
        super().__init__()
        self.fn, self.nonfinite = fn, tuple(nonfinite)
        leaves, spec = pytree.tree_flatten(sample)
        self.spec = _Shared(spec)
        self.slots = []  # per leaf: the attribute holding it, or the constant itself
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                t = x.detach().clone()
                if x.requires_grad and t.is_floating_point():
                    setattr(self, f"t{i}", torch.nn.Parameter(t))
                else:
                    self.register_buffer(f"t{i}", t)
                self.slots.append(f"t{i}")
            else:
                self.slots.append((x,))
        for i, w in enumerate(weights):
            self.register_buffer(f"w{i}", w)
        self.anchor = None if any(p.requires_grad for p in self.parameters()) else torch.nn.Parameter(torch.ones(()))

    def outputs(self):
        leaves = [getattr(self, s) if isinstance(s, str) else s[0] for s in self.slots]
        x, args, kwargs = pytree.tree_unflatten(leaves, self.spec.value)
        return [o for o in pytree.tree_leaves(self.fn(x, *args, **kwargs)) if isinstance(o, torch.Tensor)]

    def forward(self):
        loss = 0
        for i, o in enumerate(self.outputs()):
            if not o.is_floating_point():
                o = o.to(self.w0.dtype)
            if i in self.nonfinite:
                o = torch.nan_to_num(o, nan=0.0, posinf=0.0, neginf=0.0)
            loss = loss + (o * getattr(self, f"w{i}")).sum()
        return loss * self.anchor if self.anchor is not None else loss


def build_module(fn, sample, dtype=torch.float32) -> OpModule | None:
    """The module of one sample (None when its outputs are complex or none are tensors)."""
    probe = OpModule(fn, sample, (), ())
    with torch.no_grad():
        torch.manual_seed(SEED)
        outs = probe.outputs()
    if not outs or any(o.is_complex() for o in outs):
        return None
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float32) for o in outs]
    nonfinite = [i for i, o in enumerate(outs) if o.is_floating_point() and not bool(o.isfinite().all())]
    m = OpModule(fn, sample, weights, nonfinite)
    return m.to(dtype) if dtype != torch.float32 else m


class _SeededOps(TorchDispatchMode):
    """Notes whether any aten op tagged nondeterministic_seeded (draws random numbers) runs."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def is_random(fn, sample) -> bool:
    """The op draws random numbers (dropout, bernoulli, OpInfo's random ops, which seed the
    generator themselves inside the call and restore it after: wrapper_set_seed)."""
    probe, mode = OpModule(fn, sample, (), ()), _SeededOps()
    with torch.no_grad(), mode:
        probe.outputs()
    return mode.seen


# -- one case --------------------------------------------------------------------------------------
def eager_step(module: OpModule) -> tuple[torch.Tensor, dict]:
    m = copy.deepcopy(module)
    torch.manual_seed(SEED)
    loss = m()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def sharded_step(module: OpModule, case: Case, fallback=()) -> tuple[torch.Tensor, dict]:
    import shardwise as sw

    placements = {} if case.dim is None else {"t0": [sw.Shard(case.dim)]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = sw.parallelize(copy.deepcopy(module), sw.Mesh((2,)), (), param_placements=placements,
                            replicate_fallback=set(fallback))
        torch.manual_seed(SEED)
        loss = pm.step()
        return loss.detach(), pm.gradients()


def _err(got, want) -> float:
    """max |got - want| / max(1, max |want|); inf where shapes, nan or inf positions differ."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else math.inf
    if got.shape != want.shape:
        return math.inf
    got, want = got.double(), want.double()
    inf = torch.isinf(want)  # nan where one device has nan, the same infinities where it has them
    if not torch.equal(torch.isnan(got), torch.isnan(want)) or not torch.equal(torch.isinf(got), inf) \
            or not torch.equal(got[inf], want[inf]):
        return math.inf
    fin = torch.isfinite(want)
    if not bool(fin.any()):
        return 0.0
    scale = max(float(want[fin].abs().max()), 1.0)
    return float((got[fin] - want[fin]).abs().max()) / scale


def compare(module: OpModule, case: Case, fallback=()) -> Outcome:
    """One case: the sharded step against the eager one. Errors are measured relative to
    max(1, the largest |value|) of the one-device tensor (loss: of the summed terms' magnitude)."""
    dtype = module.w0.dtype  # float32, or float64 for the rounding check
    want_loss, want = eager_step(module)
    got_loss, got = sharded_step(module, case, fallback)
    terms = _terms_scale(module)
    errs = {"loss": float((got_loss.double() - want_loss.double()).abs()) / max(1.0, terms)
            if bool(torch.isfinite(want_loss)) else _err(got_loss, want_loss)}
    errs.update({n: _err(got.get(n), g) for n, g in want.items()})
    if case.op in UNINITIALISED:
        errs = {n: e for n, e in errs.items() if n not in ("loss", "anchor")} or {"loss": 0.0}
    worst = max(errs, key=errs.get)
    if errs[worst] <= TOLERANCE.get(dtype, 1e-4):
        return Outcome("exact", UNCOMPARED if case.op in UNINITIALISED else "", max_err=errs[worst])
    return Outcome("wrong", f"{worst}: relative error {errs[worst]:.2e}", max_err=errs[worst])


def _terms_scale(module: OpModule) -> float:
    """sum |out_i * w_i|: the magnitude the loss's sum is made of."""
    with torch.no_grad():
        torch.manual_seed(SEED)
        total = 0.0
        for i, o in enumerate(module.outputs()):
            o = o.to(torch.float64)
            total += float(torch.nan_to_num(o * getattr(module, f"w{i}").double(), 0.0, 0.0, 0.0).abs().sum())
    return total


def classify(fn) -> Outcome:
    """Run ``fn() -> Outcome``; an exception becomes unsupported / refused / crash."""
    from ...core.errors import ShardingError, UnsupportedOpError

    try:
        return fn()
    except UnsupportedOpError as e:
        ops = tuple(str(op) for op, _, _ in getattr(e, "ops", [(e.op, e.node, e.source)]))
        return Outcome("unsupported", ", ".join(ops), ops=ops)
    except ShardingError as e:
        return Outcome("refused", f"{type(e).__name__}: {_first_line(e.message)}")
    except Exception as e:  # noqa: BLE001 - any other exception is a bug of shardwise's
        return Outcome("crash", f"{type(e).__name__}: {_first_line(str(e))}")


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def run_case(fn, sample, case: Case, with_fallback: bool = True, random: bool = False) -> Row:
    """A case, and when unsupported, again with the replicate fallback for its ops. A float32
    result over tolerance is checked again in float64 (ROUNDING_CHECK)."""
    def one(fallback=()):
        module = build_module(fn, sample)
        out = compare(module, case, fallback)
        if out.kind == "wrong":
            again = classify(lambda: compare(build_module(fn, sample, torch.float64), case, fallback))
            if again.kind == "exact":
                return Outcome("exact", ROUNDING_CHECK, max_err=out.max_err)
        return out

    row = Row(case, classify(one), random=random)
    if with_fallback and row.plain.kind == "unsupported":
        ops = set(row.plain.ops)
        for _ in range(3):  # the fallback's replicated pieces may reach ops the first graph had not
            row.fallback = classify(lambda: one(tuple(sorted(ops))))
            if row.fallback.kind != "unsupported" or not set(row.fallback.ops) - ops:
                break
            ops |= set(row.fallback.ops)
    return row


# -- the sweep -------------------------------------------------------------------------------------
@dataclass
class OpinfoReport:
    rows: list = field(default_factory=list)      # Row
    skipped: dict = field(default_factory=dict)   # op -> why no case ran
    seconds: float = 0.0
    samples: int = 2
    dims: str = "all"

    def by_op(self) -> dict:
        out: dict = {}
        for r in self.rows:
            out.setdefault(r.case.op, []).append(r)
        return out

    def totals(self, final: bool = False) -> dict:
        counts = dict.fromkeys(KINDS, 0)
        for r in self.rows:
            counts[(r.final if final else r.plain).kind] += 1
        return counts

    def op_totals(self) -> dict:
        """Ops by their cases: 'exact' (all exact), 'partly' (some), 'none'."""
        out = {"exact": 0, "partly": 0, "none": 0}
        for rows in self.by_op().values():
            n = sum(r.plain.kind == "exact" for r in rows)
            out["exact" if n == len(rows) else "partly" if n else "none"] += 1
        return out

    def bugs(self) -> list:
        """Rows that are wrong or crash, plain or under the fallback."""
        return [r for r in self.rows if {r.plain.kind, r.final.kind} & {"wrong", "crash"}]

    def json_rows(self) -> list:
        """One dict per case (``--json``)."""
        def out(o):
            return None if o is None else {"kind": o.kind, "detail": o.detail, "ops": list(o.ops),
                                           "max_err": None if math.isinf(o.max_err) else o.max_err}
        return [{"op": r.case.op, "sample": r.case.sample, "dim": r.case.dim, "shape": list(r.case.shape),
                 "uneven": bool(r.case.size % 2), "random": r.random, "plain": out(r.plain),
                 "fallback": out(r.fallback)} for r in self.rows]

    def unsupported_ops(self) -> dict:
        """aten op -> how many cases it stopped."""
        out: dict = {}
        for r in self.rows:
            for op in r.plain.ops:
                out[op] = out.get(op, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def op_cases(info, samples: int, dims: str) -> tuple[list, str]:
    """[(sample, case, random)] of one OpInfo, and why it has none ("" when it has some). The
    DTensor count (opinfo_dtensor.py) runs the same list."""
    name, out, why = full_name(info), [], ""
    got = float32_samples(info, samples)
    if not got:
        return [], "no usable float32 sample"
    for i, sample in enumerate(got):
        try:
            module_ok = build_module(info.op, sample) is not None
            random = module_ok and is_random(info.op, sample)
        except Exception as e:  # noqa: BLE001 - the op fails on one device: not a case
            why = f"fails on one device: {type(e).__name__}: {_first_line(str(e))}"
            continue
        if not module_ok:
            why = "complex or no tensor outputs"
            continue
        out += [(sample, case, random) for case in cases_of(name, i, pytree.tree_leaves(sample[0])[0], dims)]
    return out, "" if out else why


def sweep(op_filter: str | None = None, samples: int = 2, dims: str = "all", with_fallback: bool = True,
          infos=None, progress=None) -> OpinfoReport:
    """Every case of every OpInfo (``infos``: these instead of op_db's), in op_db's order.
    ``progress(op name, report so far)`` is called before each OpInfo."""
    t0 = time.perf_counter()
    report = OpinfoReport(samples=samples, dims=dims)
    for info in op_infos(op_filter) if infos is None else infos:
        if progress:
            progress(full_name(info), report)
        cases, why = op_cases(info, samples, dims)
        if why:
            report.skipped[full_name(info)] = why
        report.rows += [run_case(info.op, sample, case, with_fallback, random) for sample, case, random in cases]
    report.seconds = time.perf_counter() - t0
    return report
