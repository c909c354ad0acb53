"""Activation checkpointing: backward recomputes forward values instead of keeping them.

``activation_checkpointing="blocks"`` / ``"selective"`` (trace/recompute.py) and the model's own
torch.utils.checkpoint (Hugging Face's gradient_checkpointing_enable()) put the recomputed forward
inside the backward of the program: the same ops on the same inputs, so loss and gradients equal
the run without it bit for bit; the liveness estimate sees the saved values die after forward and
drops by most of the layers' saved activations, as the measured peak does; stats() count the
recompute's flops.

    python -m pytest tests/parallel/test_checkpointing.py -q -p no:logging
"""
from __future__ import annotations

import copy
import functools
import operator
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise import Shard as S
from shardwise.trace import is_view
from shardwise.trace.recompute import MATMUL_OPS, RECOMPUTE, RECOMPUTE_OF, SAVED_OPS, block_of, plan_recompute
from tests.models import zoo
from tests.search.test_memory import measured_peak

MESH = sw.Mesh((2,), ("dp",))
TOLERANCE = 0.10  # the estimate against the measured peak


def tiny_lm(layers=4):
    """4 blocks whose saved activations outweigh the parameters: the peak sits in backward."""
    torch.manual_seed(0)
    model = zoo.TinyLM(layers=layers, dim=32, max_len=64)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (8, 64), generator=g) for _ in range(2))
    return model, x, y


def run(model, x, y, mesh=MESH, **kw):
    pm = sw.parallelize(copy.deepcopy(model), mesh, (x,), loss_fn=zoo.ce_loss, example_targets=(y,),
                        input_placements={0: [S(0)]}, **kw)
    loss = pm.step(x, y)
    return pm, loss, pm.gradients()


@functools.cache
def planned(checkpointing: str = "none", model: str = "tiny_lm"):
    """(pm, loss, gradients) of the 4-block TinyLM (or its torch.utils.checkpoint twin, "checkpointed")
    on (2,) data parallel, made once per module (the tests only read them)."""
    base, x, y = tiny_lm()
    if model == "checkpointed":
        ck = CheckpointedLM(layers=4, dim=32, max_len=64)
        ck.load_state_dict(base.state_dict())
        base = ck
    return run(base, x, y, activation_checkpointing=checkpointing)


def assert_same_bits(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb), f"{what}: loss {la} != {lb}"
    for n in gb:
        assert torch.equal(ga[n], gb[n]), f"{what}: grad of {n} differs by {(ga[n] - gb[n]).abs().max()}"


def saved_by_layers(plan, rank: int = 0) -> int:
    """Bytes on ``rank`` of the layers' forward values backward reads (each allocation once: views
    alias): what "blocks" recomputes instead of keeping."""
    total = 0
    for nodes in plan_recompute(plan.prop.gm, "blocks").values():
        for n in nodes:
            if is_view(n) or not any(u.meta.get("autograd_backward") for u in n.users):
                continue
            total += sum(lay.local_numel(plan.mesh, rank) * lay.itemsize for lay in plan.prop.layouts[n.name]
                         if lay is not None)
    return total


def test_blocks_recompute_in_backward_drop_memory_and_keep_every_bit():
    _, x, y = tiny_lm()
    pm0, *ref = planned()
    pm1, *got = planned("blocks")
    assert_same_bits(got, ref, "blocks")
    # the recomputed forward sits in backward, before the layer's backward reads it
    nodes = list(pm1.plan.prop.gm.graph.nodes)
    re = [n for n in nodes if RECOMPUTE in n.meta]
    assert {n.meta[RECOMPUTE] for n in re} == {f"blocks.{i}" for i in range(4)}
    first_backward = next(i for i, n in enumerate(nodes) if n.meta.get("autograd_backward"))
    assert all(nodes.index(n) > first_backward and n.meta["autograd_backward"] for n in re)
    program = pm1.plan.program(0)
    assert all(f"{n.name} = " in program for n in re if n.target is not operator.getitem)
    # memory: estimate and measurement both drop by at least half of what the layers saved
    saved = saved_by_layers(pm0.plan)
    est0, est1 = pm0.plan.memory_estimate(0).peak, pm1.plan.memory_estimate(0).peak
    got0, got1 = (measured_peak(p, 0, (x,), (y,)) for p in (pm0, pm1))
    assert est0 - est1 >= saved / 2 and got0 - got1 >= saved / 2, (saved, est0, est1, got0, got1)
    for est, meas in ((est0, got0), (est1, got1)):
        assert abs(est - meas) <= TOLERANCE * meas, (est, meas)
    # flops: the recompute is counted once more, and reported
    s0, s1 = pm0.plan.stats(), pm1.plan.stats()
    assert s0["recompute_flops"] == 0 < s1["recompute_flops"]
    assert s1["flops_per_rank"] == pytest.approx(s0["flops_per_rank"] + s1["recompute_flops"])
    assert s1["est_step_time_s"] > s0["est_step_time_s"]


