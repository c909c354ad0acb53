"""Tracing: joint forward+backward and forward graphs of the zoo models, checked against eager.

    python -m pytest tests/trace/test_trace.py -q
"""
from __future__ import annotations

import collections
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import shardwise
from shardwise.rules.registry import OpCall, TensorMeta
from shardwise.trace import (BUFFER, GRAD, INPUT, LOSS, PARAM, TARGET, select_loss, source_line, trace_forward,
                             trace_step)
from shardwise.trace.normalize import is_mutable
from tests.models import zoo

NAMES = list(zoo.MODELS)
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def forwards():
    cache = {}

    def get(name, dtype):
        if (name, dtype) not in cache:
            case = zoo.cached(name, dtype)
            cache[name, dtype] = trace_forward(case.model, case.example_inputs)
        return cache[name, dtype]
    return get


def eager_step(case):
    model = case.model
    model.zero_grad(set_to_none=True)
    loss = select_loss(model(*case.example_inputs), case.loss_fn, case.example_targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_close_rel(got, want, dtype, what):
    """bf16 gradients are compared relative to the tensor's largest entry."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tol(dtype), msg=lambda m: f"{what}: {m}")
    else:
        scale = want.float().abs().max().clamp_min(1e-3)
        err = (got.float() - want.float()).abs().max() / scale
        assert err < 3e-2, f"{what}: relative error {err:.3g}"


# -- joint graph ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_joint_graph_is_functional_and_complete(name, dtype):
    case = zoo.cached(name, dtype)
    ts = zoo.cached_step(name, dtype)
    assert not [n for n in ts.call_nodes() if is_mutable(n.target)]
    params = [n for n, p in case.model.named_parameters()]
    assert ts.grad_names == params and not ts.unused_params
    assert [o.kind for o in ts.outputs] == [LOSS] + [GRAD] * len(params)
    assert [o.name for o in ts.outputs[1:]] == params
    outs = ts.output_nodes()
    assert outs[0].meta["val"].numel() == 1
    for (pname, p), node in zip(case.model.named_parameters(), outs[1:]):
        assert tuple(node.meta["val"].shape) == tuple(p.shape), pname
    assert set(ts.grad_nodes) == set(params)
    kinds = collections.Counter(r.kind for r in ts.placeholders)
    assert kinds[PARAM] == len(params) and kinds[BUFFER] == len(list(case.model.buffers()))
    # the backward is there: ops tagged as autograd backward exist
    assert any(n.meta.get("autograd_backward") for n in ts.call_nodes())
    assert str(ts).startswith("# stage: trace\n")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_joint_graph_matches_eager(name, dtype):
    case = zoo.cached(name, dtype)
    ts = zoo.cached_step(name, dtype)
    loss, grads = ts.run(case.model, case.example_inputs, case.example_targets)
    want_loss, want_grads = eager_step(case)
    torch.testing.assert_close(loss, want_loss, **tol(dtype))
    assert set(grads) == set(want_grads)
    for n, g in grads.items():
        assert g.dtype == want_grads[n].dtype
        assert_close_rel(g, want_grads[n], dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_forward_graph_matches_eager(name, dtype, forwards):
    case = zoo.cached(name, dtype)
    tf = forwards(name, dtype)
    assert not [n for n in tf.call_nodes() if is_mutable(n.target)]
    assert not any(n.meta.get("autograd_backward") for n in tf.call_nodes())
    got = tf.run(case.model, case.example_inputs)
    with torch.no_grad():
        want = case.model(*case.example_inputs)
    assert type(got) is type(want)
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    assert g_spec == w_spec
    for g, w in zip(g_leaves, w_leaves):
        torch.testing.assert_close(g, w, **tol(dtype))


def test_hf_output_is_rebuilt_as_model_output(forwards):
    case = zoo.cached("gpt2")
    out = forwards("gpt2", torch.float32).run(case.model, case.example_inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.loss.ndim == 0 and out.logits.shape == (2, 8, 64)


@pytest.mark.parametrize("name", NAMES)
def test_node_call_for_every_node(name):
    ts = zoo.cached_step(name, torch.float32)
    for n in ts.call_nodes():
        call = ts.node_call(n)
        assert isinstance(call, OpCall) and call.op is n.target
        vals = n.meta["val"] if isinstance(n.meta["val"], (tuple, list)) else [n.meta["val"]]
        metas = [TensorMeta.of(v) if isinstance(v, torch.Tensor) else None for v in vals]
        assert list(call.outs) == metas, n.name


def test_hf_input_roles_are_named():
    ts = zoo.cached_step("gpt2", torch.float32)
    inputs = [r for r in ts.placeholders if r.kind == INPUT]
    labels_at = list(inspect.signature(zoo.cached("gpt2").model.forward).parameters).index("labels")
    assert [(r.name, r.path) for r in inputs] == [("input_ids", (0,)), ("labels", (labels_at,))]
    names = [n.name for n in ts.placeholder_nodes()]
    assert "input_ids" in names and "labels" in names and "p_transformer_wte_weight" in names


def test_transformer_uses_sdpa_and_graph_reads_well():
    ts = zoo.cached_step("transformer", torch.float32)
    ops = {str(op) for op in ts.ops()}
    # torch's CPU flash kernels, mapped onto the one attention op the planner has a rule for
    assert "shardwise.attention.default" in ops and "shardwise.attention_backward.default" in ops
    assert not any("scaled_dot_product" in op for op in ops)
    assert any("_scaled_dot_product_flash_attention_for_cpu.default) -> shardwise.attention" in n for n in ts.notes)
    text = str(ts)
    assert "def forward(self, p_tok_weight, p_pos_weight," in text and "idx, target_0)" in text


def test_source_lines_forward_and_backward():
    ts = zoo.cached_step("transformer", torch.float32)
    sdpa = [n for n in ts.call_nodes() if "shardwise.attention" in str(n.target)]
    fwd, bwd = sdpa[0], sdpa[-1]
    assert "zoo.py" in source_line(fwd) and "scaled_dot_product_attention" in source_line(fwd)
    assert source_line(bwd) == source_line(fwd) + " (backward)"
    loss = [n for n in ts.call_nodes() if "nll_loss_forward" in str(n.target)][0]
    assert "cross_entropy" in (source_line(loss) or "")


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_source_lines_recorded_once_per_call_equal_make_fxs(name, monkeypatch):
    """trace/provenance.forward_lines records one frame per torch call instead of make_fx's whole
    stack per node: every node's source line (forward, backward, accumulation, loss) is the one
    make_fx's own record gives."""
    import contextlib

    from shardwise.trace import capture
    from shardwise.trace.joint import trace_step

    def lines():
        c = getattr(zoo, name)()
        ts = trace_step(c.model, c.example_inputs, c.example_targets, c.loss_fn)
        return [(n.name, source_line(n)) for n in ts.gm.graph.nodes]

    fast = lines()
    monkeypatch.setattr(capture, "forward_lines", contextlib.nullcontext)
    assert fast == lines()
    assert sum(line is not None and "modeling_" in line for _, line in fast) > len(fast) // 2


# -- model on the meta device, dropout, errors ---------------------------------------------------
def test_meta_device_model_traces_with_fake_tensors():
    with torch.device("meta"):
        model = zoo.TinyLM()
    _, inputs, targets, loss_fn = zoo.cached("transformer")
    ts = trace_step(model, inputs, targets, loss_fn)
    assert {n.meta["val"].device.type for n in ts.placeholder_nodes()} == {"cpu"}
    ref = zoo.cached_step("transformer", torch.float32)
    assert collections.Counter(map(str, (n.target for n in ts.call_nodes()))) == \
        collections.Counter(map(str, (n.target for n in ref.call_nodes())))


def test_meta_device_hf_llama_traces():
    from transformers import LlamaForCausalLM

    case = zoo.cached("llama")
    with torch.device("meta"):
        model = LlamaForCausalLM(case.model.config)
    ts = trace_step(model, case.example_inputs)
    assert len(ts.grad_names) == len(list(model.parameters()))
    assert any(r.kind == BUFFER and r.name.endswith("inv_freq") for r in ts.placeholders)


def test_dropout_stays_a_random_op_and_matches_eager_with_same_seed():
    case = zoo.gpt2(dropout=True)
    ts = trace_step(*case)
    ops = {str(op) for op in ts.ops()}
    assert ops & {"aten.bernoulli.p", "aten.native_dropout.default"}, ops
    assert not [n for n in ts.call_nodes() if is_mutable(n.target)]
    torch.manual_seed(7)
    loss, _ = ts.run(case.model, case.example_inputs)
    torch.manual_seed(7)
    want = case.model(*case.example_inputs).loss
    torch.testing.assert_close(loss, want.detach())


class BNNet(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, **kw)

    def forward(self, x):
        return self.bn(self.fc(x)).square().mean()


def test_forward_returns_updated_buffers():
    """A forward-only trace in training mode returns BatchNorm's new running statistics after
    the model's outputs; rebuild() leaves them out. In eval mode nothing is written."""
    torch.manual_seed(0)
    model, x = BNNet(), torch.randn(3, 4)
    tf = trace_forward(model, (x,))
    flat = tf.flat_args(dict(model.named_parameters()), dict(model.named_buffers()), (x,))
    with torch.no_grad():
        outs = tf.gm(*flat)
    new = tf.buffer_updates(outs)
    torch.testing.assert_close(tf.rebuild(outs), model(x))  # eager: updates the buffers in place
    assert sorted(new) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    for name, value in model.named_buffers():
        torch.testing.assert_close(new[name], value)
    model = BNNet().eval()
    ts = trace_step(model, (torch.randn(3, 4),))
    assert not [n for n in ts.call_nodes() if is_mutable(n.target)]


def test_step_returns_updated_buffers():
    """A training step returns BatchNorm's new running statistics (and num_batches_tracked) as
    extra outputs, equal to what eager training writes into the buffers."""
    torch.manual_seed(0)
    model, x = BNNet(), torch.randn(3, 4)
    ts = trace_step(model, (x,))
    assert sorted(r.name for r in ts.outputs if r.kind == "buffer") == ["bn.num_batches_tracked",
                                                                       "bn.running_mean", "bn.running_var"]
    assert not [n for n in ts.call_nodes() if is_mutable(n.target)]
    flat = ts.flat_args(dict(model.named_parameters()), dict(model.named_buffers()), (x,))
    with torch.no_grad():
        new = ts.buffer_updates(ts.gm(*flat))
    model(x)  # eager: updates the buffers in place
    for name, value in model.named_buffers():
        torch.testing.assert_close(new[name], value)


def test_input_mutation_is_reported():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x).sum()

    with pytest.raises(shardwise.ShardingError, match="input 'x'"):
        trace_step(Writes(), (torch.randn(2, 4),))


