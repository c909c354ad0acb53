"""Stamped traces (trace/stamp.py): a model with a long list of identical blocks is traced with
five of them and the rest stamped; the graph must be the one tracing every block gives, node for
node (names, ops, arguments, module paths, source lines, backward and recompute marks, values'
shapes, strides and dtypes), with the same notes, gradients and outputs. Where the blocks differ
(alternating attention, a per-layer constant, a global that counts the blocks) nothing is stamped
and the trace is the full one.

    python -m pytest tests/trace/test_stamp.py -q                 # representative models
    python -m pytest tests/trace/test_stamp.py -q -m slow         # every Hugging Face family
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import shardwise as sw
from shardwise.trace import trace_forward, trace_step
from shardwise.trace.provenance import module_path
from shardwise.trace.stamp import MIN_BLOCKS, find_repeats
from tests.models import zoo

LAYERS = MIN_BLOCKS + 1
STAMPED = "trace/stamp.py"
# families whose layers differ, so that nothing may be stamped: Gemma 2 alternates sliding and
# global attention, Gemma 3 makes one layer in six global, T5's first layer alone holds the
# relative position bias that the others read
NOT_STAMPED = {"gemma2", "gemma3", "t5"}


def _node(n) -> tuple:
    val = n.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return (n.name, n.op, str(n.target), str(n.args), str(n.kwargs), module_path(n), n.meta.get("stack_trace"),
            n.meta.get("autograd_backward"), n.meta.get("gradient_accumulation"), str(n.meta.get("custom")),
            n.meta.get("sw_recompute"),
            [(tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v for v in vals])


def stamped(traced) -> bool:
    return any(STAMPED in note for note in traced.notes)


def assert_same_trace(case, expect_stamped: bool, **kwargs):
    """The stamped trace of ``case`` is the full one, node for node."""
    got = trace_step(*case, **kwargs)
    full = trace_step(*case, stamp=False, **kwargs)
    assert stamped(got) == expect_stamped, got.notes
    assert not stamped(full)
    assert [n for n in got.notes if STAMPED not in n] == full.notes
    assert (got.grad_names, got.unused_params, got.outputs) == (full.grad_names, full.unused_params, full.outputs)
    a, b = list(got.gm.graph.nodes), list(full.gm.graph.nodes)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert _node(x) == _node(y), (x.format_node(), y.format_node())
    assert got.gm.code == full.gm.code
    return got


def test_stamped_graph_is_the_full_trace():
    assert_same_trace(zoo.llama(layers=LAYERS), True)


def test_random_ops_keep_their_order():
    """Dropout (bernoulli, functionalised) in every block: the stamped copies draw in the full trace's order."""
    got = assert_same_trace(zoo.gpt2(dropout=True, layers=LAYERS), True)
    assert sum("bernoulli" in str(n.target) for n in got.gm.graph.nodes) >= LAYERS


def test_mixed_precision_and_recompute():
    bf16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    got = assert_same_trace(zoo.llama(layers=LAYERS), True, precision=bf16, recompute="selective")
    assert any(n.meta.get("sw_recompute") for n in got.gm.graph.nodes)


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_the_models_own_checkpointing(name):
    """Hugging Face's activation checkpointing; Bloom's eager attention chains are mapped in forward
    and again in the recomputation (trace/eager_attention._recomputed_in), counted once in the note."""
    case = zoo.FAMILIES[name](layers=LAYERS)
    case.model.activation_checkpointing_enable()
    got = assert_same_trace(case, True)
    if name == "bloom":
        assert sum(n.target is torch.ops.shardwise.attention.default for n in got.gm.graph.nodes) == 2 * LAYERS
        assert any(note.startswith(f"attention: {LAYERS} eager attention chain(s)") for note in got.notes), got.notes


