"""sw.recipes: Megatron plans as data for GPT-2 (Conv1D), Llama, BERT-style and fused-qkv GPTs,
FSDP, sequence, merging; wrong uses raise ShardingError with a fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Replicate as R, Shard as S
from shardwise.tools.demo.model import GPT, GPTConfig


class Conv1D(nn.Module):
    """Shaped like Hugging Face's Conv1D: weight [in, out]."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


def _gpt2_like():
    blk = nn.Module()
    blk.attn = nn.Module()
    blk.attn.c_attn, blk.attn.c_proj = Conv1D(8, 24), Conv1D(8, 8)
    blk.mlp = nn.Module()
    blk.mlp.c_fc, blk.mlp.c_proj = Conv1D(8, 32), Conv1D(32, 8)
    m = nn.Module()
    m.h = nn.ModuleList([blk])
    return m


def _bert_like():
    layer = nn.Module()
    layer.attention = nn.Module()
    layer.attention.self = nn.Module()
    for n in ("query", "key", "value"):
        setattr(layer.attention.self, n, nn.Linear(8, 8))
    layer.attention.output = nn.Module()
    layer.attention.output.dense = nn.Linear(8, 8)
    layer.intermediate = nn.Module()
    layer.intermediate.dense = nn.Linear(8, 32)
    layer.output = nn.Module()
    layer.output.dense = nn.Linear(32, 8)
    enc = nn.Module()
    enc.layer = nn.ModuleList([layer])
    m = nn.Module()
    m.encoder = enc
    return m


def test_gpt2_conv1d_weights_are_split_on_the_other_dim():
    got = sw.recipes.megatron(_gpt2_like())
    assert got == {"h.0.attn.c_attn.weight": S(1, groups=3), "h.0.attn.c_attn.bias": S(0, groups=3),
                   "h.0.attn.c_proj.weight": S(0), "h.0.mlp.c_fc.weight": S(1), "h.0.mlp.c_fc.bias": S(0),
                   "h.0.mlp.c_proj.weight": S(0)}


def test_bert_family_detected_with_mesh_dim():
    got = sw.recipes.megatron(_bert_like(), "tp")
    assert sw.recipes.detect_family(_bert_like()) == "bert"
    assert got["encoder.layer.0.attention.self.query.weight"] == {"tp": S(0)}
    assert got["encoder.layer.0.attention.self.value.bias"] == {"tp": S(0)}
    assert got["encoder.layer.0.attention.output.dense.weight"] == {"tp": S(1)}
    assert "encoder.layer.0.attention.output.dense.bias" not in got  # rowwise bias stays whole
    assert got["encoder.layer.0.intermediate.dense.weight"] == {"tp": S(0)}
    assert got["encoder.layer.0.output.dense.weight"] == {"tp": S(1)}


def test_demo_gpt_and_fsdp_merge():
    model = GPT(GPTConfig(vocab=11, dim=16, heads=2, layers=1, max_len=8))
    tp = sw.recipes.megatron(model, "tp")
    assert tp["blocks.0.attn.qkv.weight"] == {"tp": S(0, groups=3)}
    assert tp["blocks.0.attn.proj.weight"] == {"tp": S(1)}
    fsdp = sw.recipes.fsdp(model, "dp")
    assert set(fsdp) == {n for n, _ in model.named_parameters()}
    with pytest.raises(sw.ShardingError, match="split in 3 groups on mesh dim 'tp'") as e:
        sw.recipes.merge(tp, fsdp)  # the fused qkv's dim 0 is in groups on "tp": FSDP cannot nest under it
    assert "beside=tp" in e.value.fix
    both = sw.recipes.merge(tp, sw.recipes.fsdp(model, "dp", beside=tp))
    # FSDP takes another dim only where Megatron's is in groups; a plain shard nests it as before
    assert both["blocks.0.mlp.up.weight"] == {"tp": S(0), "dp": S(0)}
    assert both["blocks.0.attn.qkv.weight"] == {"tp": S(0, groups=3), "dp": S(1)}
    assert both["blocks.0.attn.proj.weight"] == {"tp": S(1), "dp": S(0)}
    assert both["ln_f.weight"] == {"dp": S(0)}
    if "blocks.0.attn.qkv.bias" in both:  # 1-d and split in groups: whole on "dp"
        assert both["blocks.0.attn.qkv.bias"] == {"tp": S(0, groups=3)}
    assert sw.recipes.by_name("megatron+fsdp", model, ("dp", "tp")) == both
    assert all(v == {"sp": R()} for v in sw.recipes.sequence(model, "sp").values())
    assert sw.recipes.sequence_inputs("sp", 1, batch_dim="dp") == {0: {"sp": S(1), "dp": S(0)}}


