"""as_strided and as_strided_scatter (rules/strided.py) in the forms models produce, and unfold /
unfold_backward: a dim of the view is sharded only where it walks one input dim (in blocks of a unit)
and nothing else moves along it; everything else Replicate. Meshes (2,), (3,), (2, 2), uneven sizes.

    python -m pytest tests/rules/test_strided.py -q -p no:cacheprovider
"""
import torch

from shardwise.core.layout import Partial, Replicate, Shard as S
from shardwise.rules.strided import Coords, as_strided_rows, as_strided_scatter_rows
from tests.rules._rulecheck import check

aten = torch.ops.aten
R, P, PMAX = Replicate(), Partial(), Partial("max")


def test_swin_pooler_view():
    """The adaptive average pool's as_strided over the batch mean [5, 16, 1]: batch and channels shard."""
    check(aten.as_strided.default, torch.randn(5, 16, 1), [5, 16, 1, 1], [16, 1, 16, 16],
          expect=[((S(0),), (S(0),)), ((S(1),), (S(1),)), ((P,), (P,)), ((PMAX,), (PMAX,))])


def test_flat_buffer_views_shard_in_units():
    """The pooler's backward: zeros [80] viewed as [5, 16] (and scattered back): the batch rows are whole
    blocks of 16 of the flat dim."""
    check(aten.as_strided.default, torch.randn(80), [5, 16], [16, 1], 0, expect=[((S(0, 16),), (S(0),))],
          absent=[((S(0),), (S(0),))])
    check(aten.as_strided_scatter.default, torch.randn(80), torch.randn(5, 16), [5, 16], [16, 1], 0,
          expect=[((S(0, 16), S(0)), (S(0, 16),)), ((P, P), (P,))])
    # 2 rows on 3 ranks: the last rank's piece is empty
    check(aten.as_strided_scatter.default, torch.randn(32), torch.randn(2, 16), [2, 16], [16, 1], 0,
          expect=[((S(0, 16), S(0)), (S(0, 16),))])


def test_offset_and_strided_rows():
    """[5, 6, 7] read at rows 1, 3, 5 of dim 1 (offset 7, stride 2 rows): dim 1 in units of 2."""
    check(aten.as_strided.default, torch.randn(5, 6, 7), [5, 3, 7], [42, 14, 1], 7,
          expect=[((S(0),), (S(0),)), ((S(1, 2),), (S(1),)), ((S(2),), (S(2),))])


def test_views_that_mix_dims_are_replicated():
    # overlapping windows of a flat tensor (stride 1 < window): no dim walks alone
    r = check(aten.as_strided.default, torch.randn(9), [5, 5], [1, 1], 0, expect=[((R,), (R,))])
    assert not any(isinstance(p, S) for res in r.results for pl in res.strategy.ins for p in pl)
    # a transpose by strides of [5, 7]: output dim 0 walks input dim 1 and vice versa, each whole
    check(aten.as_strided.default, torch.randn(5, 7), [7, 5], [1, 7], 0,
          expect=[((S(1),), (S(0),)), ((S(0),), (S(1),))])
    # an offset that moves along dim 0 (starts at row 1): dim 0 does not line up, dim 1 does
    check(aten.as_strided.default, torch.randn(5, 7), [4, 7], [7, 1], 7, expect=[((S(1),), (S(1),))],
          absent=[((S(0),), (S(0),))])
    # a view wider than one row (7 + 1 elements from each row start) carries into the next row
    check(aten.as_strided.default, torch.randn(5, 7), [4, 8], [7, 1], 0, absent=[((S(0),), (S(0),))])


def test_coords_refuse_carries():
    assert Coords.of((5, 7), {}, [4, 8], [7, 1], 0) is None
    assert Coords.of((5, 7), {}, [5, 7], [7, 1], 0).steps == ((1, 0), (0, 1))
    assert Coords.of((80,), {0: 16}, [5, 16], [16, 1], 0).steps == ((1, 0), (0, 1))


def test_rows_reads_the_row_major_layout():
    """A piece that arrives as a strided view reads the same elements as its contiguous copy."""
    x = torch.randn(7, 10)[:, 2:7]
    torch.testing.assert_close(as_strided_rows(x, [5, 3], [1, 5]), x.contiguous().as_strided([5, 3], [1, 5]))


def test_rows_of_a_piece_inside_a_larger_buffer():
    """A contiguous piece at a storage offset (a local slice of a gathered buffer; the verifier's strided run
    skips contiguous pieces): both ops read storage_offset in the piece's storage, so it starts there.
    Without it as_strided_scatter wrote src before the piece (rank 1 of the pooler's backward: zeros)."""
    piece, src = torch.randn(80)[48:], torch.randn(2, 16)
    fresh = piece.clone()  # the same values in a storage of its own
    torch.testing.assert_close(as_strided_rows(piece, [2, 16], [16, 1], 0), fresh.as_strided([2, 16], [16, 1], 0))
    want = aten.as_strided_scatter.default(fresh, src, [2, 16], [16, 1], 0)
    torch.testing.assert_close(as_strided_scatter_rows(piece, src, [2, 16], [16, 1], 0), want)
    torch.testing.assert_close(want, src.flatten())


def test_unfold_and_its_backward():
    check(aten.unfold.default, torch.randn(5, 7, 3), 1, 3, 2, expect=[((S(0),), (S(0),)), ((S(2),), (S(2),))],
          absent=[((S(1),), (S(1),))])
    check(aten.unfold_backward.default, torch.randn(5, 3, 3, 3), [5, 7, 3], 1, 3, 2,
          expect=[((S(0),), (S(0),)), ((S(2),), (S(2),)), ((P,), (P,))],
          absent=[((S(1),), (S(1),)), ((PMAX,), (PMAX,))])
