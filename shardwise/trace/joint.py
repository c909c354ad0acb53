"""Model + loss -> one joint forward+backward aten graph (the training step).

    python -c "from tests.models import zoo; from shardwise.trace import trace_step; print(trace_step(*zoo.mlp()))"

The traced function is

    step(params, buffers, inputs, targets):
        out  = torch.func.functional_call(model, {**params, **buffers}, inputs)
        loss = loss_fn(out, *targets)        # or out / out.loss when loss_fn is None
        grads = torch.autograd.grad(loss, params requiring grad, allow_unused=True)
        return loss, *grads

traced with fake tensors (nothing is allocated: a model on the meta device plans too) and
functionalised. The graph returns ``(loss, grad_0, grad_1, ...)`` for the parameters in
``TracedStep.grad_names``; a parameter the loss does not depend on gets no output and its
gradient is reported as ``None`` (as eager autograd leaves ``.grad`` None).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
from torch.nn.utils.stateless import _reparametrize_module

from ..core.errors import ShardingError
from .base import Arguments, Traced, finish
from .precision import cast_gradients, cast_inputs, cast_outputs, mark_masters, traced_dtypes
from .provenance import anchor, backward_provenance, module_scope
from .recompute import checkpoint_recompute
from .roles import BUFFER, GRAD, LOSS, OutputRole
from .stamp import stamped_trace
from .untouched import model_as_found


def _describe(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


class NoLossError(ShardingError):
    """No loss_fn, and the model's output is neither a scalar loss nor carries one (``.loss``):
    the model can be planned for inference (forward only) but not trained."""


def select_loss(out: Any, loss_fn: Callable | None, targets: tuple) -> torch.Tensor:
    """loss_fn(out, *targets); or, without loss_fn, the output itself or its ``.loss`` / ``['loss']``."""
    if loss_fn is not None:
        loss = loss_fn(out, *targets)
    else:
        if targets:
            raise ShardingError(f"{len(targets)} example targets were given but loss_fn is None",
                                fix="pass loss_fn(output, *targets) -> scalar, or drop the targets")
        loss = out
        if not isinstance(out, torch.Tensor):
            loss = getattr(out, "loss", None)
            if loss is None and isinstance(out, dict):
                loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = _describe(out) if loss_fn is None else f"loss_fn returned {_describe(loss)}"
        raise (NoLossError if loss_fn is None else ShardingError)(
            f"the training step needs a scalar loss; the model output is {got}" if loss_fn is None else
            f"the training step needs a scalar loss; {got}",
            fix="pass loss_fn=lambda output, *targets: <scalar>, e.g. "
                "lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())",
        )
    if not loss.is_floating_point():
        raise ShardingError(f"the loss must be floating point, got {loss.dtype}", fix="return a float loss")
    return loss


@dataclass
class TracedStep(Traced):
    """The joint forward+backward graph: outputs ``(loss, *grads of grad_names)``."""

    grad_names: list[str] = field(default_factory=list)  # parameters with a gradient output, in output order
    unused_params: list[str] = field(default_factory=list)  # require grad, but the loss does not use them

    @property
    def grad_nodes(self) -> dict[str, Any]:
        """Gradient node per parameter that requires grad (None: unused by the loss)."""
        nodes = dict(zip(self.grad_names, self.output_nodes()[1:]))
        return {n: nodes.get(n) for n, rg in zip(self.args.param_names, self.args.param_requires_grad) if rg}

    def summary(self) -> str:
        unused = f", {len(self.unused_params)} unused" if self.unused_params else ""
        return f"joint forward+backward: {super().summary()}; outputs: loss + {len(self.grad_names)} grads{unused}"

    def flat_args(self, params: dict, buffers: dict, inputs: tuple, targets: tuple = (),
                  kwargs: dict | None = None) -> list:
        return self.args.flat(params, buffers, inputs, kwargs, targets)

    def split_outputs(self, outs: list) -> tuple[torch.Tensor, dict]:
        """Graph outputs -> (loss, {param name: grad or None})."""
        grads = dict(zip(self.grad_names, outs[1:]))
        return outs[0], {n: grads.get(n) for n, rg in zip(self.args.param_names, self.args.param_requires_grad) if rg}

    @cached_property
    def grad_outputs(self) -> tuple:
        """(parameter name, output index) of each gradient, in parameter order: ``split_outputs`` by
        position, less the parameters unused by the loss (no output, their gradient None)."""
        at = {n: i for i, n in enumerate(self.grad_names, 1)}
        return tuple((n, at[n]) for n, rg in zip(self.args.param_names, self.args.param_requires_grad)
                     if rg and n in at)

    @cached_property
    def grad_indices(self) -> tuple:
        """The output indices of ``grad_outputs``, in its order."""
        return tuple(i for _, i in self.grad_outputs)

    def run(self, model: torch.nn.Module, inputs: tuple, targets: tuple = (),
            kwargs: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Run the graph on the model's real parameters/buffers: (loss, {name: grad or None})."""
        flat = self.flat_args(dict(model.named_parameters()), dict(model.named_buffers()), inputs, targets, kwargs)
        with torch.no_grad():
            outs = self.gm(*flat)
        return self.split_outputs(outs)


