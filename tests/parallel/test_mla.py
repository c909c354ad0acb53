"""Multi-head Latent Attention (DeepSeek-V2/V3) under sequence parallelism: Hugging Face's sdpa
path calls F.scaled_dot_product_attention with a value head size (8) unlike the query/key one
(12), which no fused kernel takes (torch decomposes it into its math); the trace sends it to
shardwise.attention, so ``attention="ring"`` and ``"ulysses"`` act on it. 7 tokens on a 2-rank
"sp" mesh (uneven): loss and every gradient equal one device, and AdamW's step after.
A request the graph cannot honour names the attention calls passed over and why.

    python -m pytest tests/parallel/test_mla.py -q -p no:cacheprovider
"""
import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Shard as S
from tests.models.zoo import _hf_case

from .harness import check_training

ATTN = torch.ops.shardwise.attention.default
SEQUENCE = {"input_ids": [S(1)], "labels": [S(1)]}
ADAM = dict(lr=1e-3, optim_kwargs={"eps": 1e-2})  # as test_hf_families: a key bias's zero gradient is noise
EXPECTED_TAG = {"ulysses": "leading", "ring": "ring"}
# E = qk_nope_head_dim + qk_rope_head_dim = 12, Ev = v_head_dim = 8; one dense layer
MLA = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
           max_position_embeddings=32, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8,
           qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, use_cache=False, bos_token_id=0, eos_token_id=0,
           pad_token_id=0, attn_implementation="sdpa")


def deepseek(version: int = 3, seq: int = 7, **overrides):
    import transformers

    name = f"DeepseekV{version}"
    cfg = getattr(transformers, f"{name}Config")(**{**MLA, **overrides})
    torch.manual_seed(0)
    return _hf_case(getattr(transformers, f"{name}ForCausalLM")(cfg), torch.float32, 1, seq, 64)


def _attention_tags(pm) -> set:
    return {n.strategy.tags for n in pm.plan.prop.nodes.values() if "shardwise.attention" in str(n.call.op)}


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_deepseek_v3_sequence_parallel_exact(mode):
    case = deepseek(3)
    attn = case.model.model.layers[0].self_attn
    assert attn.qk_head_dim == 12 and attn.v_head_dim == 8  # what the test is about
    pm = check_training(case.model, sw.Mesh((2,), ("sp",)), case.example_inputs, input_placements=SEQUENCE,
                        attention=mode, **ADAM)
    traced = pm.plan.traced
    assert ATTN in traced.ops() and torch.ops.aten._safe_softmax.default not in traced.ops(), traced.notes
    assert any("value head size unlike the query's" in note for note in traced.notes), traced.notes
    assert _attention_tags(pm) == {(EXPECTED_TAG[mode],)}, pm.plan.summary()
    if mode == "ring":
        assert "ring_attention_local(" in pm.plan.program(0)


@pytest.mark.slow
def test_deepseek_v2_ring_exact():
    """DeepSeek-V2 (before: the request's error pointed at the router's softmax)."""
    case = deepseek(2)
    pm = check_training(case.model, sw.Mesh((2,), ("sp",)), case.example_inputs, input_placements=SEQUENCE,
                        attention="ring", **ADAM)
    assert _attention_tags(pm) == {("ring",)}, pm.plan.summary()


class Attn(torch.nn.Module):
    """One sdpa call on [batch, heads, seq, dim] projections with value head size ``ev``."""

    def __init__(self, dim=16, heads=2, ev=4, dropout=0.0, three_d=False):
        super().__init__()
        self.heads, self.ev, self.dropout, self.three_d = heads, ev, dropout, three_d
        self.qk = torch.nn.Linear(dim, 2 * dim)
        self.v = torch.nn.Linear(dim, heads * ev)
        self.out = torch.nn.Linear(heads * ev, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self.qk(x).unflatten(-1, (2 * self.heads, -1)).transpose(1, 2).chunk(2, dim=1)
        v = self.v(x).unflatten(-1, (self.heads, self.ev)).transpose(1, 2)
        if self.three_d:
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        return self.out(a.reshape(b, self.heads, s, self.ev).transpose(1, 2).flatten(-2)).pow(2).mean()


def test_hand_written_mla_call_ring_uneven():
    torch.manual_seed(0)
    model, x = Attn(), torch.randn(2, 7, 16)
    pm = check_training(model, sw.Mesh((3,), ("sp",)), (x,), input_placements={0: [S(1)]}, attention="ring", **ADAM)
    assert _attention_tags(pm) == {("ring",)}, pm.plan.summary()


@pytest.mark.parametrize("variant, why", [
    (dict(dropout=0.1), "dropout_p=0.1 inside attention"),
    (dict(ev=8, dropout=0.1), "dropout_p=0.1 inside attention"),
    (dict(ev=8, three_d=True), "is not 4-d"),
])
def test_request_names_the_calls_passed_over(variant, why):
    """Dropout inside attention (value head size equal: aten's kernel kept; unlike: torch's math),
    3-d inputs: the error names the call by its source line and says why."""
    torch.manual_seed(0)
    model, x = Attn(**variant).train(), torch.randn(2, 6, 16)
    with pytest.raises(sw.ShardingError, match="attention='ring' cannot be honoured") as e:
        sw.parallelize(model, sw.Mesh((2,), ("sp",)), (x,), input_placements={0: [S(1)]}, attention="ring")
    msg = str(e.value)
    assert why in msg and "test_mla.py" in msg and "F.scaled_dot_product_attention(q, k, v" in msg, msg
    assert "passed over" in msg and "router" not in msg


def test_request_names_a_router_free_softmax():
    """A model whose only softmax is a router's (2-d) has no attention to name: the error says so
    rather than pointing at the router."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4)

        def forward(self, x):
            return (self.gate(x).softmax(-1) * x[..., :4]).sum()

    with pytest.raises(sw.ShardingError, match="no scaled_dot_product_attention call and no softmax of scores"):
        sw.parallelize(Router(), sw.Mesh((2,), ("sp",)), (torch.randn(6, 8),), input_placements={0: [S(0)]},
                       attention="ulysses")
