"""Expert parallelism with token dispatch: ``shardwise.moe_experts`` (ops/moe/op.py), its all-to-all
dispatch (ops/moe/dispatch.py) and its rule (rules/moe_experts.py), against one device.

    python -m pytest tests/parallel/test_moe_dispatch.py -q --durations=0   # slow ones: -m slow

Tokens and experts sharded on the same mesh dim (EP = DP x EP): each rank sends its tokens to
the ranks holding their experts and gets the results back. Routing is uneven: some experts
get no tokens, a rank may hold no experts (5 over 4) or no tokens (3 rows over 4).
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.ops.moe import BACKWARD, FORWARD, kernels, moe_experts
from shardwise.ops.moe.dispatch import dispatch_backward, dispatch_forward
from shardwise.run.threads import run_threads

from .harness import check_training
from .test_moe import ADAM, mixtral, qwen2_moe

D = torch.float64


def _problem(tokens=11, hidden=6, inter=5, experts=5, k=2, empty=(2,), seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts, (tokens, k), generator=g)
    for e in empty:  # experts nobody routes to
        idx[idx == e] = (e + 1) % experts
    x, w = torch.randn(tokens, hidden, generator=g, dtype=D), torch.rand(tokens, k, generator=g, dtype=D)
    gu = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=D)
    dn = torch.randn(experts, hidden, inter, generator=g, dtype=D)
    return x, idx, w, gu, dn


def _loop(x, idx, w, gu, dn):
    """The experts by definition, one (token, choice) at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gate, up = (gu[e] @ x[t]).chunk(2)
            out[t] = out[t] + w[t, j] * (dn[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_op_equals_the_loop_and_its_gradients():
    x, idx, w, gu, dn = _problem()
    leaves = [t.clone().requires_grad_(True) for t in (x, w, gu, dn)]
    got = moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], "silu", 0)
    torch.testing.assert_close(got, _loop(x, idx, w, gu, dn), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(got.sum(), leaves[2:])
    assert grads[0][2].abs().sum() == 0 and grads[0][0].abs().sum() > 0  # expert 2 got no tokens
    small = _problem(tokens=4, hidden=3, inter=2, experts=3, empty=(1,))
    leaves = [t.clone().requires_grad_(True) for t in (small[0], *small[2:])]
    assert torch.autograd.gradcheck(lambda a, b, c, d: moe_experts(a, small[1], b, c, d, "silu", 0), leaves)
    torch.library.opcheck(FORWARD, (*leaves[:1], small[1], *leaves[1:], "silu", 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_experts_held_from_first_expert_are_a_partial_sum():
    """Ranks holding experts [0, 2) and [2, 5) (first_expert 0 and 2) add up to the whole."""
    x, idx, w, gu, dn = _problem()
    parts = [kernels.experts_forward(x, idx, w, gu[a:b], dn[a:b], "silu", a) for a, b in ((0, 2), (2, 5))]
    torch.testing.assert_close(parts[0] + parts[1], _loop(x, idx, w, gu, dn), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dispatch_on_threads_equals_one_device(n):
    """Tokens chunked over n ranks (11 rows), experts too (5: with 4 ranks 2, 2, 1 and none)."""
    x, idx, w, gu, dn = _problem()
    grad = torch.randn(x.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    want = kernels.experts_forward(x, idx, w, gu, dn, "silu")
    want_b = kernels.experts_backward(grad, x, idx, w, gu, dn, "silu")
    rows = [c.shape[0] for c in x.chunk(n)] + [0] * (n - len(x.chunk(n)))
    experts = [c.shape[0] for c in gu.chunk(n)] + [0] * (n - len(gu.chunk(n)))

    def rank(r):
        t, e = slice(sum(rows[:r]), sum(rows[:r + 1])), slice(sum(experts[:r]), sum(experts[:r + 1]))
        return (dispatch_forward(x[t], idx[t], w[t], gu[e], dn[e], "silu", 0, experts),
                dispatch_backward(grad[t], x[t], idx[t], w[t], gu[e], dn[e], "silu", 0, experts))

    got = run_threads(rank, sw.Mesh((n,)))
    torch.testing.assert_close(torch.cat([o for o, _ in got]), want, rtol=1e-12, atol=1e-12)
    for i, what in enumerate(("dx", "d_weights", "d_gate_up", "d_down")):
        torch.testing.assert_close(torch.cat([b[i] for _, b in got]), want_b[i], rtol=1e-12, atol=1e-12, msg=what)


def test_dispatch_with_bfloat16_tokens_and_float32_weights():
    """Rows and routing weights travel in one message per dtype: the same numbers as one rank
    computing all of it (bitwise), and the plan is told of the extra all_to_alls."""
    from shardwise.rules.moe_experts import dispatch_comm
    from shardwise.rules.registry import OpCall, Strategy

    x, idx, w, gu, dn = _problem(tokens=9, experts=4, empty=())
    x, gu, dn, w = x.bfloat16(), gu.bfloat16(), dn.bfloat16(), w.float()
    grad = torch.randn(x.shape).bfloat16()
    want = kernels.experts_forward(x, idx, w, gu, dn, "silu")
    want_b = kernels.experts_backward(grad, x, idx, w, gu, dn, "silu")

    def rank(r):
        t, e = (slice(0, 5), slice(0, 2)) if r == 0 else (slice(5, 9), slice(2, 4))
        return (dispatch_forward(x[t], idx[t], w[t], gu[e], dn[e], "silu", 0, (2, 2)),
                dispatch_backward(grad[t], x[t], idx[t], w[t], gu[e], dn[e], "silu", 0, (2, 2)))

    got = run_threads(rank, sw.Mesh((2,)))
    assert torch.equal(torch.cat([o for o, _ in got]), want)
    assert all(torch.equal(torch.cat([b[i] for _, b in got]), want_b[i]) for i in range(4))
    call = OpCall.from_values(BACKWARD, (grad, x, idx, w, gu, dn, "silu", 0), {}, want_b)
    st = Strategy(((S(0),),) * 4, ((S(0),),) * 6, ("dispatch",))
    assert [s.kind for s in dispatch_comm(call, st, sw.Mesh((2,)))] == ["all_to_all"] * 5


def test_flops_per_strategy():
    """6 H I flops per (token, expert) pair: data parallel, dispatch and the experts' partial sums
    each do 1/n of the replicated work per rank, tensor parallel 1/n of the features; the
    backward twice the forward."""
    from shardwise.search.flops import flops
    from shardwise.rules.moe_experts import experts_strategies, experts_valid
    from shardwise.rules.registry import OpCall, Strategy

    x, idx, w, gu, dn = _problem(tokens=8, hidden=6, inter=4, experts=4, empty=())
    out = kernels.experts_forward(x, idx, w, gu, dn, "silu")
    mesh, whole = sw.Mesh((2,)), 6.0 * 6 * 4 * 8 * 2  # 6 H I per pair, 8 tokens, top 2
    for op, args, outs, factor in ((FORWARD, (x, idx, w, gu, dn), out, 1.0),
                                   (BACKWARD, (out, x, idx, w, gu, dn), (x, w, gu, dn), 2.0)):
        call = OpCall.from_values(op, (*args, "silu", 0), {}, outs)
        got = {}
        for one in experts_strategies(call):
            st = Strategy(tuple((p,) for p in one.outs), tuple((p,) for p in one.ins), (one.tag,))
            if experts_valid(call, st, mesh):  # the first of each tag: plain Shard(0) tokens
                got.setdefault(one.tag, flops(call, st, mesh))
        assert got[""] == factor * whole, got  # replicated
        for tag in ("tokens", "dispatch", "experts", "tp"):
            assert got[tag] == factor * whole / 2, (tag, got)


def test_rule_verified_on_every_strategy():
    """The verifier runs every strategy on (2,), (3,), (2, 2), dispatch included (uneven: 7
    tokens, 5 experts, expert 2 without tokens)."""
    x, idx, w, gu, dn = (t.float() if t.is_floating_point() else t for t in _problem(tokens=7, inter=4))
    grad = torch.randn(x.shape)
    for op, args in ((FORWARD, (x, idx, w, gu, dn)), (BACKWARD, (grad, x, idx, w, gu, dn))):
        report = sw.verify_rule(op, *args, "silu", 0)
        assert report.ok, [r for r in report.results if not r.ok]
        dispatch = [r for r in report.results if all(p == [S(0)] or p == (S(0),) for p in r.strategy.ins)]
        assert dispatch, f"no dispatch strategy verified for {op}"


def test_all_to_all_uneven_on_threads():
    """Member i sends i + j rows to member j (none from 0 to 0); rows arrive in member order, and
    a receiver expecting other counts fails naming them."""
    from shardwise.core.errors import CollectiveError
    from shardwise.run.collectives import current

    n = 3

    def rank(r, wrong=False):
        send = [r + j for j in range(n)]
        rows = torch.cat([torch.full((k, 2), 10.0 * r + j) for j, k in enumerate(send)])
        recv = [i + r + (wrong and r == 1) for i in range(n)]
        return current().all_to_all_uneven(rows, 0, send, recv)

    got = run_threads(rank, sw.Mesh((n,)))
    for r, t in enumerate(got):
        want = torch.cat([torch.full((i + r, 2), 10.0 * i + r) for i in range(n)])
        assert torch.equal(t, want), r
    with pytest.raises(CollectiveError, match="expected rows"):
        run_threads(lambda r: rank(r, wrong=True), sw.Mesh((n,)))


def test_dispatch_refuses_ids_outside_the_experts():
    x, idx, w, gu, dn = _problem(experts=5)
    with pytest.raises(sw.ShardingError, match=r"expert ids must lie in \[0, 4\)"):
        run_threads(lambda r: dispatch_forward(x, idx, w, gu[:4], dn[:4], "silu", 0, (4,)), sw.Mesh((1,)))


# -- Hugging Face models ------------------------------------------------------------------------
# (builder, experts, seed): tiny configs whose routing leaves some experts without tokens
CASES = {"mixtral": (mixtral, 8, 10), "qwen2_moe": (qwen2_moe, 5, 2)}


def routing_counts(model, inputs) -> list[list[int]]:
    """Tokens per expert in each MoE layer of one forward pass (the routers' top-k ids)."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, i, o: got.append(o[2])) for n, m in model.named_modules()
             if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    return [torch.bincount(g.reshape(-1), minlength=experts).tolist() for g in got]


def _dispatched(pm) -> list:
    nodes = [np_ for np_ in pm.plan.prop.nodes.values() if np_.call.op in (FORWARD, BACKWARD)]
    assert len(nodes) == 2, "one forward and one backward experts node"
    return nodes


def run_ep(name, mesh, data_dims=("ep",), ep="ep", batch=3):
    build, experts, seed = CASES[name]
    case = build(batch=batch, seq=4, experts=experts, seed=seed)
    counts = routing_counts(case.model, case.example_inputs)[0]
    assert 0 in counts and len(set(counts)) > 2, counts  # uneven, some experts get nothing
    pm = check_training(case.model, mesh, case.example_inputs, **ADAM,
                        input_placements=sw.recipes.batch_inputs(data_dims, "input_ids", "labels"),
                        param_placements=sw.recipes.experts(case.model, ep))
    m = mesh.names.index(ep)
    for np_ in _dispatched(pm):
        assert np_.strategy.tags[m] == "dispatch", np_.strategy
        assert not [s for steps in np_.in_steps for s in steps if s.is_collective], np_.in_steps  # nothing moved in
    colls = pm.plan.stats()["collectives"]
    assert colls.get("all_to_all", 0) >= 6, colls  # counts, rows and results, forward and backward
    return pm


@pytest.mark.parametrize("name,ep", [("mixtral", 2), ("qwen2_moe", 4),
                                     pytest.param("mixtral", 4, marks=pytest.mark.slow),
                                     pytest.param("qwen2_moe", 2, marks=pytest.mark.slow)])
def test_hf_expert_parallel_dispatch(name, ep):
    """3 sequences of 4 tokens over ep ranks (with 4: one rank has no tokens), experts
    chunked the same way (qwen2_moe: 5 experts, with 4 ranks one holds none)."""
    run_ep(name, sw.Mesh((ep,), ("ep",)))


_TINY = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=32,
             use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                              num_experts_per_tok=2, head_dim=8, num_key_value_heads=2, **_TINY))


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                        num_key_value_heads=2, **_TINY))


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, num_key_value_heads=4, **_TINY))


@pytest.mark.slow
@pytest.mark.parametrize("build", [_qwen3_moe, _olmoe, _deepseek_v3], ids=["qwen3_moe", "olmoe", "deepseek_v3"])
def test_other_hf_moe_families_dispatch(build):
    """Other families whose experts Hugging Face stacks the same way (DeepSeek-V3: sigmoid
    group routing and a shared expert) trace as the op and train by dispatch on ("ep", 2)."""
    from tests.models.zoo import _hf_case

    torch.manual_seed(0)
    case = _hf_case(build(), torch.float32, 3, 4, 64)
    pm = check_training(case.model, sw.Mesh((2,), ("ep",)), case.example_inputs, **ADAM,
                        input_placements=sw.recipes.batch_inputs("ep", "input_ids", "labels"),
                        param_placements=sw.recipes.experts(case.model, "ep"))
    assert [np_.strategy.tags for np_ in _dispatched(pm)] == [("dispatch",), ("dispatch",)]


@pytest.mark.slow
def test_hf_dispatch_on_dp_x_ep():
    """Tokens on both mesh dims (4 sequences: one per rank), experts on "ep": dispatch within
    each ep group. (With 3 sequences over the 4 ranks the planner replicates the tokens on "ep"
    before the experts, upstream of them, and takes the experts-sharded partial strategy.)"""
    run_ep("mixtral", sw.Mesh((2, 2), ("dp", "ep")), data_dims=("dp", "ep"), batch=4)


# -- gloo: the torch backend's all_to_all_uneven ------------------------------------------------
def _gloo_case(name):
    build, experts, seed = CASES[name]
    return build(batch=3, seq=4, experts=experts, seed=seed)


def _gloo_rank(rank):
    out = {}
    for name in CASES:
        case = _gloo_case(name)
        data = {"ep": S(0)}
        pm = sw.parallelize(case.model, sw.Mesh((2,), ("ep",)), case.example_inputs, backend="torch",
                            input_placements={"input_ids": data, "labels": data},
                            param_placements=sw.recipes.experts(case.model, "ep"))
        loss = pm.step(*case.example_inputs)
        tags = [np_.strategy.tags for np_ in _dispatched(pm)]
        out[name] = (loss, pm.gradients(), tags, pm.plan.stats()["collectives"])
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_gloo_dispatch_matches_one_device():
    """Mixtral and Qwen2-MoE on 2 gloo processes, tokens and experts on "ep" (3 sequences: 2 + 1)."""
    from shardwise.run.launch import spawn

    from .harness import assert_close, single_step

    outs = spawn(_gloo_rank, 2, timeout=240)
    for name in CASES:
        case = _gloo_case(name)
        loss, grads = single_step(case.model, case.example_inputs, (), None)
        for rank, out in enumerate(outs):
            got_loss, got_grads, tags, colls = out[name]
            assert tags == [("dispatch",), ("dispatch",)], (name, rank, tags)
            assert colls.get("all_to_all", 0) >= 6, colls
            assert_close(got_loss, loss, f"{name} rank {rank} loss")
            for n, g in grads.items():
                assert_close(got_grads[n], g, f"{name} rank {rank} grad of {n}")


# -- the planner's choice -------------------------------------------------------------------------
class TinyMoE(torch.nn.Module):
    """A router and one experts op; the loss is the output's mean square."""

    def __init__(self, hidden, inter, experts, k):
        super().__init__()
        self.k = k
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        return moe_experts(x, idx, w, self.gate_up, self.down, "silu", 0).pow(2).mean()


@pytest.mark.parametrize("tokens,inter,experts,k,want,moved", [
    (4096, 256, 8, 1, "dispatch", None),    # big experts, many tokens: send tokens, move no weights
    (4096, 4, 4, 2, "tokens", "all_gather"),  # tiny experts: gather them, reduce-scatter their gradients
    (64, 256, 8, 1, "experts", "all_gather"),  # few tokens: gather the tokens, each rank its experts' share
])
def test_ilp_dispatches_when_cheaper(tokens, inter, experts, k, want, moved):
    """Experts Shard(0) on ("ep", 4), tokens too: the ILP prices the dispatch's all_to_alls
    (Rule.comm) against gathering the weights or the tokens, and picks the cheapest; each plan
    trains exactly (loss, gradients, AdamW update)."""
    from shardwise.core.cost import CostModel

    torch.manual_seed(0)
    model, x = TinyMoE(64, inter, experts, k), torch.randn(tokens, 64)
    pm = check_training(model, sw.Mesh((4,), ("ep",)), (x,), input_placements={0: {"ep": S(0)}},
                        param_placements={"gate_up": {"ep": S(0)}, "down": {"ep": S(0)}}, planner="ilp",
                        cost_model=CostModel.preset("cpu"))
    assert [np_.strategy.tags for np_ in _dispatched(pm)] == [(want,), (want,)]
    colls = pm.plan.stats()["collectives"]
    assert ("all_to_all" in colls) == (want == "dispatch"), colls
    assert moved is None or moved in colls, colls


def test_batch_inputs_recipe():
    assert sw.recipes.batch_inputs("ep", "input_ids", 1) == {"input_ids": {"ep": S(0)}, 1: {"ep": S(0)}}
    assert sw.recipes.batch_inputs(("dp", "ep"), "x") == {"x": {"dp": S(0), "ep": S(0)}}
    with pytest.raises(sw.ShardingError, match="names no input"):
        sw.recipes.batch_inputs("ep")


def _experts_class(**flags):
    """A module Hugging Face's experts decorator wraps (as its MoE models declare theirs)."""
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
            gated = flags.get("has_gate", True)
            up = 2 * i if gated else i
            shapes = ((e, h, up), (e, i, h)) if flags.get("is_transposed") else ((e, up, h), (e, h, i))
            self.num_experts = e
            setattr(self, "gate_up_proj" if gated else "up_proj", torch.nn.Parameter(torch.randn(*shapes[0]) * 0.3))
            self.down_proj = torch.nn.Parameter(torch.randn(*shapes[1]) * 0.3)
            self.act_fn = ACT2FN[config.hidden_act]

    return use_experts_implementation(Experts, **flags)


class RoutedExperts(torch.nn.Module):
    def __init__(self, experts_cls, hidden=8, inter=4, experts=4):  # grouped_mm: rows of 16-byte multiples
        from types import SimpleNamespace

        super().__init__()
        config = SimpleNamespace(num_experts=experts, hidden_size=hidden, intermediate_size=inter, hidden_act="silu",
                                 _experts_implementation="grouped_mm")
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = experts_cls(config)

    def forward(self, x):
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, idx, w).pow(2).mean()


@pytest.mark.parametrize("flags,as_op", [({"is_transposed": True}, True), ({"has_gate": False}, False)])
def test_experts_decorator_forms(flags, as_op):
    """Transposed stacked weights ([E, H, 2I], [E, I, H]) become the op on transposed views;
    ungated experts (no gate rows) are not the op's form and are traced as written. Both train
    on ("ep", 2) with the batch there too, equal to Hugging Face's grouped_mm on one device."""
    from shardwise.trace import trace_step

    torch.manual_seed(0)
    model, x = RoutedExperts(_experts_class(**flags)), torch.randn(9, 8)
    ops = trace_step(model, (x,)).ops()
    assert (FORWARD in ops) == as_op, ops
    pm = check_training(model, sw.Mesh((2,), ("ep",)), (x,), input_placements={0: {"ep": S(0)}},
                        param_placements=sw.recipes.experts(model, "ep"))
    if as_op:
        assert [np_.strategy.tags for np_ in _dispatched(pm)] == [("dispatch",), ("dispatch",)]


def test_ilp_places_the_experts_and_dispatches_by_itself():
    """param_placements="auto": the ILP chooses every parameter's placement; with the tokens on
    ("ep", 4) and big experts it shards the experts on "ep" and dispatches the tokens, exactly."""
    from shardwise.core.cost import CostModel

    torch.manual_seed(0)
    model, x = TinyMoE(64, 256, 8, 1), torch.randn(4096, 64)
    pm = check_training(model, sw.Mesh((4,), ("ep",)), (x,), input_placements={0: {"ep": S(0)}},
                        param_placements="auto", planner="ilp", cost_model=CostModel.preset("cpu"))
    fwd, bwd = _dispatched(pm)
    assert fwd.strategy.tags == bwd.strategy.tags == ("dispatch",)
    assert fwd.strategy.ins[3:] == ((S(0),), (S(0),))  # gate_up and down: experts on "ep"
    assert [pm.shards[r]["gate_up"].shape[0] for r in range(4)] == [2, 2, 2, 2]