def test_recipe_errors_name_the_fix():
    with pytest.raises(sw.ShardingError, match="no Megatron plan matches") as e:
        sw.recipes.megatron(nn.Sequential(nn.Linear(2, 2)))
    assert e.value.fix and "plan=" in e.value.fix
    model = GPT(GPTConfig(vocab=11, dim=16, heads=2, layers=1, max_len=8))
    with pytest.raises(sw.ShardingError, match="disagree"):
        sw.recipes.merge(sw.recipes.megatron(model, "tp"), {"blocks.0.attn.qkv.weight": {"tp": S(1)}})
    with pytest.raises(sw.ShardingError, match="unknown recipe"):
        sw.recipes.by_name("zero3", model, ("dp",))


def _hf_meta(config: str, model: str, **kw):
    import transformers

    sizes = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "vocab_size": 64, "pad_token_id": 0}
    cfg = getattr(transformers, config)(**{**sizes, **kw})
    with torch.device("meta"):
        return getattr(transformers, model)(cfg)


def test_family_is_the_one_naming_most_modules():
    """OPT's q/k/v projections match Llama's patterns too; its own plan also names out_proj, fc1 and fc2."""
    opt = _hf_meta("OPTConfig", "OPTForCausalLM", ffn_dim=64, word_embed_proj_dim=32)
    assert sw.recipes.detect_family(opt) == "opt"
    got = sw.recipes.megatron(opt, "tp")
    layer = "model.decoder.layers.0"
    assert got[f"{layer}.self_attn.out_proj.weight"] == {"tp": S(1)} and got[f"{layer}.fc2.weight"] == {"tp": S(1)}
    assert got[f"{layer}.fc1.weight"] == {"tp": S(0)} and got[f"{layer}.self_attn.q_proj.bias"] == {"tp": S(0)}
    phi3 = _hf_meta("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4)
    got = sw.recipes.megatron(phi3)
    assert got["model.layers.0.self_attn.qkv_proj.weight"] == S(0, groups=3)
    assert got["model.layers.0.mlp.gate_up_proj.weight"] == S(0, groups=2)


def test_fused_qkv_with_fewer_kv_heads_raises():
    """A fused projection with fewer key/value heads than query heads (grouped-query Phi-3, multi-query
    GPTBigCode) has no colwise split into whole heads: a typed error, not a plan that splits heads."""
    phi3 = _hf_meta("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2)
    with pytest.raises(sw.ShardingError, match="qkv_proj fuses q, k and v, with 2 key/value head") as e:
        sw.recipes.megatron(phi3, "tp")
    assert "plan=" in e.value.fix
    import transformers

    with torch.device("meta"):
        bigcode = transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(n_embd=32, n_layer=1, n_head=4,
                                                                                   vocab_size=64, pad_token_id=0))
    with pytest.raises(sw.ShardingError, match="1 key/value head"):
        sw.recipes.megatron(bigcode, "tp")


def test_megatron_heads_whole_only_where_size_does_not_divide_them():
    """size= names the tensor-parallel size: 6 heads of 8 on 4 ranks are split in whole heads (q, k, v,
    their biases, the attention output's input features); on 2 ranks, or without size, the plain
    shards (the same split); with fewer key/value heads (grouped-query), plain shards too. FSDP
    beside it shards those parameters on their other dim (units cannot nest in its chunks)."""
    mha = _hf_meta("Qwen2Config", "Qwen2ForCausalLM", hidden_size=48, num_attention_heads=6, num_key_value_heads=6)
    attn = "model.layers.0.self_attn"
    got = sw.recipes.megatron(mha, "tp", size=4)
    for n in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.bias"):
        assert got[f"{attn}.{n}"] == {"tp": S(0, unit=8)}, n
    assert got[f"{attn}.o_proj.weight"] == {"tp": S(1, unit=8)}
    mlp = "model.layers.0.mlp"
    assert got[f"{mlp}.up_proj.weight"] == {"tp": S(0)} and got[f"{mlp}.down_proj.weight"] == {"tp": S(1)}
    for size in (2, 3, 6, None):
        assert sw.recipes.megatron(mha, "tp", size=size)[f"{attn}.q_proj.weight"] == {"tp": S(0)}, size
    gqa = _hf_meta("Qwen2Config", "Qwen2ForCausalLM", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    assert sw.recipes.megatron(gqa, "tp", size=4)[f"{attn}.k_proj.weight"] == {"tp": S(0)}
    both = sw.recipes.merge(got, sw.recipes.fsdp(mha, "dp", beside=got))
    assert both[f"{attn}.q_proj.weight"] == {"tp": S(0, unit=8), "dp": S(1)}
    assert both["model.layers.0.mlp.up_proj.weight"] == {"tp": S(0), "dp": S(0)}
    assert sw.recipes.by_name("megatron", mha, ("dp", "tp"), (2, 4))[f"{attn}.v_proj.weight"] == {"tp": S(0, unit=8)}
