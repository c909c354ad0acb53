"""Sample calls for the rule sweep: real aten-level arguments for every registered op.

Three sources, in this order of preference:

* ``model``: small training snippets (linear + GELU + LayerNorm + cross-entropy, SDPA,
  embedding, dropout, ...) run forward and backward with uneven sizes (5, 7, 3) under a
  recording ``TorchDispatchMode``: every call of a registered op is kept with its args.
* ``opinfo``: torch's OpInfo samples (``op_db``) of the OpInfos whose name matches the op,
  run under the same recording mode (forward, plus backward for ``*_backward`` ops), so a
  sample is kept only for the overload it really dispatches to. Ops that decompose above
  the dispatch mode (CompositeImplicitAutograd: reshape, chunk, std, ...) are called
  directly with the OpInfo sample's args instead, when the overload accepts them.
* ``table``: hand-written calls for ops neither source reaches (foreach norms, factories,
  the SDPA/RMS-norm ops without a CPU kernel, ...; complex, FFT and linalg calls: samples_math.py).

Dropped: samples with a tensor over 4 dims or too many elements, non-finite real or complex
values (a Partial layout splits a value into random parts; inf and nan have none), or an
explicit generator (one object all ranks would share). Samples whose tensors are all 0-d
only serve when there is no other. ``select`` puts each kind of call first (tensor or
Python-number operands, ...), so a capped sweep sees every kind.

    python -c "import torch; from shardwise.tools.verify.samples import collect_samples as c; \
        print([s.describe() for s in c([torch.ops.aten.mm.default], cap=None)[torch.ops.aten.mm.default]])"
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .samples_math import math_samples
from .samples_strided import strided_samples
from .samples_pointwise import pointwise_samples
from .samples_nn import nn_samples
from .samples_small_ops import small_ops_samples
from .samples_index_bins import index_bins_samples
from .samples_spatial import spatial_samples

aten = torch.ops.aten
MAX_DIMS, MAX_NUMEL, MAX_TOTAL = 4, 8192, 32768
SOURCES = ("model", "opinfo", "table")


@dataclass(eq=False)
class Sample:
    """One call of ``op``: tensors are private copies (``fresh`` hands out new ones each time)."""

    op: object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    source: str = "table"

    def fresh(self) -> tuple[tuple, dict]:
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (self.args, self.kwargs))

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, torch.Tensor)]

    def key(self) -> tuple:
        """Equal for calls that differ only in tensor values."""
        def k(x):
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.dtype, x.device.type)
            return repr(x)[:60]
        return (self.op, tuple(map(k, pytree.tree_leaves((self.args, self.kwargs)))))

    def kind(self) -> tuple:
        """The call's structure: which args are tensors (float, integer or bool), Python
        numbers, dtypes (of which class), lists, None."""
        def cls(dtype):
            return "b" if dtype == torch.bool else "f" if dtype.is_floating_point else "c" if dtype.is_complex else "i"

        def k(x):
            if isinstance(x, torch.Tensor):
                return "T" + cls(x.dtype)
            return "dtype:" + cls(x) if isinstance(x, torch.dtype) else type(x).__name__
        return tuple(map(k, pytree.tree_leaves((self.args, self.kwargs))))

    @property
    def trivial(self) -> bool:
        ts = self.tensors()
        return bool(ts) and all(t.ndim == 0 for t in ts)

    def describe(self) -> str:
        def fmt(x):
            if isinstance(x, torch.Tensor):
                dev = "" if x.device.type == "cpu" else f"@{x.device.type}"
                return f"{list(x.shape)}:{str(x.dtype).replace('torch.', '')}{dev}"
            return repr(x)
        args = [pytree.tree_map(fmt, a) if isinstance(a, (list, tuple)) else fmt(a) for a in self.args]
        kw = [f"{k}={fmt(v)}" for k, v in self.kwargs.items()]
        return f"{self.source}: ({', '.join(map(str, args + kw))})".replace("'", "")


def _max_dims(op) -> int:
    """3-d pooling, convolution and upsampling take (N, C, D, H, W) tensors: one dim more."""
    return MAX_DIMS + 1 if "3d" in str(op) else MAX_DIMS


def _usable(args, kwargs, max_dims: int = MAX_DIMS) -> bool:
    leaves = pytree.tree_leaves((args, kwargs))
    if any(isinstance(x, torch.Generator) for x in leaves):
        return False  # one generator object shared by every rank cannot replay the single-device draw
    ts = [x for x in leaves if isinstance(x, torch.Tensor)]
    for t in ts:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False
        if t.layout != torch.strided or t.device.type not in ("cpu", "meta"):
            return False
        if t.ndim > max_dims or t.numel() > MAX_NUMEL:
            return False
        inexact = t.is_floating_point() or t.is_complex()
        if inexact and t.device.type == "cpu" and not bool(t.detach().isfinite().all()):
            return False  # a Partial layout splits values into random parts: inf/nan have none
    return sum(t.numel() for t in ts) <= MAX_TOTAL


# Calls the rules refuse on purpose: aten attention with dropout inside draws from the shared
# global generator (traced graphs never hold it: with dropout it decomposes into math ops).
_REFUSED = {
    "aten::scaled_dot_product_attention": lambda a, kw: (a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)) > 0,
    "aten::_scaled_dot_product_attention_math": lambda a, kw: (a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)) > 0,
}


def _freeze(op, args, kwargs, source) -> Sample | None:
    refused = _REFUSED.get(getattr(getattr(op, "_schema", None), "name", ""))
    if not _usable(args, kwargs, _max_dims(op)) or (refused is not None and refused(args, kwargs)):
        return None
    copy = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    args, kwargs = pytree.tree_map(copy, (tuple(args), dict(kwargs)))
    return Sample(op, args, kwargs, source)


class Recorder(TorchDispatchMode):
    """Keeps (a copy of the args of) every call of an op in ``ops`` that the mode sees."""

    def __init__(self, ops, source: str, per_op: int = 16):
        super().__init__()
        self.ops, self.source, self.per_op = ops, source, per_op
        self.found: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keep = func in self.ops and len(self.found.get(func, ())) < self.per_op
        s = _freeze(func, args, kwargs, self.source) if keep else None  # before an in-place op runs
        out = func(*args, **kwargs)
        if s is not None:
            self.found.setdefault(func, []).append(s)
        return out


# -- source 1: small training snippets, uneven sizes ------------------------------------------
def _backward(*outs):
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _mlp():
    x = torch.randn(3, 5, 7, requires_grad=True)
    lin1, lin2, ln = torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.LayerNorm(5)
    h = ln(F.gelu(lin1(x)))
    h = F.silu(h) + torch.tanh(h) * torch.sigmoid(h) + F.relu(h)
    h = (h - 0.5) * 2.0 + 1  # Python numbers reach aten as they are: add.Tensor(x, 1)
    logits = lin2(h)
    loss = F.cross_entropy(logits.reshape(-1, 3), torch.randint(0, 3, (15,)))
    loss = loss + F.mse_loss(h, torch.zeros_like(h)) + h.softmax(-1).mean() + logits.pow(2).sum(-1).mean()
    _backward(loss)


def _attention():
    q, k, v = (torch.randn(2, 3, n, 4, requires_grad=True) for n in (5, 7, 7))
    mask = torch.rand(5, 7) > 0.3
    _backward(F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    q, k, v = torch.randn(1, 6, 5, 4, requires_grad=True), torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    _backward(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def _embedding():
    emb = torch.nn.Embedding(7, 5, padding_idx=2)
    _backward(emb(torch.randint(0, 7, (3, 5))) * torch.randn(3, 5, 5))


def _dropout():
    x = torch.randn(5, 7, requires_grad=True)
    y, _ = torch.native_dropout(x, 0.3, True)
    _backward(y, F.dropout(x, 0.4))
    torch.bernoulli(torch.rand(5, 3)), torch.rand_like(x), torch.randn_like(x)


def _cross_entropy_2d():
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    t = torch.randint(0, 3, (2, 5, 7))
    _backward(F.cross_entropy(x, t, ignore_index=1), F.nll_loss(F.log_softmax(x, 1), t, reduction="sum"))


def _shardwise_attention():
    """The ``torch.ops.shardwise.attention`` custom op (and its backward op), through sw.attention."""
    from ...ops.attention import attention

    q, k, v = (torch.randn(2, 3, n, 4, requires_grad=True) for n in (5, 7, 7))
    mask = torch.rand(5, 7) > 0.3
    _backward(attention(q, k, v), attention(q, k, v, attn_mask=mask))
    q, k, v = torch.randn(1, 6, 5, 4, requires_grad=True), torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    _backward(attention(q, k, v, is_causal=True, enable_gqa=True))
    # score modifications: a learned bias, soft-capping, ALiBi, a window, packed documents
    q, k, v = torch.randn(2, 4, 5, 4, requires_grad=True), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    _backward(attention(q, k, v, is_causal=True, enable_gqa=True, bias=torch.randn(1, 4, 5, 5, requires_grad=True),
                        softcap=0.7, alibi_slopes=torch.rand(4), window_left=2, q_doc=docs, k_doc=docs))


def _moe_experts():
    """The ``torch.ops.shardwise.moe_experts`` custom op and its backward: 7 tokens, 5 experts, top 2,
    expert 2 routed to by no token."""
    from ...ops.moe import moe_experts

    idx = torch.randint(0, 5, (7, 2))
    idx[idx == 2] = 3
    x, w = torch.randn(7, 6, requires_grad=True), torch.rand(7, 2, requires_grad=True)
    gate_up, down = torch.randn(5, 8, 6, requires_grad=True), torch.randn(5, 6, 4, requires_grad=True)
    _backward(moe_experts(x, idx, w, gate_up, down, "silu", 0))


SNIPPETS = (_mlp, _attention, _embedding, _dropout, _cross_entropy_2d, _shardwise_attention, _moe_experts)


def harvest_model(ops) -> dict:
    rec = Recorder(ops, "model")
    torch.manual_seed(0)
    for fn in SNIPPETS:
        with rec:
            fn()
    return rec.found


# -- source 2: OpInfo samples -------------------------------------------------------------------
# Base op name -> OpInfo names that reach it (where the names do not say so themselves).
ALIASES = {
    "threshold": ["nn.functional.relu", "nn.functional.threshold"],
    "linalg__powsum": ["linalg.vector_norm"],
    "scaled_dot_product_attention_math": ["nn.functional.scaled_dot_product_attention"],
    "scaled_dot_product_flash_attention": ["nn.functional.scaled_dot_product_attention"],
    "safe_softmax": ["torch.ops.aten._safe_softmax.default", "softmax"],
    "log_softmax_backward_data": ["log_softmax"],
    "softmax_backward_data": ["softmax", "_softmax_backward_data"],
    "embedding_dense_backward": ["nn.functional.embedding"],
    "to_copy": ["to", "double", "float", "int"],
    "conj_physical": ["conj_physical"],
    "convolution": ["nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
                    "nn.functional.conv_transpose2d"],
    **{f"upsample_{m}": ["nn.functional.interpolate"]  # every mode's OpInfo: the recorder keeps this op's calls
       for m in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d", "bicubic2d", "trilinear3d")},
    "max_pool3d_with_indices": ["nn.functional.max_pool3d"],
    "native_batch_norm_legit_functional": ["nn.functional.batch_norm", "native_batch_norm"],
    "native_batch_norm_legit_no_training": ["nn.functional.batch_norm", "native_batch_norm"],
}
_SUFFIXES = ("_backward_data", "_backward", "_forward", "_for_cpu", "_dense", "2d")


def base_names(op) -> set[str]:
    """Names an OpInfo may carry for ``op``: the aten name, without _/native_ and _backward etc."""
    names = {op._schema.name.split("::")[-1]}
    while True:
        more = set(names)
        for n in names:
            more |= {n.lstrip("_"), n.removeprefix("native_"), n.removeprefix("fused_")}
            more |= {n.removesuffix(s) for s in _SUFFIXES}
        more.discard("")
        if more == names:
            break
        names = more
    return names | {a for n in names for a in ALIASES.get(n, ())}


_INDEX: dict | None = None


def opinfo_index() -> dict:
    """OpInfo name / last dotted part / aten_name -> OpInfos (torch's op_db, loaded once)."""
    global _INDEX
    if _INDEX is None:
        from torch.testing._internal.common_methods_invocations import op_db

        _INDEX = {}
        for info in op_db:
            keys = {info.name, info.name.split(".")[-1], info.aten_name or ""}
            keys |= {a.name for a in getattr(info, "aliases", ())}
            for k in keys - {""}:
                _INDEX.setdefault(k, []).append(info)
    return _INDEX


def opinfos_for(op) -> list:
    index, out = opinfo_index(), []
    for n in sorted(base_names(op)):
        out += [i for i in index.get(n, ()) if i not in out]
    return out


def _dtype_for(info):
    ok = info.supported_dtypes("cpu")
    return next((d for d in (torch.float32, torch.int64, torch.bool) if d in ok), None)


def _is_backward(op) -> bool:
    return "backward" in op._schema.name


def _run_opinfo(info, ops, per_info: int, backward: bool, rec: Recorder, direct: dict):
    """Run up to ``per_info`` samples of ``info`` under ``rec``; for ``direct`` ops (not seen by
    the mode) call the overload itself with the sample's args."""
    dtype = _dtype_for(info)
    if dtype is None:
        return
    grad = backward and info.supports_autograd and dtype.is_floating_point
    torch.manual_seed(0)
    try:
        samples = iter(info.sample_inputs("cpu", dtype, requires_grad=grad))
        for s in itertools.islice(samples, per_info):
            try:
                with rec:
                    out = info.op(s.input, *s.args, **s.kwargs)
                if grad:
                    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                    gs = [torch.randn_like(o) for o in outs]
                    with rec:
                        torch.autograd.backward(outs, gs)
            except Exception:  # noqa: BLE001 - a sample torch itself rejects is no sample
                pass
            for op in direct:
                _direct_call(op, s, direct[op])
    except Exception:  # noqa: BLE001 - sample generators that fail on CPU
        return


def _tensors_fit_schema(op, args, kwargs) -> bool:
    """Tensors only where the schema takes tensors (a 0-d tensor also passes for an int arg)."""
    params = op._schema.arguments
    named = {p.name: p for p in params}
    for p, v in list(zip(params, args)) + [(named.get(k), v) for k, v in kwargs.items()]:
        has_tensor = any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))
        if has_tensor and (p is None or "Tensor" not in str(p.type)):
            return False
    return len(args) <= len(params)


