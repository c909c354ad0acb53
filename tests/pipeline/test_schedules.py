"""Schedules as data (search/schedules.py): every action once, no deadlock, the in-flight bounds
and the bubbles the schedules are known for, played at unit times."""
from __future__ import annotations

import pytest

from shardwise.core.errors import ConfigError
from shardwise.search.schedules import SCHEDULES, Action, schedule, simulate

GRID = [(p, m) for p in (2, 3, 4) for m in (1, 2, 4, 5, 8)]


def _v(name):
    return 2 if name == "interleaved" else 1


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", GRID)
def test_every_action_once_and_no_deadlock(name, p, m):
    if name == "interleaved" and m % p:
        pytest.skip("interleaved needs microbatches in rounds of the ranks")
    s = schedule(name, p, m, _v(name))
    kinds = ("F", "B", "W") if s.split_w else ("F", "B")
    want = {Action(k, st, i) for k in kinds for st in range(s.n_stages) for i in range(m)}
    got = [a for acts in s.ranks for a in acts]
    assert sorted(got) == sorted(want)
    for r, acts in enumerate(s.ranks):
        assert all(s.rank_of(a.stage) == r for a in acts)
    simulate(s, lambda a: 1.0)  # raises on a deadlock


def in_flight(s, stage):
    live = most = 0
    for a in s.ranks[s.rank_of(stage)]:
        if a.stage == stage:
            live += 1 if a.kind == "F" else -(a.kind == ("W" if s.split_w else "B"))
            most = max(most, live)
    return most


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3)])
def test_1f1b_holds_at_most_p_minus_r_microbatches_gpipe_all(p, m):
    one, gp = schedule("1f1b", p, m), schedule("gpipe", p, m)
    for r in range(p):
        assert in_flight(one, r) == min(p - r, m)
        assert in_flight(gp, r) == m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_bubbles_at_unit_times(p, m):
    """1F1B: (p - 1) / (m + p - 1) on every rank (backward twice the forward); ZB-H1 with
    F = B = W: (p - 1) / (3m + p - 1); interleaved over 2 stages per rank: less than 1F1B."""
    one = simulate(schedule("1f1b", p, m), lambda a: 1.0 if a.kind == "F" else 2.0)
    assert one.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert all(one.idle_fraction(r) == pytest.approx((p - 1) / (m + p - 1)) for r in range(p))
    gp = simulate(schedule("gpipe", p, m), lambda a: 1.0 if a.kind == "F" else 2.0)
    assert gp.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    zb = simulate(schedule("zero-bubble", p, m), lambda a: 1.0)
    assert zb.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1))
    inter = simulate(schedule("interleaved", p, m, 2), lambda a: 0.5 if a.kind == "F" else 1.0)
    assert inter.bubble_fraction() < one.bubble_fraction()


def test_schedule_errors_say_how_to_fix():
    for args, words in [(("pipedream", 2, 4), "unknown pipeline schedule"), (("1f1b", 2, 4, 2), "interleaved"),
                        (("interleaved", 4, 6, 2), "multiple of 4"), (("gpipe", 2, 0), "positive int")]:
        with pytest.raises(ConfigError, match=words) as e:
            schedule(*args)
        assert e.value.fix


def test_tables_print_the_actions():
    s = schedule("1f1b", 2, 3)
    text = s.table()
    assert "F0.0" in text and "B1.2" in text and text.splitlines()[2].split()[:4] == ["0", "F0.0", "F0.1", "B0.0"]
    tl = simulate(s, lambda a: 1.0)
    assert "rank 1: |" in tl.table() and "idle" in tl.table()
