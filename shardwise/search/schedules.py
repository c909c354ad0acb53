"""Pipeline schedules as data: per pipeline rank, the ordered list of actions it runs.

    sched = schedule("1f1b", ranks=4, microbatches=8)       # or "gpipe", "interleaved", "zero-bubble"
    sched.ranks[0]                     # (F0.0, F0.1, F0.2, F0.3, B0.0, F0.4, B0.1, ...)
    print(sched.table())               # ranks x steps
    tl = simulate(sched, durations)    # modelled start/end of every action, idle per rank

An ``Action`` is F (forward), B (backward; with ``split_w`` only the input gradient) or W (the
weight gradient, zero-bubble schedules only) of stage ``s`` on microbatch ``i``. Stage ``s`` runs
on pipeline rank ``s % p`` (with ``v`` stages per rank, rank ``r`` holds stages ``r, r + p, ...``,
Megatron's interleaved placement). What crosses stages (activations forward, their gradients
backward) is implied: F(s, i) needs F(s - 1, i); B(s, i) needs F(s, i) and B(s + 1, i); W(s, i)
needs B(s, i). The runner (run/pipeline.py) runs each rank's list in order, receiving what an
action needs before it and sending what it made after it; ``simulate`` plays the same lists
against modelled durations (the bubble the plan reports) and proves them free of deadlock.

Generators (p ranks, m microbatches, v stages per rank):
- ``gpipe``: every forward, then every backward (holds all m microbatches' activations).
- ``1f1b``: p - r - 1 warm-up forwards, then one forward one backward, then the remaining
  backwards (PipeDream-flush): rank r holds at most p - r microbatches.
- ``interleaved``: Megatron's interleaved 1F1B over v stages per rank (m a multiple of p):
  forwards in rounds of p microbatches per stage, warm-up (p - r - 1) * 2 + (v - 1) * p.
- ``zero-bubble``: ZB-H1: backward split into B (input gradient, on the critical path) and
  W (weight gradient, off it); B first, then a forward within 1F1B's in-flight bound, and W
  where a rank would otherwise wait (at most p - 1 pending), the rest filling the cool-down.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
F, B, W = "F", "B", "W"


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F", "B" or "W"
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """``ranks[r]``: the actions pipeline rank ``r`` runs, in order. ``p`` ranks, ``v`` stages per
    rank (``p * v`` stages), ``m`` microbatches; ``split_w``: backward runs as B then W."""

    name: str
    p: int
    v: int
    m: int
    split_w: bool
    ranks: tuple

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> tuple:
        return tuple(range(rank, self.n_stages, self.p))

    def in_flight(self, stage: int) -> int:
        """The most microbatches ``stage`` holds between their forward and their last backward
        action (B, or W when the backward is split), in its rank's action order."""
        last = W if self.split_w else B
        live = most = 0
        for a in self.ranks[self.rank_of(stage)]:
            if a.stage == stage:
                live += 1 if a.kind == F else (-1 if a.kind == last else 0)
                most = max(most, live)
        return most

    def table(self, width: int = 7) -> str:
        """Ranks x action order as text (no times: ``Timeline.table`` has them)."""
        steps = max(len(a) for a in self.ranks)
        head = "rank " + "".join(f"{'#' + str(k):<{width}}" for k in range(steps))  # #k: the rank's k-th action
        rows = [f"{r:<5}" + "".join(f"{a!r:<{width}}" for a in acts) for r, acts in enumerate(self.ranks)]
        return "\n".join([f"# schedule {self.name}: {self.p} ranks x {self.v} stage(s) each, {self.m} microbatches",
                          head] + rows)