def _direct_call(op, s, sink: list):
    args = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (s.input, *s.args))
    kwargs = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, dict(s.kwargs))
    if len(sink) >= 16 or not _tensors_fit_schema(op, args, kwargs):
        return
    sample = _freeze(op, args, kwargs, "opinfo")
    if sample is None:
        return
    try:
        op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - this overload does not take the sample's args
        return
    sink.append(sample)


def harvest_opinfo(ops, per_info: int = 8, skip=frozenset()) -> dict:
    """OpInfo-derived samples for ``ops`` (those in ``skip`` get none from here)."""
    want = sorted((op for op in ops if op not in skip and hasattr(op, "_schema")), key=str)  # a fixed order
    infos: dict = {}
    for op in want:
        for info in opinfos_for(op)[:4]:
            infos.setdefault(id(info), (info, []))[1].append(op)
    own: dict = {}  # calls recorded while running one of the op's own OpInfos
    other: dict = {}  # calls of the op made inside other OpInfos (decompositions, ...): extra variety
    direct: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations and sparse-format betas from the samples
        for info, targets in infos.values():
            rec = Recorder(frozenset(want), "opinfo")
            mine = {op: [] for op in targets}
            _run_opinfo(info, targets, per_info, any(map(_is_backward, targets)), rec, mine)
            for op, calls in rec.found.items():
                sink = own if op in mine else other
                sink[op] = (sink.get(op, []) + calls)[:64 if sink is own else 16]
            for op, calls in mine.items():
                direct.setdefault(op, []).extend(calls)
    found = {op: own.get(op, []) + other.get(op, []) for op in set(own) | set(other)}
    for op, calls in direct.items():
        if not found.get(op):
            found[op] = calls  # only where the dispatch mode never saw the overload
    return found


