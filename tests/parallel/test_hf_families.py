"""Every Hugging Face family of the zoo (GPT-2, Llama, BERT, RoBERTa, T5, Gemma 2, Falcon, Bloom):
the plan's figures (``stats()``, ``summary()``) under data parallelism on 2 and 3 ranks; and
sequence parallelism, exact against one device, for the models whose attention modifies its
scores: Gemma 2 (soft-capping, sliding-window layers), Falcon and Bloom (ALiBi), T5 (a learned
relative position bias, encoder and causal decoder), under ``attention="ulysses"`` and
``"ring"`` on 2 and 4 ranks with 7 tokens (no rank count divides them).

    python -m pytest tests/parallel/test_hf_families.py -q               # the default subset
    python -m pytest tests/parallel/test_hf_families.py -q -m slow       # the rest
"""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo

from .harness import assert_traced_equals_eager, check_training

ATTN = torch.ops.shardwise.attention.default
DATA = {"input_ids": [S(0)], "labels": [S(0)]}
SEQUENCE = {"input_ids": [S(1)], "labels": [S(1)]}
# The key bias's gradient is zero in exact arithmetic (softmax ignores a per-row shift): float noise,
# which AdamW's m / sqrt(v) would blow up to a full step of +-lr unless eps dominates it.
ADAM = dict(lr=1e-3, optim_kwargs={"eps": 1e-2})


def _slow_unless(default, params):
    return [pytest.param(*p, marks=() if p in default else pytest.mark.slow) for p in params]


def _check_figures(pm, model):
    """stats() and summary() return, and the memory figures are the program's: exact (the fake run
    worked), every parameter's bytes resident and a gradient for each."""
    stats, summary = pm.plan.stats(), pm.plan.summary()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = stats["memory"]
    assert mem["exact"], summary
    assert mem["parameters"] == params, (mem, params)
    # gradients are views of their reduction buckets: a bucket may also carry another reduction
    # (T5: the position bias's partial sums), counted with them; memory() has those made by the peak
    grads = pm.plan.memory_estimate(mem["rank"]).gradients
    assert params <= grads <= 1.05 * params and mem["gradients"] <= grads, (mem, grads, params)
    assert stats["peak_memory_bytes"] >= mem["peak"] >= 2 * params
    assert stats["comm_bytes"] > 0 and stats["est_step_time_s"] > 0
    assert "peak" in summary and "all_reduce" in summary
    return stats


FIGURES = [(name, ranks) for name in zoo.HF_FAMILIES for ranks in (2, 3)]
FAST_FIGURES = [("bert", 2), ("t5", 2), ("gemma2", 3), ("falcon", 2), ("bloom", 3)]


@pytest.mark.parametrize("name, ranks", _slow_unless(FAST_FIGURES, FIGURES))
def test_data_parallel_plan_figures(name, ranks):
    """One layer per stack (the figures' code paths do not depend on depth); 5 sequences: uneven."""
    model, inputs, _, _ = zoo.FAMILIES[name](batch=5, layers=1)
    pm = sw.parallelize(model, sw.Mesh((ranks,), ("dp",)), inputs, input_placements=DATA)
    stats = _check_figures(pm, model)
    assert set(stats["collectives"]) == {"all_reduce"}, pm.plan.summary()
    _check_mapped(name, pm.plan.traced.gm)


CAUSAL = ("gemma2", "falcon", "bloom", "t5")
SEQ_CASES = [(name, mode, ranks) for name in CAUSAL for mode in ("ulysses", "ring") for ranks in (2, 4)]
FAST_SEQ = [("gemma2", "ring", 4), ("falcon", "ulysses", 2)]
EXPECTED_TAG = {"ulysses": "leading", "ring": "ring"}


@pytest.mark.parametrize("name, mode, ranks", _slow_unless(FAST_SEQ, SEQ_CASES))
def test_sequence_parallel_exact(name, mode, ranks):
    model, inputs, _, _ = zoo.FAMILIES[name](batch=1, seq=7)
    pm = check_training(model, sw.Mesh((ranks,), ("sp",)), inputs, input_placements=SEQUENCE, attention=mode, **ADAM)
    traced = pm.plan.traced
    assert ATTN in traced.ops() and torch.ops.aten._softmax.default not in traced.ops(), traced.notes
    nodes = [n for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)]
    tags = {n.strategy.tags for n in nodes}
    if name != "t5":  # T5's planner may keep a cross-attention whole: its encoder keys are few
        assert tags == {(EXPECTED_TAG[mode],)}, pm.plan.summary()
    else:
        assert (EXPECTED_TAG[mode],) in tags, pm.plan.summary()
    if mode == "ring":
        assert "ring_attention_local(" in pm.plan.program(0)
    pm.plan.summary()
    assert pm.plan.stats()["memory"]["exact"]


