"""Sequence parallelism through the attention op: the sequence at dim 0 or 1 of the tokens,
sharded on 2 and 4 ranks, lengths that do not divide; Ulysses, ring and gathered-KV alike.
Every batch's loss and every gradient equal the single-device run."""
import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate as R, Shard as S
from shardwise.core.cost import CostModel
from tests.models import zoo

from .harness import check_training


class CausalLM(torch.nn.Module):
    """embedding -> causal attention -> projection -> logits; tokens and activations batch-first
    ([batch, seq], [batch, seq, h]) or sequence-first ([seq, batch], [seq, batch, h])."""

    def __init__(self, vocab=11, hidden=16, heads=4, kv_heads=4, seq_first=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.seq_first = heads, kv_heads, seq_first
        self.emb = torch.nn.Embedding(vocab, hidden)
        d = hidden // heads
        self.q = torch.nn.Linear(hidden, hidden)
        # no key bias: its gradient is exactly zero in theory (softmax ignores a per-row shift), so
        # only rounding noise remains, which AdamW's normalisation would blow up to +-lr
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * d, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)  # [batch, seq, h], or [seq, batch, h] when seq_first
        h = x.shape[-1]
        d = h // self.heads
        # to attention's [batch, heads, seq, head_dim] from either activation layout
        order = (1, 2, 0, 3) if self.seq_first else (0, 2, 1, 3)
        q = self.q(x).unflatten(-1, (self.heads, d)).permute(order)
        k, v = self.kv(x).unflatten(-1, (2 * self.kv_heads, d)).permute(order).chunk(2, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        a = a.permute(2, 0, 1, 3) if self.seq_first else a.transpose(1, 2)
        y = self.proj(a.flatten(-2)) + x
        return self.head(y)


def ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def batches(seq_first, seq=7, batch=2, n=3, vocab=11):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        y[0, : i + 1] = -100  # a different number of ignored tokens on each shard and batch
        y[-1, -2:] = -100
        if seq_first:
            x, y = x.t().contiguous(), y.t().contiguous()
        out.append(((x,), (y,)))
    return out


def attention_nodes(pm):
    return [n for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)]


# Linear layers flatten activations ([b, s, h] -> [b*s, h]). Sequence-first, a sequence shard
# stays a shard of the flattened rows in whole blocks of the batch (Shard(0, unit=batch)), even
# or not; batch-first it becomes the rank's chunk of every sequence (Shard(0, groups=batch)).
LAYOUTS = [(False, 1, 7), (False, 2, 7), (True, 1, 7), (True, 2, 8), (True, 2, 7)]  # (seq_first, batch, seq)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("seq_first, batch, seq", LAYOUTS)
@pytest.mark.parametrize("mode", ["ulysses", "ring", "gather"])
def test_sequence_parallel_exact(mode, seq_first, batch, seq, ranks):
    data = batches(seq_first, seq=seq, batch=batch)
    seq_dim = 0 if seq_first else 1
    pm = check_training(CausalLM(seq_first=seq_first), sw.Mesh((ranks,), ("sp",)), data[0][0], data[0][1], ce,
                        batches=data, input_placements={"tokens": [S(seq_dim)]}, attention=mode)
    (fwd, bwd) = attention_nodes(pm)
    expected = {"ulysses": "leading", "ring": "ring", "gather": "seq_gather"}[mode]
    assert fwd.strategy.tags == (expected,) and bwd.strategy.tags == (expected,), pm.plan.summary()
    if mode == "ulysses":  # Shard(seq) -> Shard(heads) for q, k, v; the output goes back
        a2a = [s for n in (fwd, bwd) for s in n.comm_steps if s.kind == "all_to_all"]
        assert len(a2a) >= 3, pm.plan.summary()
    else:  # queries stay sequence-sharded: no all-to-all anywhere
        assert "all_to_all" not in pm.plan.stats()["collectives"], pm.plan.summary()


def test_ring_program_rotates_kv():
    data = batches(False, seq=9, batch=1)
    pm = sw.parallelize(CausalLM(), sw.Mesh((3,), ("sp",)), data[0][0], input_placements={0: [S(1)]},
                        loss_fn=ce, example_targets=data[0][1], attention="ring")
    prog = pm.plan.program(0)
    assert prog.count("ring_attention_local(") == 1 and prog.count("ring_attention_backward_local(") == 1


def test_gqa_heads_sharded_consistently():
    data = batches(False, seq=6, batch=1)
    check_training(CausalLM(heads=4, kv_heads=2), sw.Mesh((2,), ("tp",)), data[0][0], data[0][1], ce,
                   batches=data, input_placements={0: [S(1)]}, attention="ulysses")