def trace_step(model: torch.nn.Module, example_inputs: tuple, example_targets: tuple = (),
               loss_fn: Callable | None = None, *, example_kwargs: dict | None = None, precision=None,
               recompute: str = "none", stamp: bool = True) -> TracedStep:
    """Trace ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)`` and its
    gradients w.r.t. every parameter that requires grad into one functional aten graph.
    ``precision``: a MixedPrecision policy (trace/precision.py); ``recompute``: which activations
    backward recomputes (trace/recompute.py: "none", "blocks", "selective"; regions the model
    checkpoints itself with torch.utils.checkpoint are recomputed whatever it says); ``stamp``:
    a long list of identical blocks is traced with five of them and the rest stamped
    (trace/stamp.py: the same graph, in a fraction of the time; False traces every block)."""
    args, real = Arguments.of(model, example_inputs, example_kwargs, example_targets)
    dtypes = traced_dtypes(args.param_names, real, precision)
    anchor(loss_fn)
    fake = args.fake(real, grads=True, dtypes=dtypes)
    with model_as_found(model):  # the forward's own caches on the module, fake while traced, put back
        stamped = stamped_trace(model, args, fake, (example_inputs, example_kwargs, example_targets),
                                lambda a: _forward_loss(model, a, loss_fn, precision),
                                lambda a, record: _step(model, a, loss_fn, precision, record), precision,
                                recompute=recompute) if stamp else None
        if stamped is None:
            record: dict = {}
            gm, notes = finish(_step(model, args, loss_fn, precision, record), args, fake, buffers=True, recompute=recompute)
            grad_names, unused = record["grad_names"], record["unused"]
        else:
            gm, notes, made = stamped
            grad_names = made.full_grads()
            have = set(grad_names)
            unused = [n for n, rg in zip(args.param_names, args.param_requires_grad) if rg and n not in have]
    mark_masters(gm, dtypes, real)
    notes += cast_gradients(gm, list(range(1, 1 + len(grad_names))), precision and precision.reduce)
    gm.recompile()
    outputs = [OutputRole(LOSS)] + [OutputRole(GRAD, n) for n in grad_names]
    outputs += [OutputRole(BUFFER, n) for n in gm.meta.get("buffer_updates", [])]
    return TracedStep(gm, args, outputs, notes, grad_names, unused)


def _step(model: torch.nn.Module, args: Arguments, loss_fn, precision, record: dict) -> Callable:
    """The function make_fx traces: flat arguments -> (loss, *gradients); ``record`` gets the
    names of the parameters with a gradient (``grad_names``) and without (``unused``)."""
    def step(*flat):
        params, buffers, a, kw, targets = args.split(flat)
        a, kw = cast_inputs((a, kw), precision)
        # the module reads the graph's parameters until the gradients are taken: a region the model
        # checkpoints (torch.utils.checkpoint) runs its forward again inside backward, and must
        # read them there too, not the module's own tensors (which make_fx would bake in as constants)
        with _reparametrize_module(model, {**params, **buffers}, tie_weights=True), checkpoint_recompute():
            with module_scope(model):
                out = cast_outputs(model(*a, **kw), precision)
            loss, grads = _differentiate(out, loss_fn, targets, args, params)
        record["grad_names"] = [n for n, g in zip(grads[0], grads[1]) if g is not None]
        record["unused"] = [n for n, g in zip(grads[0], grads[1]) if g is None]
        return (loss, *[g for g in grads[1] if g is not None])
    return step


def _forward_loss(model: torch.nn.Module, args: Arguments, loss_fn, precision) -> Callable:
    """Flat arguments -> the loss, forward only (what stamp.fingerprint records)."""
    def run(flat):
        params, buffers, a, kw, targets = args.split(flat)
        a, kw = cast_inputs((a, kw), precision)
        with _reparametrize_module(model, {**params, **buffers}, tie_weights=True):
            return select_loss(cast_outputs(model(*a, **kw), precision), loss_fn, targets)
    return run


def _differentiate(out, loss_fn, targets: tuple, args: Arguments, params: dict) -> tuple:
    """(loss, (names, their gradients or None)) of the model output ``out``."""
    loss = select_loss(out, loss_fn, targets)
    wanted = [n for n in args.param_names if params[n].requires_grad]
    if not wanted:
        raise ShardingError("no parameter requires grad: there is nothing to train",
                            fix="use trace_forward for inference, or set requires_grad=True")
    if not loss.requires_grad:
        raise ShardingError("the loss does not depend on any parameter that requires grad",
                            fix="check that loss_fn uses the model output")
    with backward_provenance(loss):
        grads = torch.autograd.grad(loss, [params[n] for n in wanted], allow_unused=True)
    return loss, (wanted, grads)
