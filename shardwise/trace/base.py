"""What both traces share: the flat argument list, its roles, and the traced artifact."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx

from ..core.errors import ShardingError
from .attention import map_attention
from .index_rows import map_aligned_index
from .buffers import buffer_updates
from .capture import capture, fakeify, new_fake_mode, pick_device
from .normalize import aten_ops, check_functional, merge_duplicates, node_call, remove_dead, rename_placeholders, strip_asserts
from .provenance import source_line
from .recompute import recompute_blocks, tag_checkpointed
from .regather import views_again_in_backward
from .roles import BUFFER, PARAM, FlatTree, OutputRole, PlaceholderRole, flatten, input_roles, target_roles


# Meta of a parameter placeholder that stays gathered from forward into backward (Traced.keep_gathered)
KEEP_GATHERED = "sw_keep_gathered"


@dataclass
class Arguments:
    """The graph's flat argument list: params, buffers, input tensors, target tensors, in that order."""

    param_names: list[str]
    param_requires_grad: list[bool]
    buffer_names: list[str]
    inputs: FlatTree  # of (args tuple, kwargs dict)
    targets: FlatTree  # of the targets tuple
    roles: list[PlaceholderRole]

    @staticmethod
    def of(model: torch.nn.Module, args: tuple, kwargs: dict | None, targets: tuple) -> tuple["Arguments", list]:
        if not isinstance(args, tuple):
            raise ShardingError(f"example_inputs must be a tuple (for model(*inputs)), got {type(args).__name__}",
                                fix="wrap a single input as (x,)")
        if not isinstance(targets, (tuple, list)):
            raise ShardingError(f"example_targets must be a tuple (loss_fn(output, *targets)), got "
                                f"{type(targets).__name__}", fix="wrap a single target as (y,)")
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        inputs = flatten((args, dict(kwargs or {})))
        tflat = flatten(tuple(targets))
        roles = ([PlaceholderRole(PARAM, n, (), p.requires_grad) for n, p in params.items()]
                 + [PlaceholderRole(BUFFER, n) for n in buffers]
                 + input_roles(model, inputs) + target_roles(tflat))
        a = Arguments(list(params), [p.requires_grad for p in params.values()], list(buffers), inputs, tflat, roles)
        real = list(params.values()) + list(buffers.values()) + inputs.tensors + tflat.tensors
        return a, real

    @property
    def state_names(self) -> list:
        """Per flat argument: its parameter or buffer name, None for an input or target."""
        n_in = len(self.roles) - len(self.param_names) - len(self.buffer_names)
        return [*self.param_names, *self.buffer_names, *[None] * n_in]

    def fake(self, real: list[torch.Tensor], *, grads: bool, dtypes: list | None = None) -> list[torch.Tensor]:
        """Fake versions on one device (the inputs' device first); params require grad only if
        ``grads``; ``dtypes``: per argument, another dtype to trace it in (trace/precision.py)."""
        n_state = len(self.param_names) + len(self.buffer_names)
        device = pick_device(real[n_state:], real[:n_state])
        rg = [grads and g for g in self.param_requires_grad] + [False] * (len(real) - len(self.param_names))
        return fakeify(real, new_fake_mode(real[n_state:]), device, rg, dtypes)

    def split(self, flat) -> tuple[dict, dict, tuple, dict, tuple]:
        """Flat tensors -> (params, buffers, args, kwargs, targets) with constants re-inserted."""
        flat = list(flat)
        np_, nb = len(self.param_names), len(self.buffer_names)
        ni = len(self.inputs.tensor_idx)
        params = dict(zip(self.param_names, flat[:np_]))
        buffers = dict(zip(self.buffer_names, flat[np_:np_ + nb]))
        args, kwargs = self.inputs.rebuild(flat[np_ + nb:np_ + nb + ni])
        targets = self.targets.rebuild(flat[np_ + nb + ni:])
        return params, buffers, tuple(args), dict(kwargs), tuple(targets)

    def flat(self, params: dict, buffers: dict, args: tuple, kwargs: dict | None, targets: tuple) -> list:
        """The graph's arguments from real values, checking that baked-in constants did not change."""
        inputs = flatten((tuple(args), dict(kwargs or {})))
        tflat = flatten(tuple(targets))
        for what, traced, now in (("inputs", self.inputs, inputs), ("targets", self.targets, tflat)):
            _check_same_structure(what, traced, now)
        try:
            state = [params[n] for n in self.param_names] + [buffers[n] for n in self.buffer_names]
        except KeyError as e:
            raise ShardingError(f"missing parameter or buffer {e.args[0]!r} for the traced graph") from None
        return state + inputs.tensors + tflat.tensors


