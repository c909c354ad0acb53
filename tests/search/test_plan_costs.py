"""Plan.stats / summary / compare under the one cost model: every collective counted (those an
op runs inside its local call too: ring attention's send/recvs, nll_loss's total weight), the
modelled step time, flops per rank and optimizer state, each against a formula written out
here. Plans are checked exactly against one device elsewhere (tests/parallel); these tests
check the figures."""
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S
from shardwise.core.cost import CostModel
from tests.parallel.test_seq_attention import CausalLM, batches, ce

LINEAR_COST = CostModel(flops=1e9, latency=0, bandwidth=1e9)  # 1 flop = 1 ns, 1 byte = 1 ns


def _linear(mesh, batch, cost=LINEAR_COST, x_dim=0, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    return sw.parallelize(model, mesh, (x,), loss_fn=F.mse_loss, example_targets=(y,), input_placements={0: [S(x_dim)]},
                          cost_model=cost, **kw)


def test_data_parallel_step_figures():
    """Linear(8, 4) on ("dp", 2), batch 6: per rank 3 rows. Flops (2 M N K for the matmuls, none
    for the four views t, one per output element for every other op): mm 2*3*4*8, mse 1,
    ones_like 1, mse_backward 12, mm 2*4*8*3 = 398. Communication: the loss's all_reduce
    (2 * 1 * 1 * 4 B) and the weight gradient's (2 * 1 * 16 * 4 B)."""
    st = _linear(sw.Mesh((2,), ("dp",)), 6).plan.stats()
    assert st["flops_per_rank"] == 192 + 1 + 1 + 12 + 192
    assert st["comm_bytes"] == 8 + 128 and st["comm_bytes_by_dim"] == {"dp": 136}
    assert st["collectives"] == {"all_reduce": 2}
    assert abs(st["comm_time_s"] - 136e-9) < 1e-15 and abs(st["compute_time_s"] - 398e-9) < 1e-15
    assert abs(st["est_step_time_s"] - 534e-9) < 1e-15
    mem = st["memory"]
    assert mem["parameters"] == 8 * 4 * 4 and mem["optimizer_state"] == 2 * 8 * 4 * 4  # AdamW: two moments
    assert st["peak_memory_bytes"] == mem["parameters"] + mem["gradients"] + mem["optimizer_state"] \
        + mem["peak_activations"]


def test_uneven_batch_counts_the_busiest_rank():
    """Batch 5 on 2 ranks: rank 0 holds 3 rows (the same 398 flops as above), rank 1 2 rows."""
    st = _linear(sw.Mesh((2,), ("dp",)), 5).plan.stats()
    assert st["flops_per_rank"] == 398 and abs(st["compute_time_s"] - 398e-9) < 1e-15


def test_gradient_all_reduce_formula_and_latency_per_dim():
    """("dp", 4), batch 8: the weight gradient's all_reduce sends 2 (n-1) ceil(32/n) * 4 bytes,
    the loss's 2 (n-1) ceil(1/n) * 4; an all_reduce pays 2 (n-1) latencies, a gradient's only
    its bucket's share of them (its bytes over bucket_bytes), as the ILP prices it."""
    cost = CostModel(bandwidth={"dp": 2e9}, latency={"dp": 1e-6}, flops=1e9, optimizer_state=1.0)
    grad, loss = 2 * 3 * 8 * 4, 2 * 3 * 1 * 4
    for bucket in (None, 1024):
        st = _linear(sw.Mesh((4,), ("dp",)), 8, cost=cost, bucket_bytes=bucket).plan.stats()
        assert st["comm_bytes"] == grad + loss
        grad_latency = 2 * 3 * 1e-6 * (1 if bucket is None else grad / bucket)
        want = 2 * 3 * 1e-6 + loss / 2e9 + grad_latency + grad / 2e9
        assert abs(st["comm_time_s"] - want) < 1e-15, (bucket, st["comm_time_s"], want)
        assert st["memory"]["optimizer_state"] == st["memory"]["parameters"]  # configurable


def test_slow_and_fast_mesh_dims_priced_apart():
    from tests.models import zoo

    mlp_tp = {"fc1.weight": {"tp": S(0)}, "fc1.bias": {"tp": S(0)}, "fc2.weight": {"tp": S(1)}}
    cost = CostModel(bandwidth={"dp": 1e9, "tp": 1e12}, latency=0)
    model, x, y, loss_fn = zoo.mlp(batch=6)
    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), x, loss_fn=loss_fn, example_targets=y,
                        input_placements={0: {"dp": S(0)}}, param_placements=mlp_tp, cost_model=cost)
    st = pm.plan.stats()
    by_dim = st["comm_bytes_by_dim"]
    assert by_dim["dp"] > 0 and by_dim["tp"] > 0 and by_dim["dp"] + by_dim["tp"] == st["comm_bytes"]
    assert abs(st["comm_time_s"] - (by_dim["dp"] / 1e9 + by_dim["tp"] / 1e12)) < 1e-15
    summary = pm.plan.summary()
    assert "cost per layer" in summary and "optimizer state" in summary
    reasons = {line.split()[0]: line for line in summary.splitlines()[-4:]}
    assert "given (param_placements)" in reasons["fc1.weight"] and "default" in reasons["fc2.bias"]