def test_selective_keeps_every_other_matmul_and_attention():
    """torchtitan's op-level policy: of each block's matmuls in forward order the 1st, 3rd, ... are
    kept, attention's output too; the rest is recomputed where backward needs it (here the
    attention projection, 2nd, which the residual sum the second norm reads is made from)."""
    pm0, *ref = planned()
    pms, *sel = planned("selective")
    pmb, *_ = planned("blocks")
    assert_same_bits(sel, ref, "selective")
    gm = pms.plan.prop.gm
    re = [n for n in gm.graph.nodes if RECOMPUTE in n.meta]
    again = {n.meta[RECOMPUTE_OF] for n in re}
    assert re and not any(n.target in SAVED_OPS - MATMUL_OPS for n in re)  # attention is never recomputed
    for b in range(4):
        products = [n.name for n in gm.graph.nodes if n.target in MATMUL_OPS and RECOMPUTE not in n.meta
                    and not n.meta.get("autograd_backward") and block_of(n) == f"blocks.{b}"]
        assert len(products) == 4 and not again & set(products[0::2]) and again & set(products[1::2]), products
    peaks = [p.plan.memory_estimate(0).peak for p in (pmb, pms, pm0)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[1] < peaks[2], peaks
    flops = [p.plan.stats()["recompute_flops"] for p in (pmb, pms)]
    assert 0 < flops[1] < flops[0]


class CheckpointedLM(zoo.TinyLM):
    """TinyLM whose blocks run under torch.utils.checkpoint (non-reentrant)."""

    def __init__(self, reentrant=False, **kw):
        super().__init__(**kw)
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


def test_torch_utils_checkpoint_is_recomputed_in_the_program():
    """The model's own checkpoint regions: the recompute reads the step's parameters (not the
    module's tensors baked in as constants), is tagged, and equals the plain run bit for bit with
    the memory of "blocks"; use_reentrant=True raises a ConfigError that says what to use."""
    _, x, y = tiny_lm()
    pm0, *ref = planned()
    pm1, *got = planned(model="checkpointed")
    assert_same_bits(got, ref, "torch.utils.checkpoint")
    gm = pm1.plan.prop.gm
    assert not list(gm.graph.find_nodes(op="get_attr"))  # no parameter baked in as a constant
    assert {n.meta[RECOMPUTE] for n in gm.graph.nodes if RECOMPUTE in n.meta} == {f"blocks.{i}" for i in range(4)}
    assert pm1.plan.stats()["recompute_flops"] > 0
    assert pm1.plan.memory_estimate(0).peak < pm0.plan.memory_estimate(0).peak - saved_by_layers(pm0.plan) / 2
    with pytest.raises(sw.ConfigError, match="use_reentrant"):
        run(CheckpointedLM(reentrant=True, layers=1, dim=32, max_len=64), x, y)


def test_another_thread_checkpoints_with_torch_while_a_step_is_traced():
    """The tracing patches of torch.utils.checkpoint are process-wide: on another thread the model's
    own checkpoint (reentrant too) runs as torch's, untagged and allowed, while one is being traced."""
    from shardwise.trace.recompute import checkpoint_recompute

    block = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    want = torch.autograd.grad(block(x.requires_grad_()).tanh().sum(), x)[0]
    got, errors = [], []

    def other():
        try:
            for reentrant in (True, False):
                leaf = x.detach().requires_grad_()
                checkpoint(lambda t: block(t).tanh(), leaf, use_reentrant=reentrant).sum().backward()
                got.append(leaf.grad)
        except Exception as e:  # noqa: BLE001 - the assertion below says what it was
            errors.append(e)

    with checkpoint_recompute():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        with pytest.raises(sw.ConfigError, match="use_reentrant"):  # the tracing thread still refuses it
            checkpoint(lambda t: block(t).tanh(), x, use_reentrant=True)
    assert not errors, errors
    assert len(got) == 2 and all(torch.equal(g, want) for g in got)


def test_option_is_checked():
    model, x, y = tiny_lm(layers=1)
    with pytest.raises(sw.ConfigError, match="activation_checkpointing"):
        run(model, x, y, activation_checkpointing="everything")
    with pytest.raises(sw.ConfigError, match="ILP"):
        run(model, x, y, activation_checkpointing="auto", planner="propagate")
    mlp = torch.nn.Linear(4, 4)  # no layer with an index in its path
    with pytest.raises(sw.ConfigError, match="no repeated layer"):
        sw.parallelize(mlp, MESH, (torch.randn(4, 4),), loss_fn=lambda o: o.sum(), example_targets=(),
                       activation_checkpointing="blocks")


@pytest.mark.slow  # three plans of a 4-layer model, one an integer program with cuts: ~60 s
def test_auto_recomputes_some_blocks_to_meet_the_budget():
    """memory_budget between the "blocks" peak and the no-checkpointing peak: the ILP recomputes some
    blocks and not others (one column per block, though the 4 identical layers share their placement
    columns), the plan fits the budget, its modelled step (the ILP's objective) is no slower than
    recomputing every block, and it trains as the plain run does."""
    model, x, y = tiny_lm()
    rep = {n: [sw.Replicate()] for n, _ in model.named_parameters()}  # data parallel: recompute is the lever
    pm0, *ref = run(model, x, y, param_placements=rep)
    pmb, *_ = run(model, x, y, param_placements=rep, activation_checkpointing="blocks")
    s0, sb = pm0.plan.stats(), pmb.plan.stats()
    budget = (s0["peak_memory_bytes"] + sb["peak_memory_bytes"]) / 2
    pma, *got = run(model, x, y, param_placements=rep, activation_checkpointing="auto", memory_budget=budget)
    sa = pma.plan.stats()
    chosen = pma.plan.prop.recomputed
    assert 0 < len(chosen) < 4, chosen
    assert {n.meta[RECOMPUTE] for n in pma.plan.prop.gm.graph.nodes if RECOMPUTE in n.meta} == set(chosen)
    assert sa["peak_memory_bytes"] <= budget
    assert s0["est_step_time_s"] < sa["est_step_time_s"] <= sb["est_step_time_s"]
    assert 0 < sa["recompute_flops"] < sb["recompute_flops"]
    report = pma.plan.prop.solve_report
    assert report.objective_s == pytest.approx(sa["est_step_time_s"], rel=1e-9)
    # the ILP places the loss's mean its own way (an fp32 sum in another order); every gradient
    # is the plain run's, bit for bit
    torch.testing.assert_close(got[0], ref[0], rtol=2e-7, atol=0)
    assert_same_bits((ref[0], got[1]), ref, "auto")
    est, meas = pma.plan.memory_estimate(0).peak, measured_peak(pma, 0, (x,), (y,))
    assert abs(est - meas) <= TOLERANCE * meas, (est, meas)


@pytest.mark.slow  # two Llama plans per layout
@pytest.mark.parametrize("name", ["data", "fsdp", "megatron", "fsdp_megatron", "ulysses", "hf"])
def test_blocks_under_every_parallelism_keep_every_bit(name):
    """Llama (2 layers) with "blocks" (or, "hf", Hugging Face's gradient_checkpointing_enable(),
    torch.utils.checkpoint per decoder layer) equals the same layout without checkpointing, bit for
    bit (FSDP x Megatron at fp32 rounding: see below), in bf16 mixed precision
    too for FSDP; the recompute is in the program, its flops counted, and what forward leaves for
    backward smaller."""
    from tests.precision.test_mixed_precision import BF16, layouts

    def step(**kw):
        c = zoo.llama(batch=4, seq=8)
        if kw.pop("hf", False):
            c.model.gradient_checkpointing_enable()
        mesh, lay = layouts("data" if name == "hf" else name, c.model)
        pm = sw.parallelize(c.model, mesh, c.example_inputs, **lay, **kw)
        return pm, pm.step(*c.example_inputs), pm.gradients()

    extra = {"mixed_precision": BF16} if name == "fsdp" else {}
    pm0, *ref = step(**extra)
    pm1, *got = step(hf=True) if name == "hf" else step(activation_checkpointing="blocks", **extra)
    # (the two graphs' node names do not line up: the recomputed nodes take names, and those made
    # after them shift, so the results are compared, not the strategies by name)
    if name == "fsdp_megatron":
        # propagation may place a backward node that reads a recomputed value (not yet moved
        # anywhere) otherwise than one that reads the saved value (already moved for forward): a
        # partial sum then reduced in another order, at fp32 rounding
        for n, g in ref[1].items():
            torch.testing.assert_close(got[1][n], g, rtol=1e-5, atol=1e-7)
    else:  # the same ops on the same bits
        assert_same_bits(got, ref, name)
    layers = {n.meta[RECOMPUTE] for n in pm1.plan.prop.gm.graph.nodes if RECOMPUTE in n.meta}
    assert layers == {"model.layers.0", "model.layers.1"}, layers
    assert pm1.plan.stats()["recompute_flops"] > 0
    assert at_backward(pm1.plan) < at_backward(pm0.plan)  # what forward leaves to backward


def at_backward(plan, rank: int = 0) -> int:
    """Bytes live on ``rank`` when its program's backward starts (saved for it, and resident)."""
    from shardwise.lower.memory import backward_start

    est = plan.memory_estimate(rank)
    nodes = list(plan.program_module(rank, guards=False).graph.nodes)
    return dict(est.curve)[nodes[backward_start(plan, nodes)].name]
