"""Convolution rules (1-d, 2-d, 3-d; stride, padding, dilation, groups, transposed) checked
numerically on meshes (2,), (3,), (2, 2) with uneven sizes: batch, output-channel,
input-channel (Partial), group and spatial (halo) strategies, forward and backward.

Run: python -m pytest tests/rules/test_conv.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Layout, Partial, Replicate, Shard
from shardwise.core.mesh import Mesh
from shardwise.rules import halo

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
FWD, BWD = aten.convolution.default, aten.convolution_backward.default


_GEN = torch.Generator().manual_seed(0)  # the same inputs in every process, whatever ran before


def rnd(*shape):
    return torch.randn(shape, generator=_GEN)


def conv_args(x, w, b, stride, padding, dilation, groups, transposed=False, output_padding=None):
    nd = x.ndim - 2
    return (x, w, b, [stride] * nd, [padding] * nd, [dilation] * nd, transposed, output_padding or [0] * nd, groups)


def backward_args(fwd_args, mask=(True, True, True)):
    x, w, b = fwd_args[:3]
    out = FWD(*fwd_args)
    bias_sizes = None if b is None else [b.shape[0]]
    return (rnd(*out.shape), x, w, bias_sizes, *fwd_args[3:], list(mask))


CASES = {
    # 2-d, odd image (7 x 6), 5 images: uneven on 2 and 3 ranks, halo of 1
    "2d": conv_args(rnd(5, 4, 7, 6), rnd(6, 4, 3, 3), rnd(6), 1, 1, 1, 1),
    # stride 2, dilation 2, no bias, grouped (2 groups)
    "2d_grouped_strided": conv_args(rnd(5, 4, 9, 7), rnd(6, 2, 3, 2), None, 2, 1, 2, 2),
    # depthwise 1-d, 5 groups on 2 and 3 ranks, a long signal with stride and dilation
    "1d_depthwise": conv_args(rnd(3, 5, 13), rnd(5, 1, 3), rnd(5), 2, 2, 2, 5),
    # a halo wider than a neighbour's chunk (13 rows on 3 ranks: 5, 5, 3; kernel 5 dilated 2)
    "1d_wide_halo": conv_args(rnd(2, 3, 13), rnd(4, 3, 5), rnd(4), 1, 4, 2, 1),
    # one padding/stride value for every spatial dim (aten accepts it), halo on either dim
    "2d_single_values": (rnd(3, 2, 7, 6), rnd(3, 2, 3, 2), rnd(3), [2], [1], [1], False, [0], 1),
    # 3-d
    "3d": conv_args(rnd(3, 2, 5, 4, 3), rnd(3, 2, 3, 2, 2), rnd(3), 1, 1, 1, 1),
}


def expected_forward(x_ndim, grouped, cin_g=1, cout_g=1):
    out = [((S(0), R, R), (S(0),)), ((R, R, R), (R,))]
    out += [((S(d), R, R), (S(d),)) for d in range(2, x_ndim)]
    if grouped:
        out.append(((S(1, unit=cin_g), S(0, unit=cout_g), S(0, unit=cout_g)), (S(1, unit=cout_g),)))
    else:
        out += [((R, S(0), S(0)), (S(1),)), ((S(1), S(1), P), (P,))]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward(name):
    args = CASES[name]
    x, w, b = args[:3]
    g = args[-1]
    expect = expected_forward(x.ndim, g > 1, x.shape[1] // g, w.shape[0] // g)
    if b is None:
        expect = [(ins[:2], outs) for ins, outs in expect]
    check(FWD, *args, expect=expect)


@pytest.mark.parametrize("name", ["2d", "2d_grouped_strided", "1d_wide_halo", "3d"])
def test_backward(name):
    args = backward_args(CASES[name])
    x = args[1]
    expect = [((S(0), S(0), R), (S(0), P, P))] + [((S(d), S(d), R), (S(d), P, P)) for d in range(2, x.ndim)]
    if args[-2] == 1:
        expect += [((S(1), R, S(0)), (P, S(0), S(0))), ((R, S(1), S(1)), (S(1), S(1), R))]
    check(BWD, *args, expect=expect)


def test_backward_depthwise_weight_only():
    """output_mask without grad_input (a first layer): no reverse halo, outputs None."""
    args = backward_args(CASES["1d_depthwise"], mask=(False, True, True))
    check(BWD, *args, expect=[((S(2), S(2), R), (None, P, P))])


def test_grouped_plain_channel_shards_where_whole_groups():
    """8 channels in 4 groups: on 2 ranks plain chunks (4 + 4) hold whole groups, so a channel
    shard coming from a column-parallel conv needs no re-cut; on 3 ranks (3 + 3 + 2) they do not
    and the plain variant is refused there (only the unit shard remains)."""
    args = conv_args(rnd(3, 8, 5, 5), rnd(8, 2, 3, 3), rnd(8), 1, 1, 1, 4)
    rep = check(FWD, *args, expect=[((S(1), S(0), S(0)), (S(1),)),
                                    ((S(1, unit=2), S(0, unit=2), S(0, unit=2)), (S(1, unit=2),))])
    on3 = {tuple(p[0] for p in r.strategy.ins) for r in rep.results if r.mesh == (3,)}
    assert (S(1), S(0), S(0)) not in on3 and (S(1, unit=2), S(0, unit=2), S(0, unit=2)) in on3
    check(BWD, *backward_args(args), expect=[((S(1), S(1), S(0)), (S(1), S(0), S(0)))])


def test_transposed():
    """conv_transpose: batch and channel strategies (no spatial shard: its windows run backwards)."""
    args = conv_args(rnd(3, 4, 5, 5), rnd(4, 3, 3, 3), rnd(3), 2, 1, 1, 1, transposed=True, output_padding=[1, 1])
    rep = check(FWD, *args, expect=[((S(0), R, R), (S(0),)), ((R, S(1), S(0)), (S(1),)), ((S(1), S(0), P), (P,))],
                absent=[((S(2), R, R), (S(2),))])
    assert rep.ok
    check(BWD, *backward_args(args), expect=[((S(0), S(0), R), (S(0), P, P))])


def test_halo_plan_uneven_and_wide():
    """13 rows on 3 ranks (5, 5, 3), kernel 5 dilated 2, padding 4: rank 2 needs rows 2..12, i.e.
    rows of both other ranks (two ring shifts), and padding rows outside the tensor."""
    mesh = Mesh((3,))
    x = Layout((2, 3, 13), torch.float32, (S(2),))
    out = Layout((2, 4, 13), torch.float32, (S(2),))
    win = halo.Window(13, 5, 1, 4, 2)
    plans = [halo.HaloPlan.of(x, out, 2, 0, win, mesh, r) for r in range(3)]
    assert [p.own for p in plans] == [(0, 5), (5, 5), (10, 3)]
    assert [p.need for p in plans] == [(-4, 9), (1, 14), (6, 17)]
    assert {t for p in plans for t, *_ in p.shifts} == {1, 2}
    steps = halo.steps(x, out, 2, 0, win, mesh)
    assert [s.kind for s in steps] == ["send_recv", "send_recv"] and all(s.is_collective and s.bytes > 0 for s in steps)
