"""Fake tensors in, one functional aten graph out.

Two passes, both with ``make_fx(tracing_mode="fake")``:

1. the user function (functional_call + loss + autograd.grad) is traced plainly. The model
   sees FakeTensors, so libraries that skip data-dependent checks while tracing (HF
   transformers' ``is_tracing``) do so. Stack traces are recorded; backward nodes are
   linked to their forward line (provenance.py).
2. that aten graph is re-traced through ``torch.func.functionalize(remove="mutations")``
   with node metadata preserved: in-place ops become their functional forms
   (``bernoulli_`` -> ``bernoulli.p``), views stay views, and a mutated graph input shows up
   as a trailing ``copy_`` into its placeholder, which normalize.py reports. A graph without
   a mutating op is not re-traced (as long again as pass 1, per layer): the re-trace would
   only drop keyword-only arguments passed at their default.

Functionalising in pass 1 directly does not work for HF models in torch 2.13: functionalize
wraps tensors in FunctionalTensorWrapper, HF no longer recognises it is tracing and runs a
data-dependent check (``find_packed_sequence_indices``), which fails on fake tensors.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from .ctc import hf_ctc_as_padded
from .eager_attention import eager_attention_as_op
from ..core.errors import ShardingError
from .errors import explain
from .hf_flex import flex_as_op
from .moe import experts_as_op
from .normalize import is_mutable
from .provenance import forward_lines, link_backward, mark_accumulation
from .recompute import regions_on_draws_only
from .value_guards import GUARDS_META, ValueFakeMode, ValueGuards, ValueReader, erase_reads


def pick_device(*groups: Iterable[torch.Tensor]) -> torch.device:
    """The device fake tensors live on: the first non-meta tensor's, in group order; else cpu."""
    for group in groups:
        for t in group:
            if t.device.type != "meta":
                return t.device
    return torch.device("cpu")


def fakeify(tensors: list[torch.Tensor], mode: FakeTensorMode, device: torch.device,
            requires_grad: list[bool] | None = None, dtypes: list | None = None) -> list[torch.Tensor]:
    """Fake copies of real or meta tensors. Meta tensors become fake tensors on ``device``
    (fake propagation fails on a meta/cpu mix); nothing is allocated. ``dtypes``: per tensor,
    another dtype to make its fake in (None: its own)."""
    out = []
    for i, t in enumerate(tensors):
        rg = t.requires_grad if requires_grad is None else requires_grad[i]
        dtype = (dtypes[i] if dtypes is not None else None) or t.dtype
        if (t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor) and t.fake_mode is not mode
                or dtype != t.dtype):
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype,
                                        device=device if t.device.type == "meta" else t.device)
        else:
            f = mode.from_tensor(t.detach(), static_shapes=True)
        if rg and (f.is_floating_point() or f.is_complex()):
            f.requires_grad_(True)
        out.append(f)
    return out


def new_fake_mode(data: list | None = None) -> FakeTensorMode:
    """``data``: the real input and target tensors (the trailing arguments), from which a value the
    model reads may be answered (trace/value_guards.py)."""
    # allow_non_fake_inputs: real tensors the model holds outside params/buffers (plain
    # tensor attributes) become graph constants (get_attr) instead of an error.
    return ValueFakeMode(data, allow_non_fake_inputs=True)


@contextlib.contextmanager
def model_patches(notes: list | None = None):
    """What the model runs under while traced (and fingerprinted, stamp.py): grouped matmuls in
    their fixed-shape form, eager attention chains and Hugging Face's flex_attention as
    shardwise.attention (a note appended to ``notes``), Hugging Face's CTC loss on padded targets."""
    with experts_as_op(), flex_as_op(), eager_attention_as_op(notes), hf_ctc_as_padded():
        yield


def capture(fn: Callable, fake_args: list[torch.Tensor], notes: list | None = None,
            stamp: Callable | None = None) -> fx.GraphModule | None:
    """Trace ``fn(*fake_args)`` (pass 1) then functionalise it (pass 2). In pass 1 grouped
    matmuls take their fixed-shape form (moe.py), eager attention chains and Hugging Face's
    flex_attention become shardwise.attention (eager_attention.py, hf_flex.py; a note is
    appended to ``notes``). The module is
    lazy (torch's _LazyGraphModule): its Python code is generated when first read or run, not
    after every pass; planning reads only the graph (a second code generation would grow with depth).
    ``stamp``: the pass-1 graph of a shortened model -> the full model's (stamp.py), or None
    where it cannot be stamped (then capture returns None)."""
    guards = ValueGuards()
    gm = _trace(fn, fake_args, notes if not stamp else None, guards.guards)
    erase_reads(gm)
    if guards:
        guards.replay = _replayer(fn, fake_args)
    link_backward(gm.graph)
    regions_on_draws_only(gm.graph)
    if stamp is not None:
        gm = stamp(gm)
        if gm is None:
            return None
    gm = functionalize_graph(gm)
    mark_accumulation(gm.graph)
    gm.meta[GUARDS_META] = guards
    return gm


def _trace(fn: Callable, fake_args: list, notes: list | None, guards: list, data: list | None = None):
    """Pass 1: ``make_fx`` of ``fn``; a value read from the inputs is answered from ``data`` (default:
    the fake mode's real example inputs) and guarded (trace/value_guards.py); an op failure explained."""
    mode = next((t.fake_mode for t in fake_args if isinstance(t, torch._subclasses.FakeTensor)), None)
    data = data if data is not None else getattr(mode, "data", None)
    reader = ValueReader(data, guards) if isinstance(mode, ValueFakeMode) and data is not None else None

    def traced(*args):
        if reader is not None:
            reader.start()
        return fn(*args)

    if reader is not None:
        mode.reader = reader
    try:
        with fx_traceback.preserve_node_meta(), model_patches(notes), forward_lines(), _use_lazy_graph_module(True):
            return make_fx(traced, tracing_mode="fake", record_stack_traces=True, _allow_non_fake_inputs=True)(*fake_args)
    except Exception as e:  # noqa: BLE001 - an op failure is explained (trace/errors.py), anything else re-raised
        err = explain(e)
        if err is None:
            raise
        raise err from e
    finally:
        if reader is not None:
            mode.reader, mode.data = None, None  # (the example inputs are not kept by the graph's fakes)


def _replayer(fn: Callable, fake_args: list) -> Callable:
    """``replay(data)``: ``fn`` traced again on fresh fakes of ``fake_args`` with values read from
    ``data`` (a call's real inputs): the model's own error where its forward checks them, else None."""
    def replay(data: list) -> None:
        mode = new_fake_mode(data)
        fakes = fakeify(fake_args, mode, pick_device(fake_args), [t.requires_grad for t in fake_args])
        try:
            _trace(fn, fakes, None, [])
        except ShardingError:
            return  # (another refusal on the way: the caller's ValueGuardError says what changed)
    return replay


def functionalize_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Re-trace an aten graph through torch.func.functionalize, keeping node metadata."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not any(is_mutable(n.target) for n in calls):
        for n in calls:
            schema = getattr(n.target, "_schema", None)
            if schema is not None and n.kwargs:
                default = {a.name: a.default_value for a in schema.arguments if a.kwarg_only and a.has_default_value()}
                n.kwargs = {k: v for k, v in n.kwargs.items()
                            if not (k in default and type(v) is type(default[k]) and v == default[k])}
        return gm
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]

    def run(*args):
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm).run(*args)

    run = torch.func.functionalize(run, remove="mutations")
    with torch.no_grad():
        return make_fx(run, tracing_mode="fake", _allow_non_fake_inputs=True)(*[v.detach() for v in vals])