def test_stamped_step_computes_eager_loss_and_gradients():
    """Not only the full trace's graph: the stamped graph run on real weights gives eager autograd's
    loss and gradients (float32, rtol 1e-4)."""
    case = zoo.llama(layers=LAYERS)
    traced = trace_step(*case)
    assert stamped(traced)
    loss, grads = traced.run(case.model, case.example_inputs)
    case.model.zero_grad()
    eager = case.model(*case.example_inputs).loss
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-4, atol=1e-6)
    for name, p in case.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def assert_same_forward(case, expect_stamped: bool, **kwargs):
    """The stamped forward-only trace (an inference plan's) of ``case`` is the full one, node for
    node, and returns the eager model's outputs."""
    got = trace_forward(case.model, case.example_inputs, **kwargs)
    full = trace_forward(case.model, case.example_inputs, stamp=False, **kwargs)
    assert stamped(got) == expect_stamped, got.notes
    assert [n for n in got.notes if STAMPED not in n] == full.notes
    assert got.outputs == full.outputs and got.out.paths == full.out.paths
    a, b = list(got.gm.graph.nodes), list(full.gm.graph.nodes)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert _node(x) == _node(y), (x.format_node(), y.format_node())
    assert got.gm.code == full.gm.code
    with torch.no_grad():
        eager = case.model(*case.example_inputs, **kwargs.get("example_kwargs", {}))
    ran = got.run(case.model, case.example_inputs, kwargs.get("example_kwargs"))
    (ran, ran_spec), (eager, eager_spec) = tree_flatten(ran), tree_flatten(eager)
    assert ran_spec == eager_spec
    for x, y in zip(ran, eager, strict=True):
        if isinstance(y, torch.Tensor):  # (an eager attention chain run as the op rounds otherwise: Gemma 2's
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)  # 9 layers, 3e-6 on logits of ~1e-2)
        else:
            assert x == y
    return got


@pytest.mark.parametrize("build", [zoo.llama, zoo.gpt2], ids=["llama", "gpt2"])
def test_forward_only_trace_is_stamped_as_the_full_one(build):
    assert_same_forward(build(layers=LAYERS), True)


def test_forward_only_with_every_layers_output_is_traced_in_full():
    """``output_hidden_states=True`` returns one tensor per block (a template's node among the
    outputs stops the stamp); a model returning its depth, a constant leaf of the output, would
    return the short model's (the fingerprint compares what each run returned): nothing stamped."""
    got = assert_same_forward(zoo.llama(layers=LAYERS), False, example_kwargs={"output_hidden_states": True})
    assert len(got.outputs) > LAYERS
    got = assert_same_forward(_stack_case(returns_depth=True), False)
    assert got.out.rebuild([torch.zeros(1)])[1] == LAYERS


class _GradScale(torch.autograd.Function):
    """Identity forward; backward scales the gradient: a difference only backward shows."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class Scaled(nn.Module):
    """A residual block with a constant that depends on its layer index (GPT-2's
    scale_attn_by_inverse_layer_idx), in forward or in backward only."""

    def __init__(self, i: int, dim: int = 16, backward_only: bool = False):
        super().__init__()
        self.i, self.lin, self.backward_only = i, nn.Linear(dim, dim), backward_only

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.backward_only:
            return x + _GradScale.apply(y, 1.0 / (self.i + 1))
        return x + y / (self.i + 1)


class Stack(nn.Module):
    def __init__(self, layers: int = LAYERS, dim: int = 16, per_layer: bool = False, by_depth: bool = False,
                 backward_only: bool = False, returns_depth: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(i if per_layer else 0, dim, backward_only) for i in range(layers))
        self.by_depth, self.returns_depth = by_depth, returns_depth

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = x / len(self.blocks) if self.by_depth else x
        return (x, len(self.blocks)) if self.returns_depth else x


def _stack_case(**kw):
    torch.manual_seed(0)
    return zoo.Case(Stack(**kw), (torch.randn(4, 16),), (torch.randn(4, 16),), zoo.mse_loss)


@pytest.mark.parametrize("kw, expect", [({}, True), ({"per_layer": True}, False), ({"by_depth": True}, False),
                                       ({"per_layer": True, "backward_only": True}, False)],
                         ids=["alike", "per-layer-constant", "divides-by-depth", "differs-in-backward-only"])
def test_blocks_that_differ_are_traced_in_full(kw, expect):
    assert_same_trace(_stack_case(**kw), expect)


def test_the_list_is_restored_and_short_lists_are_left_alone():
    case = _stack_case()
    blocks = case.model.blocks
    trace_step(*case)
    assert case.model.blocks is blocks and len(blocks) == LAYERS
    assert find_repeats(Stack(layers=MIN_BLOCKS - 1)) is None
    assert find_repeats(case.model).prefix == "blocks"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in {**zoo.FAMILIES, **zoo.MORE_FAMILIES} if n != "llama"])
def test_every_family_stamps_the_full_trace(name):
    build = {**zoo.FAMILIES, **zoo.MORE_FAMILIES}[name]
    assert_same_trace(build(layers=LAYERS), name not in NOT_STAMPED)
    assert_same_forward(build(layers=LAYERS), name not in NOT_STAMPED)
