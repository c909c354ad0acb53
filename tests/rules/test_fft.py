"""FFT rules (rules/fft.py) checked by the rule verifier on meshes (2,), (3,), (2, 2), uneven sizes
(5, 3, 7), every normalisation mode: the dims an FFT does not transform shard, the transformed
ones never do, and Partial(sum) passes (an FFT is linear over the reals).

    python -m pytest tests/rules/test_fft.py -q -p no:cacheprovider
"""
import pytest
import torch

from shardwise.core.layout import Partial, Replicate, Shard

from ._rulecheck import check

aten = torch.ops.aten
R, P, S = Replicate(), Partial("sum"), Shard
NORMS = (0, 1, 2)  # none, by 1/n, by 1/sqrt(n)


def _r(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(sum(shape)))


def _untransformed(ndim, dims):
    kept = [d for d in range(ndim) if d not in dims]
    return [((S(d),), (S(d),)) for d in kept] + [((P,), (P,))], [((S(d),), (S(d),)) for d in dims]


@pytest.mark.parametrize("norm", NORMS)
def test_r2c_one_sided_on_the_last_dim(norm):
    expect, absent = _untransformed(3, [2])
    check(aten._fft_r2c.default, _r(5, 3, 7), [2], norm, True, expect=expect, absent=absent)


@pytest.mark.parametrize("norm", NORMS)
def test_r2c_two_sided_over_two_dims(norm):
    expect, absent = _untransformed(3, [0, 2])
    check(aten._fft_r2c.default, _r(3, 5, 4), [0, 2], norm, False, expect=expect, absent=absent)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("last", [7, 6])
def test_c2r_keeps_the_last_dim_size_as_given(norm, last):
    """An odd last size (7 from 4 bins) and an even one (6): the size arg is global and stays so."""
    expect, absent = _untransformed(3, [2])
    check(aten._fft_c2r.default, _r(5, 3, 4, dtype=torch.complex64), [2], norm, last, expect=expect, absent=absent)


def test_c2r_over_a_middle_and_the_last_dim():
    expect, absent = _untransformed(3, [1, 2])
    check(aten._fft_c2r.default, _r(5, 3, 4, dtype=torch.complex64), [1, 2], 1, 7, expect=expect, absent=absent)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("forward", [True, False])
def test_c2c_either_direction(norm, forward):
    expect, absent = _untransformed(3, [1])
    check(aten._fft_c2c.default, _r(5, 3, 7, dtype=torch.complex64), [1], norm, forward, expect=expect, absent=absent)


def test_c2c_with_a_negative_dim_in_float64():
    expect, absent = _untransformed(4, [3])
    check(aten._fft_c2c.default, _r(3, 2, 5, 4, dtype=torch.complex128), [-1], 2, True, expect=expect, absent=absent)
