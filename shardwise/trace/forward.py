"""Model -> forward-only aten graph (no gradients), outputs rebuilt as the model returns them.

    python -c "from tests.models import zoo; from shardwise.trace import trace_forward; m, x, *_ = zoo.mlp(); print(trace_forward(m, x))"

The graph returns the tensor leaves of the model output (torch pytree order); the output's
pytree spec and its non-tensor leaves are kept, so ``TracedForward.rebuild`` gives back the
same structure: tuples, dicts, and HF ``ModelOutput`` subclasses (transformers registers
them as pytree nodes, so the same class is rebuilt).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch.func import functional_call

from ..core.errors import ShardingError
from .base import Arguments, Traced, finish
from .precision import cast_inputs, cast_outputs, mark_masters, traced_dtypes
from .provenance import module_scope
from .roles import BUFFER, OUTPUT, FlatTree, OutputRole, flatten
from .stamp import stamped_trace
from .untouched import model_as_found

_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
                   enum.Enum, slice, type(Ellipsis))


@dataclass
class TracedForward(Traced):
    """The forward graph: outputs are the tensor leaves of the model output, in pytree order."""

    out: FlatTree | None = None  # spec + constant leaves of the model output (tensor leaves are None)

    def summary(self) -> str:
        return f"forward: {super().summary()}; outputs: {len(self.outputs)} tensors"

    def flat_args(self, params: dict, buffers: dict, inputs: tuple, kwargs: dict | None = None) -> list:
        return self.args.flat(params, buffers, inputs, kwargs, ())

    def rebuild(self, outs: list) -> object:
        """Graph outputs -> the model's output structure (buffer updates, which follow the
        model's outputs, left out)."""
        return self.out.rebuild(list(outs)[:len(self.out.tensor_idx)])

    def run(self, model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None) -> object:
        """Run the graph on the model's real parameters/buffers; returns what model(*inputs) returns."""
        flat = self.flat_args(dict(model.named_parameters()), dict(model.named_buffers()), inputs, kwargs)
        with torch.no_grad():
            return self.rebuild(self.gm(*flat))


def _check_leaves(flat: FlatTree) -> None:
    for i, leaf in enumerate(flat.leaves):
        if i not in flat.tensor_idx and not isinstance(leaf, _CONSTANT_TYPES):
            raise ShardingError(
                f"the model output holds a {type(leaf).__name__} (leaf {i}), which is neither a tensor nor a "
                "constant; a traced graph can only return tensors",
                fix="return tensors (HF models: pass use_cache=False so no cache object is returned)",
            )


def trace_forward(model: torch.nn.Module, example_inputs: tuple, *, example_kwargs: dict | None = None,
                  precision=None, stamp: bool = True) -> TracedForward:
    """Trace ``model(*example_inputs, **example_kwargs)`` without gradients into a functional aten
    graph; ``precision``: a MixedPrecision policy (trace/precision.py); ``stamp``: a long list of
    identical blocks is traced with five of them and the rest stamped (trace/stamp.py)."""
    args, real = Arguments.of(model, example_inputs, example_kwargs, ())
    dtypes = traced_dtypes(args.param_names, real, precision)
    fake = args.fake(real, grads=False, dtypes=dtypes)
    with model_as_found(model):  # the forward's own caches on the module, fake while traced, put back
        stamped = stamped_trace(model, args, fake, (example_inputs, example_kwargs, ()),
                                lambda a: _outputs_of(model, a, precision),
                                lambda a, record: _forward(model, a, precision, record), precision,
                                grads=False) if stamp else None
        if stamped is None:
            record: dict = {}
            gm, notes = finish(_forward(model, args, precision, record), args, fake, buffers=True)
        else:
            gm, notes, made = stamped
            record = made.record  # the short model's output structure: the full one's (stamp.fingerprint)
    mark_masters(gm, dtypes, real)
    out = record["out"]
    outputs = [OutputRole(OUTPUT, None, p) for p in out.paths]
    outputs += [OutputRole(BUFFER, n) for n in gm.meta.get("buffer_updates", [])]
    return TracedForward(gm, args, outputs, notes, out)


def _outputs_of(model: torch.nn.Module, args: Arguments, precision):
    """Flat arguments (a list) -> the model's output (what stamp.fingerprint records)."""
    def run(flat):
        params, buffers, a, kw, _ = args.split(flat)
        a, kw = cast_inputs((a, kw), precision)
        with torch.no_grad(), module_scope(model):
            return cast_outputs(functional_call(model, {**params, **buffers}, a, kw), precision)
    return run


def _forward(model: torch.nn.Module, args: Arguments, precision, record: dict):
    """The function make_fx traces: flat arguments -> the tensor leaves of the model's output;
    ``record`` gets the output's structure (``out``)."""
    outputs_of = _outputs_of(model, args, precision)

    def forward(*flat):
        flat_out = flatten(outputs_of(flat))
        _check_leaves(flat_out)
        tensors = flat_out.tensors
        for i in flat_out.tensor_idx:
            flat_out.leaves[i] = None  # keep no fake tensors alive
        record["out"] = flat_out
        return tensors
    return forward
