"""The caching allocator's replay (lower/allocator.py): its block rules one by one, what it holds
against what is live on random sequences, and a plan's training steps through it (the replayed
live bytes are the liveness estimate's, the optimizer's state added).

    python -m pytest tests/search/test_allocator.py -q
"""
from __future__ import annotations

import random

import pytest

import shardwise as sw
from shardwise import Shard as S
from shardwise.lower.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_BUFFER,
    SMALL_SIZE,
    replay,
    round_size,
    segment_size,
    training_events,
)
from tests.models import zoo

MiB = 1 << 20


def _alloc(*sizes):
    return [(i, b) for i, b in enumerate(sizes)]


def _free(*keys):
    return [(k, None) for k in keys]


def test_sizes_round_as_the_allocator_rounds():
    assert [round_size(n) for n in (1, 512, 513, 3 * MiB + 1)] == [MIN_BLOCK, 512, 1024, 3 * MiB + 512]
    # a classic segment: 2 MiB for the small pool, 20 MiB under 10 MiB, else rounded up to 2 MiB
    assert [segment_size(n) for n in (SMALL_SIZE, SMALL_SIZE + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 1)] == [
        SMALL_BUFFER, LARGE_BUFFER, LARGE_BUFFER, 10 * MiB, 12 * MiB]


def test_a_freed_block_is_reused_and_split():
    """A 3 MiB request takes a 20 MiB segment; the 17 MiB left (more than 1 MiB) is split off and
    serves the next request without a second segment; a larger one gets its own segment."""
    r = replay(_alloc(3 * MiB, 17 * MiB))
    assert (r.reserved, r.segments) == (LARGE_BUFFER, 1)
    r = replay(_alloc(3 * MiB, 17 * MiB + 512))
    assert (r.reserved, r.segments) == (LARGE_BUFFER + 18 * MiB, 2)


def test_a_remainder_of_at_most_1_mib_stays_with_its_block():
    """Classic large pool: 19.5 MiB from a 20 MiB segment leaves 0.5 MiB, not split off: the block
    in use is the whole segment (what ``allocated`` counts); expandable segments split it."""
    r = replay(_alloc(19 * MiB + MiB // 2))
    assert r.allocated == LARGE_BUFFER and r.requested == 19 * MiB + MiB // 2
    r = replay(_alloc(19 * MiB + MiB // 2), expandable=True)
    assert r.allocated == 19 * MiB + MiB // 2


def test_best_fit_takes_the_smallest_free_block_that_fits():
    """Free blocks of 30 and 50 MiB: 25 MiB goes into the 30, so 45 still fits the 50 (first fit
    would have split the 50 and asked for a new segment)."""
    ev = _alloc(50 * MiB, 30 * MiB) + _free(0, 1) + [("a", 25 * MiB), ("b", 45 * MiB)]
    r = replay(ev)
    assert (r.reserved, r.segments) == (80 * MiB, 2)


def test_freed_neighbours_merge_inside_a_segment_only():
    # expandable: one segment, so two freed neighbours serve their sum
    ev = _alloc(40 * MiB, 40 * MiB) + _free(0, 1) + [("x", 80 * MiB)]
    assert replay(ev, expandable=True).reserved == 80 * MiB
    # classic: two segments never merge, so the sum needs a third
    assert replay(ev).reserved == 160 * MiB


def test_expandable_segments_grow_at_their_free_end():
    """Freeing the last block and asking for more maps only the difference, in 20 MiB pages."""
    ev = _alloc(100 * MiB, 50 * MiB) + _free(1, 0) + [("c", 150 * MiB)]
    assert replay(ev, expandable=True).reserved == 160 * MiB  # 100, then 3 pages for the 50
    assert replay(ev).reserved == 300 * MiB  # classic: 100 + 50 + a new 150


def test_small_and_large_requests_keep_their_own_pools():
    ev = _alloc(30 * MiB) + _free(0) + [("s", 4096)]
    r = replay(ev)
    assert r.reserved == 30 * MiB + SMALL_BUFFER and r.segments == 2


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_hold_at_least_what_is_live(seed, expandable):
    """reserved >= allocated >= requested at their peaks, small and large requests mixed, freed out of order."""
    rng = random.Random(seed)
    live, ev = [], []
    for i in range(400):
        if live and rng.random() < 0.45:
            ev.append((live.pop(rng.randrange(len(live))), None))
        else:
            live.append(i)
            ev.append((i, rng.choice([rng.randrange(1, 4096), rng.randrange(MiB, 64 * MiB)])))
    r = replay(ev, expandable)
    assert r.reserved >= r.allocated >= r.requested > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_stack_of_large_requests_reserves_its_peak_in_whole_pages(seed):
    """Freed last-in first-out, expandable segments never fragment: the one free block is the end,
    so what is mapped is the largest stack (rounded to 512 bytes each) in whole 20 MiB pages."""
    rng = random.Random(seed)
    stack, ev, depth, top = [], [], 0, 0
    for i in range(300):
        if stack and rng.random() < 0.5:
            k, b = stack.pop()
            ev.append((k, None))
            depth -= b
        else:
            b = rng.randrange(SMALL_SIZE + 1, 40 * MiB)
            stack.append((i, round_size(b)))
            ev.append((i, b))
            depth += round_size(b)
            top = max(top, depth)
    assert replay(ev, expandable=True).reserved == -(-top // LARGE_BUFFER) * LARGE_BUFFER


def test_a_freed_key_cannot_be_allocated_twice():
    with pytest.raises(ValueError, match="twice"):
        replay([("a", 10), ("a", 10)])


def test_training_steps_replay_the_liveness_estimate():
    """A tiny GPT-2, data parallel on 2 ranks: the replayed steps' requested peak is the liveness
    estimate's peak with AdamW's two moments per parameter held from the first step on (its peak is
    in backward, above the optimizer's own temporaries); both allocators hold at least that."""
    c = zoo.gpt2(batch=4, seq=16)
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, example_targets=c.example_targets,
                        loss_fn=c.loss_fn, input_placements={"input_ids": [S(0)], "labels": [S(0)]})
    est = pm.plan.memory_estimate(0)
    params = [b for _, b in est.param_storages]
    assert sum(params) == est.parameters > 0
    events = training_events([b for _, b in est.resident_storages], params, est.intervals, est.temps,
                             len(est.curve))
    for expandable in (False, True):
        r = replay(events, expandable)
        assert r.requested == est.peak + 2 * sum(params)
        assert r.reserved >= r.allocated >= r.requested
        assert pm.plan.reserved_memory()["expandable" if expandable else "segments"] == r  # the busiest rank's
    assert pm.plan.memory()["rank"] == 0
    for state in (0.0, 1.0, 1.5):  # no state (plain SGD), one moment (momentum), a fractional multiple
        args = ([b for _, b in est.resident_storages], params, est.intervals, est.temps, len(est.curve))
        r = replay(training_events(*args, state=state))
        assert r.requested == pytest.approx(est.peak + state * sum(params), abs=len(params))