# -- source 3: hand-written calls ----------------------------------------------------------
def _r(*shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    t = torch.randn(shape, generator=g)
    return t.to(dtype) if dtype.is_floating_point else (t * 3).to(dtype)


def _rms_backward():
    x, w, g = _r(5, 7), _r(7), _r(5, 7)
    _, rstd = aten._fused_rms_norm.default(x, [7], w, 1e-5)
    return [(g, x, [7], rstd, w, [True, True]), (_r(3, 5, 7), _r(3, 5, 7), [5, 7],
                                                  aten._fused_rms_norm.default(_r(3, 5, 7), [5, 7], None, 1e-5)[1],
                                                  None, [True, False])]


def _efficient(backward: bool):
    m = "meta"
    q, k, v = (torch.empty(2, 3, n, 4, device=m) for n in (5, 7, 7))
    bias = torch.empty(2, 3, 5, 7, device=m)
    fwd = aten._scaled_dot_product_efficient_attention.default
    if not backward:
        return [(q, k, v, None, True), (q, k, v, bias, True)]
    out = fwd(q, k, v, bias, True)
    return [(out[0], q, k, v, bias, out[0], out[1], out[2], out[3], 0.0, [True, True, True, True])]


def _rule_family_samples() -> dict:
    """Hand samples (uneven sizes) for ops of rules/padding.py, sampling.py, distance.py and indexing.py that torch's
    OpInfo does not reach by these overloads."""
    from ...trace.index_rows import INDEX_ALIGNED

    ints = (torch.arange(35).view(5, 7) * 37) % 101
    real = lambda *shape: torch.linspace(-2.0, 3.0, steps=int(torch.tensor(shape).prod())).view(*shape)  # noqa: E731
    mask, rows, cols = (torch.arange(35) % 3 != 0).view(5, 7), torch.arange(5), torch.arange(7)
    pads = {aten.reflection_pad1d.default: [(real(3, 5, 7), [2, 3])],
            aten.reflection_pad2d.default: [(real(3, 5, 4, 7), [1, 2, 3, 1])],
            aten.reflection_pad3d.default: [(real(2, 3, 3, 4, 5), [1, 2, 2, 1, 1, 1])],
            aten.replication_pad2d.default: [(real(3, 5, 4, 7), [1, 2, 3, 1])],
            aten.replication_pad3d.default: [(real(2, 3, 3, 4, 5), [1, 2, 2, 1, 1, 1])],
            aten.replication_pad1d.default: [(real(3, 5, 7), [3, 1])]}
    from ...rules.padding import PAD_BACKWARD

    # their backwards: (grad_output shaped as the padded output, input, padding)
    backward = {bwd: [(real(*fwd(*pads[fwd][0]).shape), *pads[fwd][0])] for bwd, fwd in PAD_BACKWARD.items()}
    return {
        **pads, **backward,
        **{op: [(ints, 6), (ints.view(5, 7, 1), 3)]
           for op in (aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar)},
        aten.div.Scalar_mode: [((real(5, 7), 0.7), {"rounding_mode": "floor"}),
                               ((real(3, 5), 1.5), {"rounding_mode": "trunc"})],
        INDEX_ALIGNED: [(mask, [rows.view(5, 1, 1, 1), cols.view(1, 1, 1, 7)], 0, 0),
                        (torch.arange(35.).view(5, 7) / 7, [rows.view(5, 1), torch.tensor([[6, 0, 3]])], 0, 0),
                        (torch.arange(35.).view(7, 5), [None, rows.view(1, 5)], 1, 0)],
    }


def _ctc_samples() -> dict:
    """CTC (rules/loss.py): 5 samples (uneven on every mesh), each target of full length, so that every entry
    of log_alpha is written (entries past a sample's 2 * target_length + 1 are left as the allocator gave them,
    which no comparison can hold); ragged lengths are checked by training (tests/parallel/test_ctc.py)."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 5, 4, generator=g).log_softmax(-1)
    tg, il, tl = torch.randint(1, 4, (5, 3), generator=g), torch.full((5,), 6), torch.full((5,), 3)
    nll, alpha = aten._ctc_loss.Tensor(lp, tg, il, tl, 0, False)
    alpha = alpha.clamp_min(-1e4)  # (unreachable entries are -inf: a sample's values must be finite)
    grad = torch.randn(5, generator=g)
    return {aten._ctc_loss.Tensor: [(lp, tg, il, tl, 0, False)],
            aten._ctc_loss.default: [(lp, tg, [6] * 5, [3] * 5, 0, True)],
            aten._ctc_loss_backward.Tensor: [(grad, lp, tg, il, tl, nll, alpha, 0, False)],
            aten._ctc_loss_backward.default: [(grad, lp, tg, [6] * 5, [3] * 5, nll, alpha, 0, False)]}


def _weight_norm_samples() -> dict:
    """rules/weight_norm.py: norms over every dim but 0, and but the last (wav2vec2's positional conv)."""
    out: dict = {aten._weight_norm_interface.default: [], aten._weight_norm_interface_backward.default: []}
    for dim, g in ((0, _r(5, 1, 1)), (2, _r(1, 1, 7))):
        v = _r(5, 3, 7) + 0.1 * torch.arange(105.).view(5, 3, 7)
        w, norm = aten._weight_norm_interface.default(v, g, dim)
        out[aten._weight_norm_interface.default].append((v, g, dim))
        out[aten._weight_norm_interface_backward.default].append((_r(*w.shape), v, g, norm, dim))
    return out


def _tables():
    f32 = dict(dtype=torch.float32)
    x57, x357 = _r(5, 7), _r(3, 5, 7)
    b = x57 > 0
    idx3 = torch.tensor([4, 0, 3])
    return {
        aten._foreach_norm.Scalar: [([x57, _r(7), _r(3, 5)], 2), ([x57, _r(3)], math.inf)],
        aten._foreach_powsum.Scalar: [([x57, _r(7), _r(3, 5)], 2)],
        aten._foreach_max.default: [([x57, _r(7), _r(3, 5)],)],
        aten._fused_rms_norm.default: [(x57, [7], _r(7), 1e-5), (x357, [5, 7], None, 1e-5)],
        aten._fused_rms_norm_backward.default: _rms_backward(),
        aten._scaled_dot_product_efficient_attention.default: _efficient(False),
        aten._scaled_dot_product_efficient_attention_backward.default: _efficient(True),
        aten.linalg__powsum.default: [(x57, 3, [0]), (x357, 2)],
        aten.lift_fresh_copy.default: [(x57,)],
        aten.alias.default: [(x357,)],
        aten.detach.default: [(x57,)],
        aten._to_copy.default: [(x57,), ((x357, ), {"dtype": torch.float64})],
        aten.empty.memory_format: [([5, 7],), (([3, 5, 7],), f32)],
        aten.empty_strided.default: [([5, 7], [1, 5]), ([3, 5], [5, 1])],
        aten.new_empty.default: [(x57, [3, 5])],
        aten.new_empty_strided.default: [(x57, [5, 3], [3, 1])],
        aten.empty_like.default: [(x357,)],
        aten.new_zeros.default: [(x57, [3, 5])], aten.new_ones.default: [(x57, [7, 3])],
        aten.new_full.default: [(x57, [5, 3], 2.5)],
        aten.zeros.default: [([5, 7],)], aten.ones.default: [([3, 5],)], aten.full.default: [([7, 3], 1.5)],
        aten._efficientzerotensor.default: [([5, 7],), (([3, 5, 7],), f32)],  # sgn's backward
        # vision ops that F.* reaches only through decompositions (the .vec overloads, batch-norm variants)
        aten.upsample_nearest1d.vec: [(_r(2, 3, 5), None, [2.0])],
        aten.upsample_nearest2d.vec: [(_r(2, 3, 5, 4), [7, 6], None)],
        aten.upsample_nearest3d.vec: [(_r(1, 3, 3, 5, 2), None, [2.0, 1.5, 2.0])],
        aten.upsample_bilinear2d.vec: [(_r(2, 3, 5, 4), [7, 6], False, None), (_r(1, 3, 4, 3), None, True, [2.0, 2.0])],
        aten.upsample_bicubic2d.default: [(_r(2, 3, 5, 4), [7, 6], False), (_r(1, 2, 3, 3), [6, 5], True)],
        aten.upsample_bicubic2d_backward.default: [(_r(2, 3, 7, 6), [7, 6], [2, 3, 5, 4], False)],
        aten.upsample_nearest3d.default: [(_r(1, 3, 3, 5, 2), [5, 7, 4])],
        aten.upsample_nearest3d_backward.default: [(_r(1, 3, 5, 7, 4), [5, 7, 4], [1, 3, 3, 5, 2])],
        aten.upsample_trilinear3d.default: [(_r(1, 3, 3, 5, 2), [5, 7, 4], False)],
        aten.upsample_trilinear3d_backward.default: [(_r(1, 3, 5, 7, 4), [5, 7, 4], [1, 3, 3, 5, 2], True)],
        aten._native_batch_norm_legit.no_stats: [(_r(5, 3, 4), _r(3), _r(3), True, 0.1, 1e-5)],
        aten._native_batch_norm_legit_no_training.default: [
            (_r(5, 3, 4), _r(3), _r(3), _r(3), _r(3).abs() + 0.5, 0.1, 1e-5)],
        aten.scalar_tensor.default: [(2.5,)],
        aten.arange.default: [(7,)], aten.arange.start: [(2, 9)], aten.arange.start_step: [(1.0, 8.0, 0.5)],
        aten.copy.default: [(x57, _r(5, 7))],
        aten.fill.Tensor: [(x57, torch.tensor(1.5))], aten.fill.Scalar: [(x357, 2.0)],
        aten.where.Scalar: [(b, 1.0, -1.0)], aten.where.ScalarOther: [(b, x57, 0.0)],
        aten.where.ScalarSelf: [(b, 0.0, x57)],
        aten.bernoulli_.float: [(_r(5, 7), 0.3)], aten.bernoulli.p: [(_r(5, 7), 0.4)],
        # draws of a shape (rules/random.SHAPE_DRAWS): what x.random_() / x.uniform_() become once functional
        aten.random.default: [(torch.zeros(5, 7, dtype=torch.int32),)], aten.random.to: [(x57, 9)],
        getattr(aten.random, "from"): [(x57, -3, 12)], aten.uniform.default: [(x57, -1.0, 2.0)],
        aten.randint_like.default: [(x57, 10)], aten.randint_like.low_dtype: [(x57, -2, 5)],
        aten.normal_functional.default: [(x57, 0.5, 2.0)], aten.randn.default: [([5, 7],)],
        aten.rand.default: [([5, 7],)], aten.randint.default: [(9, [5, 7])], aten.randint.low: [(-3, 9, [5, 7])],
        aten.randperm.default: [(7,)], aten.normal.float_float: [(1.5, 2.0, [5, 7])],
        aten.normal.Tensor_Tensor: [(x57, _r(5, 7).abs() + 0.1)], aten.normal.Tensor_float: [(x57, 2.0)],
        aten.normal.float_Tensor: [(1.5, _r(5, 7).abs() + 0.1)],
        aten.multinomial.default: [(_r(5, 7).abs() + 0.1, 3), (_r(5, 7).abs() + 0.1, 2, True)],
        aten.rrelu_with_noise_functional.default: [(x57, torch.zeros(5, 7), 0.1, 0.3, True),
                                                   (x57, torch.zeros(5, 7), 0.1, 0.3, False)],
        aten.rrelu_with_noise_backward.default: [(_r(5, 7), x57, _r(5, 7).abs(), 0.1, 0.3, True, False)],
        aten.sort.stable: [((x57,), {"stable": True, "dim": 0})],
        aten.all.dims: [(b, [0])], aten.any.dims: [(b, [1], True)],
        aten.norm.ScalarOpt_dim_dtype: [((x57, 2, [1], False), {"dtype": torch.float64})],
        aten.squeeze.dims: [(_r(5, 1, 7), [1])],
        # .Scalar overloads: Python's x + 2.5 dispatches to add.Tensor(x, 2.5); these come from decompositions
        aten.add.Scalar: [(x57, 2.5)], aten.sub.Scalar: [(x57, 1.5)], aten.rsub.Scalar: [(x57, 2.0)],
        aten.pow.Scalar: [(2.0, x57)], aten.fmod.Scalar: [(x57, 1.5)], aten.remainder.Scalar: [(x57, 1.5)],
        aten.clamp.default: [(x57, -0.5, 0.5)], aten.clamp_min.default: [(x57, 0.2)],
        aten.clamp_max.default: [(x57, -0.1)],
        **{getattr(aten, c).Scalar: [(x57, 0.0)] for c in ("eq", "ne", "lt", "le", "gt", "ge")},
        # indexing
        aten.index.Tensor: [(x57, [idx3]), (x357, [None, idx3])],
        aten._unsafe_index.Tensor: [(x57, [idx3]), (x357, [None, idx3])],
        aten._unsafe_index_put.default: [(x57, [idx3], _r(3, 7), True), (x357, [None, idx3], _r(3, 3, 7))],
        aten.scatter.value: [(x57, 1, torch.tensor([[0, 6], [2, 3], [1, 1], [5, 4], [6, 0]]), 2.0)],
        aten.slice_scatter.default: [(x57, _r(5, 3), 1, 2, 5), (x357, _r(3, 2, 7), 1, 0, 4, 2)],
        **_rule_family_samples(), **pointwise_samples(), **math_samples(),
        **strided_samples(), **_ctc_samples(), **_weight_norm_samples(),
        **nn_samples(),
        **small_ops_samples(),
        **index_bins_samples(),
        **spatial_samples(),
    }


def table_samples(ops) -> dict:
    """Hand-written samples for the ops in ``ops`` that have some."""
    out = {}
    for op, calls in _tables().items():
        if op not in ops:
            continue
        for c in calls:
            with_kwargs = len(c) == 2 and isinstance(c[0], tuple) and isinstance(c[1], dict)
            args, kwargs = (c[0], c[1]) if with_kwargs else (c, {})
            s = _freeze(op, args, kwargs, "table")
            if s is not None:
                out.setdefault(op, []).append(s)
    return out


# -- choosing ----------------------------------------------------------------------------------
def select(found: dict, cap: int | None) -> list[Sample]:
    """Distinct calls, round-robin over sources (model, opinfo, table), each kind of call
    first (see ``Sample.kind``); all-0-d calls only when there is nothing else; at most
    ``cap`` (None: all)."""
    lists = [list(found.get(src, ())) for src in SOURCES]
    if any(not s.trivial for ss in lists for s in ss):
        lists = [[s for s in ss if not s.trivial] for ss in lists]
    keys, out = set(), []
    for s in (s for group in itertools.zip_longest(*lists) for s in group if s is not None):
        if s.key() not in keys:
            keys.add(s.key())
            out.append(s)
    kinds: dict = {}
    for s in out:
        kinds.setdefault(s.kind(), s)
    first = list(kinds.values())
    out = first + [s for s in out if s not in first]
    return out if cap is None else out[:cap]


_HARVESTS: dict = {}


def harvest(ops, per_info: int = 8) -> dict:
    """source -> op -> samples, for ``ops`` (kept per process: samples are never mutated)."""
    ops = frozenset(ops)
    key = (ops, per_info)
    if key not in _HARVESTS:
        _HARVESTS[key] = {"model": harvest_model(ops), "opinfo": harvest_opinfo(ops, per_info),
                          "table": table_samples(ops)}
    return _HARVESTS[key]


def collect_samples(ops, cap: int | None = 2, per_info: int = 8) -> dict:
    """op -> selected samples (at most ``cap``; None: all), for every op in ``ops``."""
    found = harvest(ops, per_info)
    return {op: select({src: found[src].get(op, ()) for src in SOURCES}, cap) for op in ops}