def test_2d_mesh_data_by_sequence():
    # one sequence per dp rank: the flatten keeps both shards (each rank's rows are contiguous)
    data = batches(False, seq=7, batch=2)
    pm = check_training(CausalLM(), sw.Mesh((2, 2), ("dp", "sp")), data[0][0], data[0][1], ce,
                        batches=data, input_placements={0: {"dp": S(0), "sp": S(1)}}, attention="ring")
    fwd, _ = attention_nodes(pm)
    assert fwd.strategy.tags == ("leading", "ring"), pm.plan.summary()


def test_unknown_attention_mode():
    data = batches(False)
    with pytest.raises(sw.ShardingError, match="unknown attention mode"):
        sw.parallelize(CausalLM(), sw.Mesh((2,)), data[0][0], input_placements={0: [S(1)]}, loss_fn=ce,
                       attention="zigzag")


# Planned by the ILP (planner="ilp") under a cost model of the long-context regime: no latency
# and slow compute (1 Gflop/s per rank), so sharding the sequence pays for the all-to-alls. At
# these toy sizes with the default figures replicating the whole model after gathering 128
# token ids is (correctly) cheaper, and the greedy propagation returns to the sequence through
# a row-parallel contraction after the first layer instead.
LONG_CONTEXT = CostModel(latency=0, flops=1e9)


def gpt2_sequence_parallel(ranks, mode, seq=128):
    model, inputs, targets, loss_fn = zoo.MODELS["gpt2"](batch=1, seq=seq)
    spec = {"input_ids": [S(1)], "labels": [S(1)]}
    whole = {n: [sw.Replicate()] for n, _ in model.named_parameters()}  # sequence parallel: parameters whole
    return model, inputs, targets, loss_fn, dict(input_placements=spec, attention=mode, planner="ilp",
                                                  cost_model=LONG_CONTEXT, param_placements=whole)


@pytest.mark.parametrize("ranks", [2, 4])
def test_gpt2_ulysses_program(ranks):
    """Per layer, the all-to-alls around attention move 4 N h / P values per rank in forward
    (q, k and v from sequence to heads, the output back; N tokens, h hidden, P ranks), of
    which the (P - 1) / P that leave the rank are sent; attention runs head-sharded; no other
    all-to-all (the MLP stays token-sharded between layers) and the mask is not moved per layer."""
    model, inputs, targets, loss_fn, kw = gpt2_sequence_parallel(ranks, "ulysses")
    if ranks == 2:  # one exactness check of the ILP's plan (loss and every gradient)
        pm = check_training(model, sw.Mesh((ranks,), ("sp",)), inputs, targets, loss_fn, **kw)
    else:
        pm = sw.parallelize(model, sw.Mesh((ranks,), ("sp",)), inputs, **kw)
    cfg, (ids,) = model.config, inputs[:1]
    n_tokens, h, layers = ids.numel(), cfg.n_embd, cfg.n_layer
    fwd = [n for n in attention_nodes(pm) if "backward" not in str(n.call.op)]
    assert len(fwd) == layers and all(n.strategy.tags == ("leading",) for n in fwd), pm.plan.summary()
    assert all(n.strategy.ins[0][0] == S(1) for n in fwd), pm.plan.summary()  # [b, heads, s, d]: heads
    a2a = [s for s in forward_steps(pm) if s.kind == "all_to_all"]
    per_layer = 4 * n_tokens * h // ranks * (ranks - 1) // ranks * 4  # float32
    assert sum(s.bytes for s in a2a) == layers * per_layer, pm.plan.summary()
    assert len(a2a) in (2 * layers, 4 * layers), pm.plan.summary()  # q|k|v may move fused: one call
    seq = ids.shape[-1]  # the causal mask ([.., L, S]) is built once (trace merges the layers' copies): moved once
    masks = [s for s in forward_steps(pm) if s.is_collective and tuple(s.src.shape[-2:]) == (seq, seq)]
    assert len(masks) <= 1, pm.plan.summary()


def test_gpt2_ring_program():
    """Ring attention on GPT-2: one ring call per layer in forward and in backward, each with
    P - 1 key/value exchanges; the queries never leave their sequence shard (no all-to-all)."""
    model, inputs, targets, loss_fn, kw = gpt2_sequence_parallel(3, "ring", seq=96)
    pm = sw.parallelize(model, sw.Mesh((3,), ("sp",)), inputs, **kw)
    prog = pm.plan.program(0)
    layers = model.config.n_layer
    assert prog.count("ring_attention_local(") == layers, prog
    assert prog.count("ring_attention_backward_local(") == layers, prog
    assert not [s for s in forward_steps(pm) if s.kind == "all_to_all"], pm.plan.summary()


def forward_steps(pm):
    nodes = {n.name: n for n in pm.plan.prop.gm.graph.nodes}
    return [s for consumer, _src, steps in pm.plan.edges for s in steps
            if s.is_collective and consumer in nodes and not nodes[consumer].meta.get("autograd_backward")
            and consumer != "output"]
