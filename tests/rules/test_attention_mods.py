"""The attention rule with score modifications, verified numerically: every strategy (batch- and
head-sharded, Ulysses' head split with ALiBi slopes sliced by head, sequence-sharded queries
with gathered keys, ring with the document ids rotating, partial) of the forward and backward
op on meshes (2,), (3,), (2, 2), sizes that split unevenly (5 positions, 4 heads).

    python -m pytest tests/rules/test_attention_mods.py -q
"""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.core.layout import Partial, Replicate, Shard as S
from shardwise.ops.attention import AttentionSettings
from shardwise.ops.attention.mods import Mods
from shardwise.rules.attention import attention_strategies
from shardwise.rules.registry import OpCall

R = Replicate()
FWD = torch.ops.shardwise.attention.default
BWD = torch.ops.shardwise.attention_backward.default


def _sample(hk=2, bias_shape=(2, 1, 5, 5), alibi=True, docs=True, mask=True, seed=0, **settings):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, hk, hk))
    doc = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    mods = Mods(None if bias_shape is None else torch.randn(*bias_shape, generator=g),
                torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None,
                doc if docs else None, doc.clone() if docs else None)
    m = (torch.rand(5, 5, generator=g) > 0.2) | torch.eye(5, dtype=torch.bool) if mask else None
    st = AttentionSettings(enable_gqa=hk != 4, **settings)
    out, lse = FWD(q, k, v, m, *st.to_op_args(), *mods)
    fwd = (q, k, v, m, *st.to_op_args(), *mods)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    bwd = (go, gl, q, k, v, m, out, lse, *st.to_op_args(), *mods, mods.bias is not None)
    return fwd, bwd


EVERYTHING = dict(is_causal=True, softcap=0.7, scale=0.5, window_left=2)
SAMPLES = {
    "everything": dict(**EVERYTHING),
    "bias_over_keys_only": dict(bias_shape=(1, 4, 1, 5), alibi=False, docs=False, mask=False, alibi_key_only=True),
    "multi_query_alibi": dict(hk=1, bias_shape=None, docs=False, is_causal=True, window_right=0),
    "two_sided_window_docs": dict(hk=4, bias_shape=None, alibi=False, mask=False, window_left=1, window_right=2),
}


def _check(report):
    assert report.ok, report
    assert len(report.results) > 40, report  # every strategy on three meshes, not a few


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_every_strategy_with_every_mod_matches_one_device(which):
    fwd, bwd = _sample(**SAMPLES["everything"])
    _check(sw.verify_rule(FWD if which == "forward" else BWD, *(fwd if which == "forward" else bwd)))


@pytest.mark.parametrize("which", ["forward", "backward"])
@pytest.mark.parametrize("name", ["multi_query_alibi", pytest.param("bias_over_keys_only", marks=pytest.mark.slow),
                                  pytest.param("two_sided_window_docs", marks=pytest.mark.slow)])
def test_every_strategy_matches_one_device(name, which):
    fwd, bwd = _sample(**SAMPLES[name])
    _check(sw.verify_rule(FWD if which == "forward" else BWD, *(fwd if which == "forward" else bwd)))


def _strategies(args, op=FWD):
    """({tag: strategy} of the sequence and partial strategies, [the "leading" ones]) on one mesh dim."""
    sts = attention_strategies(OpCall.from_values(op, args, {}, op(*args)))
    return {st.tag: st for st in sts if st.tag not in ("", "leading")}, [st for st in sts if st.tag == "leading"]


def test_where_the_mods_go():
    """Ulysses (heads) slices the slopes, the bias and the mask follow the rows or heads they have,
    document ids shard with the tokens (keys' ids in the ring), the bias gradient is a partial sum
    where the bias broadcasts over the split dim."""
    fwd, bwd = _sample(**SAMPLES["everything"])  # q, k, v, mask, settings..., bias, slopes, q_doc, k_doc
    by_tag, leading = _strategies(fwd)
    heads = next(st for st in leading if st.ins[0] == S(1))
    # q k v mask bias [2,1,5,5] slopes q_doc k_doc
    assert heads.ins == (S(1), S(1), S(1), R, R, S(0), R, R)
    batch = next(st for st in leading if st.ins[0] == S(0))
    assert batch.ins == (S(0), S(0), S(0), R, S(0), R, S(0), S(0))
    assert by_tag["ring"].ins == (S(2), S(2), S(2), S(0), S(2), R, S(1), S(1))
    assert by_tag["seq_gather"].ins == (S(2), R, R, S(0), S(2), R, S(1), R)
    by_tag, leading = _strategies(bwd, BWD)
    assert next(st for st in leading if st.ins[2] == S(1)).outs == (S(1), S(1), S(1), Partial())  # bias: no heads
    assert next(st for st in leading if st.ins[2] == S(0)).outs == (S(0), S(0), S(0), S(0))
    assert by_tag["ring"].outs == (S(2), S(2), S(2), S(2))
    assert by_tag["partial"].outs == (Partial(),) * 4


def test_multi_query_heads_split_with_the_kv_head_whole():
    fwd, bwd = _sample(**SAMPLES["multi_query_alibi"])
    _, leading = _strategies(fwd)
    assert any(st.ins[:3] == (S(1), R, R) and st.outs == (S(1), S(1)) for st in leading)
    _, leading = _strategies(bwd, BWD)
    assert any(st.ins[2:5] == (S(1), R, R) and st.outs[:3] == (S(1), Partial(), Partial()) for st in leading)