def test_non_scalar_output_needs_loss_fn():
    model, inputs, targets, _ = zoo.cached("mlp")
    with pytest.raises(shardwise.ShardingError, match="loss_fn"):
        trace_step(model, inputs)
    with pytest.raises(shardwise.ShardingError, match="loss_fn is None"):
        trace_step(model, inputs, targets)


class Nested(nn.Module):
    """Inputs as a pytree with a non-tensor leaf; outputs as a dict with a tuple."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.unused = nn.Linear(2, 2)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, batch, scale, extra=None):
        h = self.a(batch["x"]) * scale + self.b(batch["pair"][1]) * self.frozen
        return {"h": h, "both": (h.sum(), scale)}


def nested_inputs():
    g = torch.Generator().manual_seed(0)
    return ({"x": torch.randn(2, 4, generator=g), "pair": (None, torch.randn(2, 4, generator=g))}, 0.5)


def test_pytree_inputs_roles_constants_and_unused_params():
    model, inputs = Nested(), nested_inputs()
    ts = trace_step(model, inputs, loss_fn=lambda out: out["both"][0])
    ins = [(r.name, r.path) for r in ts.placeholders if r.kind == INPUT]
    assert ins == [("batch", (0, "pair", 1)), ("batch", (0, "x"))] or ins == [("batch", (0, "x")), ("batch", (0, "pair", 1))]
    assert all(not r.is_top_level for r in ts.placeholders if r.kind == INPUT)
    frozen = [r for r in ts.placeholders if r.name == "frozen"][0]
    assert frozen.kind == PARAM and not frozen.requires_grad
    assert ts.unused_params == ["unused.weight", "unused.bias"]
    loss, grads = ts.run(model, inputs)
    assert "frozen" not in grads and grads["unused.weight"] is None
    want = model(*inputs)["both"][0]
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert (grads[n] is None) == (p.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(grads[n], p.grad)
    with pytest.raises(shardwise.ShardingError, match="constant 0.5"):
        ts.run(model, (inputs[0], 0.25))


def test_forward_rebuilds_dicts_tuples_and_constants():
    model, inputs = Nested(), nested_inputs()
    tf = trace_forward(model, inputs)
    out = tf.run(model, inputs)
    want = model(*inputs)
    assert out["both"][1] == 0.5 and isinstance(out["both"], tuple)
    torch.testing.assert_close(out["h"], want["h"])
    torch.testing.assert_close(out["both"][0], want["both"][0])


def test_example_kwargs_and_target_roles():
    model, (x,), (y,), loss_fn = zoo.cached("mlp")
    ts = trace_step(model, (), (y,), loss_fn, example_kwargs={"x": x})
    roles = [(r.kind, r.name, r.path) for r in ts.placeholders if r.kind in (INPUT, TARGET)]
    assert roles == [(INPUT, "x", ("x",)), (TARGET, None, (0,))]
    loss, _ = ts.run(model, (), (y,), kwargs={"x": x})
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach())


class WithConstants(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.plain = torch.arange(3.0)  # a tensor attribute, neither parameter nor buffer

    def forward(self, x):
        torch._assert_async((x.abs() >= 0).all())
        return (self.fc(x) * self.plain + torch.tensor([1.0, 2.0, 3.0])).sum()


def test_asserts_stripped_and_constants_kept():
    model, x = WithConstants(), torch.randn(2, 3)
    ts = trace_step(model, (x,))
    assert not any("_assert" in str(op) for op in ts.ops())
    assert any("_assert_async" in note for note in ts.notes)
    consts = ts.constants()
    assert len(consts) == 2 and any(torch.equal(c, model.plain) for c in consts.values())
    loss, grads = ts.run(model, (x,))
    want = model(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(grads["fc.weight"], model.fc.weight.grad)
