"""The one cost model (shardwise/core/cost.py; node_time: search/flops.py): byte formulas, alpha-beta per
mesh dim by name, presets, roofline compute, and the redistribution search pricing with the same
formulas. Every figure is checked against a formula written out here, never against the code's own output."""
import pytest
import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard as S
from shardwise.core.errors import ShardingError
from shardwise.core.cost import PRESETS, CostModel, sent_bytes
from shardwise.search.flops import bytes_moved, flops, node_time
from shardwise.rules.registry import OpCall, Strategy

aten = torch.ops.aten
R, P = Replicate(), Partial()
DP_TP = sw.Mesh((2, 2), ("dp", "tp"))


def test_sent_bytes_are_the_ring_formulas():
    assert sent_bytes("all_gather", 4, 10, 4) == 3 * 10 * 4
    assert sent_bytes("reduce_scatter", 4, 10, 2) == 3 * 10 * 2
    assert sent_bytes("all_reduce", 4, 10, 4) == 2 * 3 * 3 * 4  # ceil(10 / 4) = 3 per chunk
    assert sent_bytes("all_to_all", 3, 7, 4) == 2 * 7 * 4
    assert sent_bytes("send_recv", 8, 5, 4) == 5 * 4
    assert sent_bytes("all_reduce", 1, 10, 4) == 0 and sent_bytes("slice", 4, 10, 4) == 0
    with pytest.raises(ShardingError):
        sent_bytes("broadcastish", 2, 1, 4)


def test_alpha_beta_per_mesh_dim_by_name():
    cost = CostModel(bandwidth={"tp": 400e9, "dp": 20e9}, latency={"tp": 1e-6, "dp": 10e-6})
    nbytes = 3 << 20
    assert cost.collective_time("all_gather", nbytes, 2, "tp", DP_TP) == pytest.approx(1e-6 + nbytes / 400e9)
    assert cost.collective_time("all_reduce", nbytes, 2, 0, DP_TP) == pytest.approx(2 * 10e-6 + nbytes / 20e9)
    assert cost.collective_time("send_recv", nbytes, 4, "tp", DP_TP) == pytest.approx(1e-6 + nbytes / 400e9)
    # a name the dict lacks takes the default link
    mesh = sw.Mesh((2,), ("sp",))
    assert cost.collective_time("all_gather", 100, 2, 0, mesh) == pytest.approx(5e-6 + 100 / 50e9)


def test_presets_and_slow_dims():
    h100 = CostModel.preset("h100", slow=("dp",))
    assert h100.flops == 989e12 and h100.memory_bandwidth == 3.35e12
    assert h100.bandwidth_of("tp", DP_TP) == 450e9 and h100.latency_of("tp", DP_TP) == 2e-6
    assert h100.bandwidth_of("dp", DP_TP) == 50e9 and h100.latency_of("dp", DP_TP) == 5e-6
    a100 = CostModel.preset("a100")
    assert a100.bandwidth_of(0, DP_TP) == a100.bandwidth_of(1, DP_TP) == 300e9
    assert CostModel.preset("cpu", flops=1e9).flops == 1e9
    assert set(PRESETS) == {"cpu", "a100", "h100"}
    assert hash(h100) != hash(CostModel.preset("h100"))  # the redistribution memo is keyed by cost model
    with pytest.raises(ShardingError, match="unknown cost preset"):
        CostModel.preset("tpu")
    with pytest.raises(ShardingError):
        CostModel(memory_bandwidth=0)
    with pytest.raises(ShardingError):
        CostModel(optimizer_state=-1)


def _call(op, *args):
    return OpCall.from_values(op, args, {}, op(*args))


def test_roofline_compute_time():
    mm = _call(aten.mm.default, torch.randn(8, 16), torch.randn(16, 4))
    rows = Strategy(((S(0),),), ((S(0),), (R,)))
    mesh = sw.Mesh((2,), ("tp",))
    assert flops(mm, rows, mesh) == 2 * 4 * 4 * 16
    assert bytes_moved(mm, rows, mesh) == (4 * 16 + 16 * 4 + 4 * 4) * 4
    fast_mem = CostModel(flops=1e9, memory_bandwidth=1e12)
    assert node_time(fast_mem, mm, rows, mesh) == pytest.approx(2 * 4 * 4 * 16 / 1e9)  # flop bound
    slow_mem = CostModel(flops=1e12, memory_bandwidth=1e6)
    assert node_time(slow_mem, mm, rows, mesh) == pytest.approx((4 * 16 + 16 * 4 + 4 * 4) * 4 / 1e6)  # memory bound
    assert node_time(CostModel(flops=1e9), mm, rows, mesh) == pytest.approx(2 * 4 * 4 * 16 / 1e9)  # flops only
    view = _call(aten.view.default, torch.randn(8, 4), [32])
    assert bytes_moved(view, Strategy(((R,),), ((R,),)), mesh) == 0


def test_optimizer_bytes():
    assert CostModel().optimizer_bytes(1000) == 2000  # AdamW: two moments
    assert CostModel(optimizer_state=1.0).optimizer_bytes(1000) == 1000


def test_redistribution_bytes_use_the_formulas():
    """all_reduce of a [10, 3] float32 over 4 ranks: 2 * 3 * ceil(30 / 4) * 4 bytes; an uneven
    all_gather of [5, 3] over 2: the padded chunk (3 rows) once."""
    mesh = sw.Mesh((4,), ("dp",))
    (ar,) = sw.plan_redistribute(sw.Layout((10, 3), torch.float32, (P,)), (R,), mesh)
    assert ar.kind == "all_reduce" and ar.bytes == 2 * 3 * 8 * 4
    (ag,) = sw.plan_redistribute(sw.Layout((5, 3), torch.float32, (S(0),)), (R,), sw.Mesh((2,), ("dp",)))
    assert ag.kind == "all_gather" and ag.bytes == 1 * 3 * 3 * 4


def test_bucketed_time_shares_the_latency():
    """A 1 KiB gradient all_reduce over 4 ranks in 4 KiB buckets pays its bandwidth term and a
    quarter of the 2 (n-1) latencies; other kinds, or no buckets, pay them all."""
    mesh = sw.Mesh((4,), ("dp",))
    cost = CostModel(bandwidth=1e9, latency=1e-6)
    (ar,) = sw.plan_redistribute(sw.Layout((256,), torch.float32, (P,)), (R,), mesh, cost)
    assert ar.bytes == 2 * 3 * 64 * 4
    full = 6e-6 + ar.bytes / 1e9
    assert cost.bucketed_time(ar, mesh, None) == pytest.approx(full)
    assert cost.bucketed_time(ar, mesh, 4 * ar.bytes) == pytest.approx(6e-6 / 4 + ar.bytes / 1e9)
    assert cost.bucketed_time(ar, mesh, ar.bytes // 2) == pytest.approx(full)  # larger than a bucket
    (ag,) = sw.plan_redistribute(sw.Layout((256,), torch.float32, (S(0),)), (R,), mesh, cost)
    assert cost.bucketed_time(ag, mesh, 1 << 20) == pytest.approx(3e-6 + ag.bytes / 1e9)
