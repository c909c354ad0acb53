"""Rule rows are named records: every property in the row, mistakes raise RuleError naming the
op, the registry loads once by its own flag, and strategies dropped by local-shape checks are
listed (by expand and by ``shardwise verify-rules``), not silently lost."""
from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.core.errors import RuleError
from shardwise.core.layout import Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import DEFAULT, LocalCall, OpCall, Registry, Rule, Strategy1D, TensorMeta, load_all
from shardwise.rules.common import R, einsum_strategies, replicate_all
from shardwise.rules.registry import LocalCtx, Strategy, expand, local_shape_refusal

aten = torch.ops.aten
MM = OpCall(aten.mm.default, (TensorMeta((4, 6), torch.float32), TensorMeta((6, 5), torch.float32)), {},
            (TensorMeta((4, 5), torch.float32),))


def _mm_strategies(call):
    return einsum_strategies("mk,kn->mn", call)


@pytest.mark.parametrize("kwargs, missing", [
    (dict(strategies=_mm_strategies), "blockwise"),
    (dict(blockwise=True), "strategies"),
    (dict(strategies=_mm_strategies, blockwise="yes"), "blockwise"),
    (dict(strategies=_mm_strategies, blockwise=False, local="not a function"), "local"),
])
def test_row_missing_a_property_names_the_op(kwargs, missing):
    with pytest.raises(RuleError, match=rf"aten\.mm\.default.*{missing}") as e:
        Rule(aten.mm.default, **kwargs)
    assert e.value.fix


def test_row_without_ops_is_refused():
    with pytest.raises(RuleError, match="no op"):
        Rule([], _mm_strategies, blockwise=True)


def test_a_row_maps_each_of_its_ops():
    reg = Registry()
    row = Rule([aten.mm.default, aten.bmm.default], _mm_strategies, blockwise=True)
    reg.add(row)
    assert reg.get(aten.mm.default) is row and reg.get(aten.bmm.default) is row
    assert row.name == "_mm_strategies" and row.ops == (aten.mm.default, aten.bmm.default)


def test_a_user_rule_states_every_property_of_its_row():
    reg = Registry()
    valid = lambda call, st, mesh: True  # noqa: E731
    sw.rule(aten.mm.default, blockwise=True, valid=valid, registry=reg)(_mm_strategies)
    row = reg.get(aten.mm.default)
    assert row.blockwise and row.valid is valid and row.local is None and row.name == "_mm_strategies"
    sw.rule(aten.bmm.default, registry=reg)(_mm_strategies)
    assert reg.get(aten.bmm.default).blockwise is False  # not restated with unit shards unless it says so


def test_builtin_rows_carry_blockwise_themselves():
    """Elementwise, contraction and view rows say blockwise=True; index- and offset-based rows False."""
    reg = load_all(DEFAULT)
    assert reg.get(aten.mm.default).blockwise and reg.get(aten.view.default).blockwise
    assert reg.get(aten.native_batch_norm.default).blockwise  # sync statistics are sums over any chunks
    assert not reg.get(aten.embedding.default).blockwise and not reg.get(aten.index.Tensor).blockwise
    assert reg.get(aten.view.default).valid is not None  # given in the row, not patched in


def test_registry_loads_once_by_its_own_flag():
    reg = Registry()
    assert not reg.loaded
    load_all(reg)
    assert reg.loaded and aten.mm.default in reg
    custom = Rule(aten.mm.default, lambda call: [replicate_all(call)], blockwise=False)
    reg.add(custom)
    assert load_all(reg).get(aten.mm.default) is custom  # a second load does not re-register the families
    twin = reg.copy()
    assert twin.loaded and twin.get(aten.mm.default) is custom and twin.ops() == reg.ops()


def test_einsum_spec_with_the_wrong_operand_count_raises_rule_error():
    with pytest.raises(RuleError, match=r"aten\.mm\.default"):
        einsum_strategies("mk,kn,n->mn", MM)


def _raising_local(ctx):
    return {}["no such key"]


def test_user_rule_whose_local_args_raise_names_the_op():
    """A @sw.rule whose local function raises: the first call stops with a RuleError naming the
    rule and the op (not a KeyError from deep in lowering)."""
    reg = load_all(Registry())
    sw.rule(aten.mm.default, local=_raising_local, registry=reg)(_mm_strategies)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5, bias=False)
    with pytest.raises(RuleError, match=r"_mm_strategies for aten\.mm\.default raised KeyError") as e:
        sw.parallelize(model, Mesh((2,)), (torch.randn(4, 6),), registry=reg)(torch.randn(4, 6))
    assert isinstance(e.value.__cause__, KeyError) and e.value.fix


def _shard_rows(call):
    return [replicate_all(call), Strategy1D((Shard(0),), (Shard(0),))]


def _wrong_on_rank1(ctx: LocalCtx):
    """Right on rank 0; on rank 1 a local call whose output has the wrong shape."""
    if ctx.rank == 1 and isinstance(ctx.strategy.ins[0][0], Shard):
        return LocalCall(aten.repeat.default, (ctx.call.ins[0], [2, 1]), {})
    return LocalCall(ctx.call.op, ctx.call.args, ctx.call.kwargs)


NEG = OpCall(aten.neg.default, (TensorMeta((5, 3), torch.float32),), {}, (TensorMeta((5, 3), torch.float32),))


def test_expand_lists_what_the_local_shape_check_drops():
    rule = Rule(aten.neg.default, _shard_rows, _wrong_on_rank1, shape_sensitive=True, blockwise=False)
    dropped: list = []
    kept = expand(NEG, rule, Mesh((2,)), dropped)
    assert kept == [Strategy(((R,),), ((R,),))]
    [(st, why)] = dropped
    assert st.ins == ((Shard(0),),) and why == "rank 1: output 0 is [4, 3]:torch.float32, the layout says [2, 3]:torch.float32"


def test_local_args_that_refuse_drop_and_other_errors_raise():
    """A ValueError from local args refuses the strategy (dropped, with the reason); a TypeError
    is a bug in the rule and raises a RuleError naming the op."""
    st = Strategy(((Shard(0),),), ((Shard(0),),))

    def refuse(ctx):
        raise ValueError("no single offset")

    def buggy(ctx):
        return None + 1

    why = local_shape_refusal(NEG, Rule(aten.neg.default, _shard_rows, refuse, blockwise=False), st, Mesh((2,)))
    assert why == "rank 0: local args raised ValueError: no single offset"
    with pytest.raises(RuleError, match=r"_shard_rows for aten\.neg\.default raised TypeError"):
        local_shape_refusal(NEG, Rule(aten.neg.default, _shard_rows, buggy, blockwise=False), st, Mesh((2,)))


def test_verify_rules_lists_dropped_strategies():
    from shardwise.tools.verify.samples import Sample
    from shardwise.tools.verify.sweep import sweep

    reg = Registry([Rule(aten.neg.default, _shard_rows, _wrong_on_rank1, shape_sensitive=True, blockwise=False)])
    sample = Sample(aten.neg.default, (torch.randn(5, 3),), {}, "table")
    report = sweep(reg, samples={aten.neg.default: [sample]}, meshes=((2,),))
    assert report.ok, report.failure_text()
    text = report.dropped_text()
    assert text == ("DROPPED aten.neg.default mesh=(2,): rank 1: output 0 is [4, 3]:torch.float32, the layout "
                    "says [2, 3]:torch.float32\n    ([Shard(0)]) -> ([Shard(0)])"), text


def test_replicate_is_one_object():
    assert R == Replicate()
