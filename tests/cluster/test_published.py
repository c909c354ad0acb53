"""The calculator against published training runs (shardwise/tools/cluster/published.py: the rows of
docs/calculator.md's "Published runs" table, each with its source).

Every held-out run of a group with a bound (published.BOUNDS: 1-D FSDP within 20%, TP x PP within
25%, DP x TP x PP within 30%, 2-D FSDP x TP within 35%) is estimated by the calculator (planned on
meta weights, stamped to depth) and its tokens/s per GPU compared with the published figure; the
1-D FSDP held-out runs' mean |error| must be within 12%. Runs the docs say the model misses
(MISSED: the reason, a structural one) are strict xfails: they fail the suite the day they pass, so
the docs are updated. Quick (CI): a few cheap held-out rows (about 30 s each on 2 shared cores);
the whole table is ``slow``.

    python -m pytest tests/cluster/test_published.py -q [-m slow]
"""
from __future__ import annotations

import functools
import statistics

import pytest

from shardwise.tools.cluster import published
from shardwise.tools.cluster.published import BOUNDS, BY_KEY, FSDP_MEAN_BOUND, RUNS

# held-out runs the model misses beyond their bound, and why (docs/calculator.md says the same)
MISSED: dict[str, str] = {
    "titan-70b-256-2d": "fsdp+tp does not keep Megatron's split of the compute (docs/calculator.md, Known, not fixed)",
    "sp-530b": "the last stage's head and float32 loss over the whole vocabulary run on every tp rank (dp+tp leaves "
               "the embedding and head unplaced on tp; Megatron-LM splits them on the vocabulary): that stage is "
               "1.6x the others a microbatch and paces the pipeline",
}
QUICK = ("mpt-13b-8-a100", "sp-175b")  # cheap held-out rows run in CI (one 1-D FSDP, one TP x PP)
BOUNDED = [r for r in RUNS if r.bound is not None]


@functools.cache
def _row(key: str) -> dict:
    return published.measure(BY_KEY[key])


def _check(key: str) -> None:
    run, row = BY_KEY[key], _row(key)
    # the computed figure, never a stored one: modelled tokens/s over the published, within the group's bound
    assert row["modelled"] == pytest.approx(run.tokens_per_s_per_gpu, rel=run.bound), (key, row)


def _params(keys):
    return [pytest.param(k, marks=pytest.mark.xfail(reason=MISSED[k], strict=True)) if k in MISSED else k
            for k in keys]


def test_rows_are_well_formed():
    """Every run names a source, a layout the calculator has and a group with a bound or none;
    at least 15 runs from at least 4 sources, 1-D, 2-D and 3-D layouts, A100 and H100, eager and compiled."""
    from shardwise.tools.cluster.calc import LAYOUTS
    from shardwise.core.cost import GPUS

    assert len(RUNS) >= 15 and len(BY_KEY) == len(RUNS)
    sources = {r.source.split(",")[0] for r in RUNS}
    assert len(sources) >= 4, sources
    for r in RUNS:
        assert r.layout in LAYOUTS and r.gpu in GPUS and r.group in (None, *BOUNDS) and r.role in ("set", "held-out")
        assert r.tokens_per_s_per_gpu > 0 and r.published
        assert r.gpus == r.pp * r.mesh[0] * (r.mesh[1] if len(r.mesh) > 1 else 1), r.key
    assert {r.pp > 1 for r in RUNS} == {True, False} and any(len(r.mesh) == 2 for r in RUNS)
    assert {r.gpu.split("-")[0] for r in RUNS} >= {"a100", "h100"} and {r.compiled for r in RUNS} == {True, False}
    assert all(k in BY_KEY and BY_KEY[k].bound is not None for k in (*QUICK, *MISSED))


@pytest.mark.parametrize("key", _params(QUICK))
def test_quick_held_out_rows(key):
    _check(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _params([r.key for r in BOUNDED if r.key not in QUICK]))
def test_held_out_rows(key):
    _check(key)


@pytest.mark.slow
def test_fsdp_mean_error():
    """The 1-D FSDP held-out runs' mean |error| in tokens/s per GPU."""
    errors = [abs(_row(r.key)["error"]) for r in BOUNDED if r.group == "1-D FSDP"]
    assert len(errors) >= 5
    assert statistics.mean(errors) <= FSDP_MEAN_BOUND, errors