def _check_same_structure(what: str, traced: FlatTree, now: FlatTree) -> None:
    if traced.spec != now.spec or traced.tensor_idx != now.tensor_idx:
        raise ShardingError(f"{what} do not have the structure they were traced with:\n  traced: {traced.spec}\n"
                            f"  given:  {now.spec}", fix="trace again with example inputs of this structure")
    for i, (a, b) in enumerate(zip(traced.leaves, now.leaves)):
        if i in traced.tensor_idx:
            continue
        try:
            same = a is b or bool(a == b)
        except Exception:  # noqa: BLE001 - objects without a usable ==
            same = False
        if not same:
            raise ShardingError(f"non-tensor {what} leaf {i} was traced as the constant {a!r}, got {b!r}",
                                fix="non-tensor inputs are baked into the graph: trace again with the new value")


@dataclass
class Traced:
    """A traced graph and what its placeholders and outputs stand for."""

    gm: fx.GraphModule
    args: Arguments
    outputs: list[OutputRole]
    notes: list[str] = field(default_factory=list)

    STAGE = "trace"

    @property
    def placeholders(self) -> list[PlaceholderRole]:
        return self.args.roles

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholder_nodes(self) -> list[fx.Node]:
        return list(self.gm.graph.find_nodes(op="placeholder"))

    def keep_gathered(self, params) -> None:
        """Mark the placeholders of the parameters in ``params`` (names) as kept gathered from
        forward into backward (parallelize's reshard_after_forward): search/paths.move_key then
        lets their backward readers reuse the forward copy."""
        for node, role in zip(self.placeholder_nodes(), self.placeholders):
            node.meta[KEEP_GATHERED] = role.kind == PARAM and role.name in params

    def output_nodes(self) -> list[Any]:
        (out,) = self.gm.graph.find_nodes(op="output")
        return list(out.args[0])

    def buffer_updates(self, outs) -> dict:
        """Graph outputs -> {buffer name: its value after the call} (BatchNorm running statistics
        in training mode; trace/buffers.py)."""
        return {r.name: o for r, o in zip(self.outputs, outs) if r.kind == BUFFER}

    @cached_property
    def buffer_outputs(self) -> tuple:
        """(buffer name, output index) of each buffer the call updates: ``buffer_updates`` by position."""
        return tuple((r.name, i) for i, r in enumerate(self.outputs) if r.kind == BUFFER)

    def ops(self) -> set:
        """The aten op overloads in the graph (getitem excluded)."""
        return aten_ops(self.gm)

    def constants(self) -> dict[str, torch.Tensor]:
        """Tensors baked into the graph (get_attr nodes): tensor attributes of the model that are
        not parameters/buffers, and tensors built from data inside forward (``torch.tensor``)."""
        return {n.target: getattr(self.gm, n.target) for n in self.gm.graph.find_nodes(op="get_attr")}

    def call_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function"]

    node_call = staticmethod(node_call)
    source_line = staticmethod(source_line)

    def summary(self) -> str:
        kinds = [r.kind for r in self.placeholders]
        return (f"{len(self.call_nodes())} ops; placeholders: {kinds.count('param')} params, {kinds.count('buffer')} "
                f"buffers, {kinds.count('input')} inputs, {kinds.count('target')} targets")

    def __str__(self) -> str:
        head = [f"# stage: {self.STAGE}", f"# {self.summary()}"] + [f"# normalise: {n}" for n in self.notes]
        return "\n".join(head) + "\n" + self.gm.code.strip() + "\n"


def finish(fn, args: Arguments, fake: list, buffers: bool = False,
           recompute: str = "none", stamp=None) -> tuple[fx.GraphModule | None, list[str]]:
    """Trace, check functional, strip asserts and dead nodes, name placeholders. ``buffers``:
    buffer updates (BatchNorm running statistics) become extra outputs (trace/buffers.py);
    ``recompute``: activation checkpointing's policy (trace/recompute.py); ``stamp``: ``fn``
    runs a shortened model whose graph this stamp.Stamp makes the full one of ``args`` (None
    returned where it cannot)."""
    notes: list[str] = [] if stamp is None else list(stamp.repeats.notes)
    gm = capture(fn, fake, notes, stamp and stamp.graph)
    if gm is None:
        return None, notes
    if buffers:
        buffer_updates(gm, args.roles)
    check_functional(gm, args.roles)
    notes += map_attention(gm) + map_aligned_index(gm) + strip_asserts(gm) + merge_duplicates(gm)
    notes += tag_checkpointed(gm) + recompute_blocks(gm, recompute)
    notes += views_again_in_backward(gm, args.roles) + remove_dead(gm)
    rename_placeholders(gm, args.roles)
    gm.recompile()
    return gm, notes