def check(name: str, p: int, m: int, v: int = 1) -> None:
    """A ConfigError (with a fix) for a schedule these numbers cannot make."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}", fix=f"use one of {SCHEDULES}")
    for what, n in (("microbatches", m), ("stages_per_rank", v), ("pipeline ranks", p)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{what} must be a positive int, got {n!r}", fix=f"e.g. {what}=4")
    if v > 1 and name != "interleaved":
        raise ConfigError(f"stages_per_rank={v} needs schedule='interleaved' (schedule {name!r} runs one stage per "
                          "rank)", fix="pass schedule='interleaved', or stages_per_rank=1")
    if name == "interleaved" and v > 1 and m % p:
        raise ConfigError(f"the interleaved schedule runs microbatches in rounds of the {p} pipeline ranks, but "
                          f"microbatches={m} is not a multiple of {p}",
                          fix=f"use microbatches={(m // p + 1) * p} (or {max(p, m // p * p)})")


def schedule(name: str, ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The ``name`` schedule for ``ranks`` pipeline ranks and ``microbatches`` microbatches."""
    p, m, v = ranks, microbatches, stages_per_rank
    check(name, p, m, v)
    if name == "gpipe":
        acts = [[Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(p)]
    elif name == "1f1b" or (name == "interleaved" and v == 1):
        acts = [_one_f_one_b(r, p, m) for r in range(p)]
    elif name == "interleaved":
        acts = [_interleaved(r, p, m, v) for r in range(p)]
    else:
        acts = _zero_bubble(p, m)
    sched = Schedule(name, p, v, m, name == "zero-bubble", tuple(tuple(a) for a in acts))
    simulate(sched, lambda a: 1.0)  # raises if the lists could deadlock (a bug here, never the user's)
    return sched


def _one_f_one_b(r: int, p: int, m: int) -> list:
    warm = min(p - 1 - r, m)
    acts = [Action(F, r, i) for i in range(warm)]
    for k in range(m - warm):
        acts += [Action(F, r, warm + k), Action(B, r, k)]
    return acts + [Action(B, r, k) for k in range(m - warm, m)]


def _interleaved(r: int, p: int, m: int, v: int) -> list:
    """Megatron's interleaved 1F1B on rank ``r`` (its ``get_model_chunk_id`` and microbatch order)."""
    total = m * v

    def act(kind: str, k: int) -> Action:
        chunk = (k // p) % v
        chunk = chunk if kind == F else v - 1 - chunk
        return Action(kind, chunk * p + r, (k // (p * v)) * p + k % p)

    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    acts = [act(F, k) for k in range(warm)]
    for k in range(total - warm):
        acts += [act(F, warm + k), act(B, k)]
    return acts + [act(B, k) for k in range(total - warm, total)]


def _zero_bubble(p: int, m: int) -> list:
    """ZB-H1 lists from a unit-time play (F = B = W = 1): each tick a rank runs, in this order
    of preference, a ready B (lowest microbatch), a W when more than p - 1 are pending, a
    forward within the 1F1B bound (at most p - r microbatches forwarded and not yet
    backwarded), a pending W; else it waits. W's left pending fill the cool-down, where B's
    arrive one stage at a time: the play's bubble is ZB-H1's (p - 1) / (3m + p - 1) at equal
    times (1F1B's: 3 (p - 1) / (3m + 3 (p - 1))). The lists, not real times, are the data."""
    acts = [[] for _ in range(p)]
    done: dict = {}  # Action -> tick it finished
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    tick = 0
    while any(nw[r] < m for r in range(p)):
        chosen = []
        def ready(a, tick=tick) -> bool:  # finished by an earlier tick
            return a in done and done[a] < tick

        for r in range(p):
            b_ok = nb[r] < nf[r] and ready(Action(F, r, nb[r])) and (r == p - 1 or ready(Action(B, r + 1, nb[r])))
            f_ok = nf[r] < m and nf[r] - nb[r] < p - r and (r == 0 or ready(Action(F, r - 1, nf[r])))
            w_ok = nw[r] < nb[r]
            if b_ok:
                a = Action(B, r, nb[r])
            elif w_ok and nb[r] - nw[r] > p - 1:
                a = Action(W, r, nw[r])
            elif f_ok:
                a = Action(F, r, nf[r])
            elif w_ok:
                a = Action(W, r, nw[r])
            else:
                continue
            chosen.append((r, a))
        for r, a in chosen:
            acts[r].append(a)
            done[a] = tick
            counter = {F: nf, B: nb, W: nw}[a.kind]
            counter[r] += 1
        tick += 1
        if tick > 10 * (3 * m + p) + 10:
            raise AssertionError("zero-bubble generation did not finish")  # a bug here
    return acts


# -- modelled time ------------------------------------------------------------------------------
@dataclass
class Timeline:
    """Start and end of every action (modelled by ``simulate``, or measured by the runner:
    ``pm.pipeline_timeline()``); ``end``: the makespan, or the measured step's span (``span``:
    from the step's start to its end, the epilogue included); ``busy(r)``: seconds rank r
    computed; ``held_bytes``: measured, {pipeline rank: the most bytes it kept between actions
    (stashed activations, received values)}."""

    start: dict = field(default_factory=dict)  # Action -> seconds
    finish: dict = field(default_factory=dict)
    rank_of: dict = field(default_factory=dict)  # Action -> pipeline rank
    span: float | None = None
    held_bytes: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.span if self.span is not None else max(self.finish.values(), default=0.0)

    def ranks(self) -> list:
        return sorted(set(self.rank_of.values()))

    def busy(self, rank: int) -> float:
        return sum(self.finish[a] - self.start[a] for a, r in self.rank_of.items() if r == rank)

    def idle_fraction(self, rank: int) -> float:
        """The share of the step rank ``rank`` waited (no action running), from the step's start."""
        return 1.0 - self.busy(rank) / self.end if self.end > 0 else 0.0

    def bubble_fraction(self) -> float:
        """Idle over the whole pipeline: 1 - (sum of busy time) / (ranks x makespan)."""
        ranks = sorted(set(self.rank_of.values()))
        if not ranks or self.end <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in ranks) / (len(ranks) * self.end)

    def table(self, columns: int = 60) -> str:
        """Ranks x time as text: each action's letter and stage over the columns it runs."""
        end = self.end or 1.0
        ranks = sorted(set(self.rank_of.values()))
        rows = []
        for r in ranks:
            line = [" "] * columns
            for a, rr in self.rank_of.items():
                if rr != r:
                    continue
                lo = int(self.start[a] / end * columns)
                hi = max(lo + 1, int(self.finish[a] / end * columns))
                for c in range(lo, min(hi, columns)):
                    line[c] = a.kind if c == lo else a.kind.lower()
            rows.append(f"rank {r}: |{''.join(line)}| idle {self.idle_fraction(r):.0%}")
        return "\n".join(rows)


def deps(a: Action, n_stages: int, split_w: bool) -> list:
    """The actions ``a`` waits for (module docstring)."""
    if a.kind == F:
        return [Action(F, a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == B:
        out = [Action(F, a.stage, a.mb)]
        return out + ([Action(B, a.stage + 1, a.mb)] if a.stage < n_stages - 1 else [])
    return [Action(B, a.stage, a.mb)]


def simulate(sched: Schedule, duration, comm=0.0) -> Timeline:
    """Play ``sched`` with ``duration(action) -> seconds`` and ``comm`` seconds (a number, or a
    function of (action, the action it waits for on another rank)) per message between ranks:
    each rank runs its list in order, an action starting once the rank is free and what it
    waits for has arrived. Raises AssertionError if the lists would deadlock."""
    comm_of = comm if callable(comm) else (lambda a, d: comm)
    tl = Timeline()
    pos, free = [0] * sched.p, [0.0] * sched.p
    left = sum(map(len, sched.ranks))
    while left:
        progressed = False
        for r in range(sched.p):
            while pos[r] < len(sched.ranks[r]):
                a = sched.ranks[r][pos[r]]
                ds = deps(a, sched.n_stages, sched.split_w)
                if any(d not in tl.finish for d in ds):
                    break
                ready = max([free[r]] + [tl.finish[d] + (comm_of(a, d) if sched.rank_of(d.stage) != r else 0.0)
                                         for d in ds])
                tl.start[a], tl.rank_of[a] = ready, r
                tl.finish[a] = free[r] = ready + float(duration(a))
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: sched.ranks[r][pos[r]] for r in range(sched.p) if pos[r] < len(sched.ranks[r])}
            raise AssertionError(f"schedule {sched.name} deadlocks: ranks wait at {stuck}")
    return tl
