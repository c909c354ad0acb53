"""Rank classes: ranks whose programs see the same shapes, so one stands for all of them.

    classes = plan_classes(prop)      # RankClasses: .reps (one rank per class), .of(rank), .members(rep)

A rank's program differs from another's only in what its coordinates select: the local shape of
every value (core/layout.py's one shape function), the chunk sizes of the groups its collectives
run in (padding, gathered sizes) and offsets (slice bounds, random streams). Shapes decide what
is computed and held, so ranks that agree on every local shape of the plan and on the local
shapes of their group's members for every collective step have equal flops, bytes moved and
memory (the same fake run, lower/memory.py). On an even mesh every layout is ``uniform`` (the
same local shape on every rank), so all ranks are one class and the figures cost one rank's
work, however many ranks there are; uneven shards make a few classes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .paths import edges


@dataclass(frozen=True)
class RankClasses:
    """``reps``: the lowest rank of each class, ascending; ``rep_of``: per rank, its class's rep."""

    reps: tuple
    rep_of: tuple

    def of(self, rank: int) -> int:
        return self.rep_of[rank]

    def members(self, rep: int) -> tuple:
        return tuple(r for r, c in enumerate(self.rep_of) if c == rep)

    def __len__(self) -> int:
        return len(self.reps)


def rank_classes(layouts, mesh, steps=()) -> RankClasses:
    """Classes of the ranks of ``mesh`` by the local shapes of ``layouts``; for each collective
    step of ``steps`` (``.kind``, ``.src``, ``.dst``, ``.mesh_dim``), by the local shapes of its
    group's members (padding, gathered sizes). A Replicate -> Partial("sum") step tells no rank
    apart: the member that keeps the value keeps a copy of it, as the others hold zeros
    (lower/comm.py's partial_local). Layouts that are ``uniform`` tell no rank apart and are
    skipped."""
    uneven = [lay for lay in dict.fromkeys(layouts) if lay is not None and not lay.uniform(mesh)]
    grouped = [(lay, s.mesh_dim) for s in steps if s.is_collective for lay in (s.src, s.dst) if not lay.uniform(mesh)]
    grouped = list(dict.fromkeys(grouped))
    if not uneven and not grouped:
        return RankClasses((0,), (0,) * mesh.size)
    shapes = {lay: lay.local_shapes(mesh) for lay in uneven + [lay for lay, _ in grouped]}
    seen: dict = {}
    rep_of = []
    for r in range(mesh.size):
        key = tuple(shapes[lay][r] for lay in uneven)
        key += tuple(tuple(shapes[lay][g] for g in mesh.group(m, r)) for lay, m in grouped)
        rep_of.append(seen.setdefault(key, r))
    return RankClasses(tuple(sorted(set(rep_of))), tuple(rep_of))


def plan_classes(prop) -> RankClasses:
    """The rank classes of a planned Propagation (search/propagate.py): every value's layout, every
    redistribution step's source and destination (the graph outputs' moves and the collectives an
    op's local call runs itself included). Kept on ``prop``."""
    got = prop.rank_classes
    if got is None:
        layouts = [lay for lays in prop.layouts.values() for lay in lays]
        steps = [s for np_ in prop.nodes.values() for ss in np_.in_steps for s in ss]
        steps += [s for ss in prop.output_steps for s in ss]
        steps += [s for _, _, ss in edges(prop) for s in ss]  # with the collectives ops run themselves
        layouts += [lay for s in steps for lay in (s.src, s.dst)]
        got = rank_classes(layouts, prop.mesh, steps)
        prop.rank_classes = got
    return got