@pytest.mark.parametrize("name, mode", [("gemma2", "ring"), ("falcon", "ulysses")])
def test_hugging_face_activation_checkpointing_of_eager_attention(name, mode):
    """Gemma 2 and Falcon compute attention eagerly (a chain the trace maps onto the op); with
    Hugging Face's activation checkpointing each layer is recomputed in backward by
    torch.utils.checkpoint, where the tracing mode is off unless re-entered
    (trace/eager_attention._recomputed_in): the trace raised CheckpointError (the recomputation
    saved the chain's tensors, the forward the op's). Sequence-parallel training equals one
    device; every attention, forward and recomputed, is the op and runs the mode's path."""
    model, inputs, _, _ = zoo.FAMILIES[name](batch=1, seq=7)
    model.activation_checkpointing_enable()
    pm = check_training(model, sw.Mesh((2,), ("sp",)), inputs, input_placements=SEQUENCE, attention=mode, **ADAM)
    traced = pm.plan.traced
    assert torch.ops.aten._softmax.default not in traced.ops(), traced.notes
    assert sum(n.target is ATTN for n in traced.gm.graph.nodes) == 4, traced.notes  # 2 layers, twice
    assert any("recomputed in backward by torch.utils.checkpoint" in note for note in traced.notes), traced.notes
    tags = {n.strategy.tags for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)}
    assert tags == {(EXPECTED_TAG[mode],)}, pm.plan.summary()


def _mapped_attention(gm):
    """(the forward attention calls' arguments by name, whether a bias gradient flows on)."""
    bwd = torch.ops.shardwise.attention_backward.default
    names = [a.name for a in ATTN._schema.arguments]
    fwd = [dict(zip(names, n.args)) | n.kwargs for n in gm.graph.nodes if n.target is ATTN]
    grad_bias = any(u.args[1] == 3 for n in gm.graph.nodes if n.target is bwd for u in n.users)
    return fwd, grad_bias


def _check_mapped(name, gm):
    """What the mapped chains carry: Gemma 2's soft-cap (its sliding window is the model's mask),
    Bloom's ALiBi tensor as the op's bias beside the mask, Falcon's as that or (transformers 5.25
    builds it into the mask once per model) in a float mask, T5's learned position
    bias as a bias whose gradient flows on (the backward's fourth output is read)."""
    fwd, grad_bias = _mapped_attention(gm)
    if name == "gemma2":
        assert [a["softcap"] for a in fwd] == [0.5] * len(fwd) and fwd[0]["attn_mask"] is not None
    elif name == "bloom":
        assert all(a["bias"] is not None and a["attn_mask"] is not None for a in fwd)
    elif name == "falcon":  # ALiBi beside the mask, or (transformers >= 5.2x) added into a float mask
        assert all(a["attn_mask"] is not None for a in fwd)
        assert all(a.get("bias") is not None or a["attn_mask"].meta["val"].is_floating_point() for a in fwd)
    elif name == "t5":
        assert sum(a.get("bias") is not None for a in fwd) >= 2 and grad_bias  # encoder and decoder self-attention
    if name != "t5":
        assert not grad_bias


def test_t5_eager_is_mapped_and_equal():
    """T5's eager attention (no scaling, + position bias, + mask): one op per attention, the bias's
    gradient reaching the relative-attention embedding; loss and every gradient as eager."""
    from shardwise.trace import trace_step

    model, inputs, _, _ = zoo.t5(layers=1)
    model.set_attn_implementation("eager")
    traced = trace_step(model, inputs)
    assert torch.ops.aten._softmax.default not in traced.ops()
    _check_mapped("t5", traced.gm)
    assert_traced_equals_eager(traced, model, inputs)


# -- attn_implementation="flex_attention" ------------------------------------------------------
def _flex_and_eager(name, **kw):
    """The zoo model with Hugging Face's flex_attention, and an eager copy as its reference (on CPU
    FlexAttention has no backward in torch 2.13: the flex model itself cannot be the reference)."""
    import copy

    model, inputs, _, _ = zoo.FAMILIES[name](**kw)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    model.set_attn_implementation("flex_attention")
    return model, ref, inputs


def _assert_step_equal(loss, grads, ref, inputs):
    ref.zero_grad()
    want = ref(*inputs).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name, ranks", [("gemma2", 2), pytest.param("t5", 2, marks=pytest.mark.slow)])
