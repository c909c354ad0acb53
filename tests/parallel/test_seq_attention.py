"""Sequence parallelism through the attention op: the sequence at dim 0 or 1 of the tokens,
sharded on 2 and 4 ranks, lengths that do not divide; Ulysses, ring and gathered-KV alike.
Every batch's loss and every gradient equal the single-device run."""
import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Replicate as R, Shard as S

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