def test_ring_attention_send_recvs_are_counted_and_priced():
    """sp = 3, seq 8 (blocks 3, 3, 2: each shift sends the largest, padded), heads 4, head dim 4,
    batch 1: a k or v block is 1*4*3*4 = 48 floats. Forward: 2 shifts of k and v (384 B each);
    backward: 2 shifts of k, v, dk, dv (768 B) and one more of dk, dv (384 B)."""
    data = batches(False, seq=8, batch=1)
    pm = sw.parallelize(CausalLM(), sw.Mesh((3,), ("sp",)), data[0][0], input_placements={0: [S(1)]},
                        loss_fn=ce, example_targets=data[0][1], attention="ring", cost_model=LINEAR_COST)
    st = pm.plan.stats()
    ring = [s for s in pm.plan.collective_steps() if s.kind == "send_recv"]
    assert st["collectives"]["send_recv"] == 5 == len(ring)
    assert sorted(s.bytes for s in ring) == [384, 384, 384, 768, 768]
    assert st["comm_time_s"] >= sum(s.bytes for s in ring) * 1e-9  # priced: 1 ns per byte, no latency
    assert "ring send_recv" in pm.plan.summary()
    # the ILP prices them too: a ring node costs its compute plus its send/recvs
    from shardwise.search.ilp import EPS, node_cost

    for np_ in (n for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)):
        steps = np_.rule.comm(np_.call, np_.strategy, pm.plan.mesh)
        compute = pm.plan.costs.node_compute[np_.name]
        partials = sum(str(p).startswith("Partial") for o in np_.strategy.outs if o is not None for p in o)
        want = compute + sum(s.bytes for s in steps) * 1e-9 + EPS * partials
        assert steps and abs(node_cost(pm.planner, np_.call, np_.strategy) - want) < 1e-15


def test_nll_loss_total_weight_all_reduce_is_counted():
    """cross_entropy's 'mean' over a sequence-sharded input all-reduces the count of its targets
    (one float32; trace/microbatch.count_targets: the 'sum' loss over the count) before the loss
    reads it: 2 (n-1) ceil(1/n) * 4 bytes on sp = 3, one edge of the plan, no op collective."""
    data = batches(False, seq=8, batch=1)
    pm = sw.parallelize(CausalLM(), sw.Mesh((3,), ("sp",)), data[0][0], input_placements={0: [S(1)]},
                        loss_fn=ce, example_targets=data[0][1], attention="ring")
    nodes = pm.plan.prop.nodes
    count = [steps for dst, src, steps in pm.plan.edges if src != dst and src in nodes
             and nodes[src].call.op is torch.ops.aten.sum.default and steps]
    assert len(count) == 1 and [(s.kind, s.bytes) for s in count[0]] == [("all_reduce", 2 * 2 * 1 * 4)]
    assert not [dst for dst, src, steps in pm.plan.edges if dst == src and "nll_loss" in str(nodes[dst].call.op)]


def test_conv_flops_equal_the_formula():
    """Conv2d(3 -> 4, 3x3, padding 1) on [4, 3, 6, 6], batch-sharded on 2: per rank the output
    is [2, 4, 6, 6] = 288 elements, each 2 * 3 * 3 * 3 flops. Backward computes the weight and
    bias gradients only (the input needs none): 2 * 288 * 27 + 288."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3, padding=1)
    x, y = torch.randn(4, 3, 6, 6), torch.randn(4, 4, 6, 6)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=F.mse_loss, example_targets=(y,),
                        input_placements={0: [S(0)]})
    nodes = pm.plan.prop.nodes
    fwd = next(n for n, np_ in nodes.items() if np_.call.op == torch.ops.aten.convolution.default)
    bwd = next(n for n, np_ in nodes.items() if np_.call.op == torch.ops.aten.convolution_backward.default)
    assert pm.plan.costs.node_flops[fwd] == 2 * 288 * 27
    assert pm.plan.costs.node_flops[bwd] == 2 * 288 * 27 + 288


def test_compare_names_what_differs_and_the_costs():
    dp = _linear(sw.Mesh((2,), ("dp",)), 6)
    # the features split too (with the batch split, the weight is gathered as FSDP's, search/fsdp.py)
    tp = _linear(sw.Mesh((2,), ("dp",)), 6, x_dim=1, param_placements={"weight": [S(0)]})
    text = dp.plan.compare(tp.plan, names=("dp", "sharded"))
    a, b = dp.plan.stats(), tp.plan.stats()
    assert "est. step time" in text and "over 'dp'" in text
    assert f"{a['est_step_time_s'] * 1e9:.3g} ns" in text and f"{b['est_step_time_s'] * 1e9:.3g} ns" in text
    assert "nodes whose strategy differs" in text
    # sharded: mm takes x [6, 8] as it is (Shard(1)) and the weight [4, 8] from Shard(0) to
    # Shard(1): an all_to_all of [2, 4] floats (32 B); mse_loss all-reduces the partial [6, 4] output:
    # 2 * 1 * 12 * 4 B; mse_loss_backward reuses that move (0 B)
    assert "mm (mm): dp [S(0)] [R] -> [S(0)] (moves 0 B, compute 192 ns)" in text
    assert "| sharded [S(1)] [S(0)] -> [P] (moves 32 B, compute 192 ns)" in text
    assert "sharded [R] [R] -> [R] (moves 96 B" in text and "sharded [R] [R] [R] -> [R] (moves 0 B" in text
    assert "weight: dp [R] (default" in text and "sharded [S(0)] (given (param_placements))" in text
    assert "parameters: placed alike" in dp.plan.compare(dp.plan)