def test_flex_attention_is_the_op_and_exact_under_ulysses(name, ranks):
    """HF's flex path (soft-cap, sliding-window and causal block masks; T5's position bias) traced as
    shardwise.attention; sequence parallel with Ulysses, loss and every gradient equal the eager model's."""
    model, ref, inputs = _flex_and_eager(name, batch=1, seq=7, layers=1)
    pm = sw.parallelize(model, sw.Mesh((ranks,), ("sp",)), inputs, input_placements=SEQUENCE, attention="ulysses")
    loss = pm.step(*inputs)
    assert ATTN in pm.plan.traced.ops() and not any("flex" in str(op) for op in pm.plan.traced.ops())
    _check_mapped(name, pm.plan.traced.gm)
    _assert_step_equal(loss, pm.gradients(), ref, inputs)


def test_flex_attention_what_it_cannot_carry_raises():
    """Attention sinks and a BlockMask built elsewhere are code, not data: a typed error, never a guess."""
    from torch.nn.attention.flex_attention import create_block_mask

    from shardwise.trace.hf_flex import flex_attention_as_op

    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(sw.ShardingError, match="sinks") as e:
        flex_attention_as_op(None, q, k, v, None, s_aux=torch.zeros(2))
    assert "eager" in e.value.fix
    block = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 4, 4, device="cpu", _compile=False)
    with pytest.raises(sw.ShardingError, match="BlockMask"):
        flex_attention_as_op(None, q, k, v, block)


# -- more decoder families (zoo.MORE_FAMILIES) ---------------------------------------------------------
MEGATRON_FAMILY = {"starcoder2": "starcoder2", "phi3": "phi3", "phi": "phi", "gpt_neox": "gpt_neox", "opt": "opt",
                   "gptj": "gptj"}  # the rest name their projections as Llama does
MORE_CASES = [(name, how) for name in zoo.MORE_FAMILIES for how in ("megatron", "fsdp+megatron", "ulysses")]
FAST_MORE = [("phi3", "megatron"), ("phi3", "fsdp+megatron"), ("qwen3", "ulysses")]
DP_TP, BATCH_ON_DP = sw.Mesh((2, 2), ("dp", "tp")), {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}


def _fsdp_megatron(model) -> dict:
    tp = sw.recipes.megatron(model, "tp")
    return sw.recipes.merge(tp, sw.recipes.fsdp(model, "dp", beside=tp))


@pytest.mark.parametrize("name, how", _slow_unless(FAST_MORE, MORE_CASES))
def test_more_families_train_exactly(name, how):
    """Megatron placements from the family's recipe on "tp" with a batch of 3 (uneven) on "dp" of a
    (2, 2) mesh, or Ulysses on 2 ranks with 7 tokens: loss, gradients and two AdamW steps equal one
    device's. The recipe is the family's own (OPT's q/k/v are named as Llama's, its other projections
    not); Phi-3's fused [q|k|v] is sliced rank by rank (view.py's grouped slice) and its weight gradients
    keep the features in groups on "tp" while the flattened batch is in units on "dp" (strategies restated
    on two mesh dims at once, search/propagate.py)."""
    if how == "fsdp+megatron":  # every parameter sharded on "dp" too (Phi-3's fused [q|k|v] on its dim 1:
        model, inputs, _, _ = zoo.MORE_FAMILIES[name](batch=3)  # no shard nests inside groups)
        check_training(model, DP_TP, inputs, steps=2, **ADAM, input_placements=BATCH_ON_DP,
                       param_placements=_fsdp_megatron(model))
    elif how == "megatron":
        model, inputs, _, _ = zoo.MORE_FAMILIES[name](batch=3)
        assert sw.recipes.detect_family(model) == MEGATRON_FAMILY.get(name, "llama")
        pm = check_training(model, DP_TP, inputs, steps=2, **ADAM, input_placements=BATCH_ON_DP,
                            param_placements=sw.recipes.megatron(model, "tp"))
        kinds = {s.kind for s in pm.plan.collective_steps()}
        # Megatron's and data parallelism's collectives only: no tokens exchanged (ring, all_to_all), so no
        # fused projection's grouped features re-cut (Phi-3's, whose batch arrives in units on "dp")
        assert kinds <= {"all_reduce", "all_gather", "reduce_scatter"}, pm.plan.summary()
    else:
        model, inputs, _, _ = zoo.MORE_FAMILIES[name](batch=1, seq=7)
        pm = check_training(model, sw.Mesh((2,), ("sp",)), inputs, input_placements=SEQUENCE, attention="ulysses",
                            steps=2, **ADAM)
        tags = {n.strategy.tags for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)}
        assert tags == {("leading",)}, pm.plan.summary()
