"""PipelinePlan: a step planned for one microbatch on the virtual mesh, cut into pipeline stages
and scheduled; what run/pipeline.py runs and what ``pm.plan`` reports under ``pipeline=``.

    pplan.stats()["bubble_fraction"]    # the schedule's modelled idle share (search/schedules.simulate)
    print(pplan.summary())              # stages, schedule, modelled timeline, then the microbatch plan
    print(pplan.program(rank))          # that rank's stage pieces (microbatch 0) as Python
    pplan.cut(vrank)                    # lower/stages.MicrobatchCut of one virtual rank's program

The virtual mesh is the mesh with the pipeline dim replaced by a microbatch dim of
``microbatches`` members (module/pipeline.py): virtual rank (i, dp, tp) is microbatch i on
the ranks (any stage, dp, tp). Every figure is per step: a stage runs its forward and backward
once per microbatch, its epilogue (the outputs' reductions over the other mesh dims) once.
"""
from __future__ import annotations

from collections import Counter
from functools import cached_property

import torch

from ..core.units import fmt_bytes, fmt_seconds
from ..search.flops import node_time
from ..search.schedules import Action, simulate
from ..trace.precision import MASTER_DTYPE
from ..trace.recompute import RECOMPUTE
from ..trace.roles import BUFFER, GRAD, PARAM
from .program import ORIGIN, ProgramBuilder
from .stages import ORDER, MicrobatchCut


class PipelinePlan:
    """``plan``: the microbatch plan (lower/plan.Plan on ``vmesh``); ``mesh``: the real mesh, its
    dim ``dim`` the pipeline's; ``schedule``: search/schedules.Schedule; ``stages``:
    search/stages.Stages; ``cost``: the cost model figures are priced with."""

    stage = "step"

    def __init__(self, plan, mesh, vmesh, dim: int, config, schedule, stages, cost, notes=()):
        self.plan, self.mesh, self.vmesh, self.dim = plan, mesh, vmesh, dim
        self.config, self.schedule, self.stages, self.cost = config, schedule, stages, cost
        self.notes = tuple(notes)
        self.traced, self.prop, self.debug = plan.traced, plan.prop, plan.debug
        self.param_choices = plan.param_choices
        self._cuts: dict = {}  # virtual rank -> MicrobatchCut
        self._same: dict = {}  # a program's structure -> the cut made for it (microbatches cut alike share it)
        self.roles = {n.name: r for n, r in zip(plan.traced.placeholder_nodes(), plan.traced.placeholders)}

    # -- ranks -----------------------------------------------------------------------------
    def vrank(self, rank: int, mb: int) -> int:
        """The virtual rank of microbatch ``mb`` on ``rank``'s coordinates of the other mesh dims."""
        coord = list(self.mesh.coord(rank))
        coord[self.dim] = mb
        return self.vmesh.rank(coord)

    def pp_rank(self, rank: int) -> int:
        return self.mesh.coord(rank)[self.dim]

    def stages_of(self, rank: int) -> tuple:
        return self.schedule.stages_of(self.pp_rank(rank))

    def owned(self, rank: int) -> set:
        """Parameter and buffer names ``rank`` holds: those of its stages."""
        mine = set(self.stages_of(rank))
        return {n for n, s in self.stages.owner.items() if s in mine}

    def cut(self, vrank: int) -> MicrobatchCut:
        """Virtual rank ``vrank``'s program cut into stages (made once; virtual ranks whose programs
        are the same, node for node, share one: even microbatches, usually)."""
        if vrank not in self._cuts:
            root, graph = ProgramBuilder(self.plan.prop, vrank, self.debug, None).build_graph()
            key = _structure(graph)
            if key not in self._same:
                program = _Program(root, graph)
                self._same[key] = MicrobatchCut(program, self.plan.prop.gm, self.stages, self.roles,
                                                self.plan.prop.layouts, self.dim, self.schedule.split_w)
            self._cuts[vrank] = self._same[key]
        return self._cuts[vrank]

    # -- modelled time -------------------------------------------------------------------------
    @cached_property
    def piece_seconds(self) -> dict:
        """{(stage, phase): modelled seconds for one microbatch}: compute of each op (its busiest
        virtual rank), plus the collectives of its moves on the other mesh dims."""
        cut, prop, out = self.cut(0), self.plan.prop, {}
        for key, piece in cut.pieces.items():
            seen, t = set(), 0.0
            for n in piece.nodes:
                step = n.meta.get("sw_step")
                if step is not None:
                    t += 0.0 if step.mesh_dim == self.dim else self.cost.step_time(step, self.vmesh)
                    continue
                origin = n.meta.get(ORIGIN)
                np_ = prop.nodes.get(origin)
                if np_ is not None and origin not in seen:
                    seen.add(origin)
                    t += node_time(self.cost, np_.call, np_.strategy, self.vmesh, np_.rule)
            out[key] = t
        return out

    def message_bytes(self, cut: MicrobatchCut | None = None) -> dict:
        """{(src stage, dst stage): bytes sent per microbatch} (local sizes of virtual rank 0)."""
        cut = cut or self.cut(0)
        out: Counter = Counter()
        for msg in cut.messages:
            lay = cut.layout_of(msg.value)
            out[(msg.src, msg.dst)] += lay.local_numel(self.vmesh, 0) * lay.itemsize
        return dict(out)

    def _p2p_seconds(self, nbytes: float) -> float:
        return self.cost.collective_time("p2p", nbytes, self.mesh.shape[self.dim], self.dim, self.mesh)

    @cached_property
    def timeline(self):
        """The schedule played with the modelled piece times and message times."""
        secs, sched = self.piece_seconds, self.schedule
        msgs = self.message_bytes()

        def duration(a: Action) -> float:
            t = secs.get((a.stage, a.kind), 0.0)
            return t + (secs.get((a.stage, "W"), 0.0) if a.kind == "B" and not sched.split_w else 0.0)

        def comm(a: Action, d: Action) -> float:
            return self._p2p_seconds(msgs.get((d.stage, a.stage), 0))

        return simulate(sched, duration, comm)

    # -- memory --------------------------------------------------------------------------------
    def stage_memory(self) -> list[dict]:
        """Per stage, bytes on its busiest rank: ``masters`` (mixed precision's fp32 masters of its
        parameters; else 0), ``parameters`` (what compute reads: the parameters, or under mixed
        precision their compute copies, made once per step), ``gradients`` (summed over the
        microbatches, in the gradients' dtype), ``optimizer_state`` (the cost model's, over the
        parameters the optimizer updates), ``state`` (their sum), ``stash`` (bytes one microbatch
        keeps from its forward for its backward: stashed values and received activations),
        ``in_flight`` (the most microbatches the schedule keeps stashed at once on it) and
        ``peak`` = state + in_flight * stash."""
        cut, vm, prop = self.cut(0), self.vmesh, self.plan.prop

        def local(lay, dtype=None) -> int:
            itemsize = lay.itemsize if dtype is None else torch.empty((), dtype=dtype).element_size()
            return max(lay.local_numel(vm, r) for r in range(vm.size)) * itemsize

        grads = {r.name: lay for r, lay in zip(self.traced.outputs, prop.output_layouts) if r.kind == GRAD}
        out = []
        for s in range(self.schedule.n_stages):
            parts = dict.fromkeys(("masters", "parameters", "gradients", "updated"), 0)
            for n, r in zip(self.traced.placeholder_nodes(), self.traced.placeholders):
                if r.kind not in (PARAM, BUFFER) or self.stages.owner.get(r.name) != s:
                    continue
                lay = prop.layouts[n.name][0]
                master = n.meta.get(MASTER_DTYPE)
                resident = local(lay, master)
                parts["parameters"] += local(lay)
                if master is not None:
                    parts["masters"] += resident
                if r.requires_grad:
                    parts["updated"] += resident
                    parts["gradients"] += local(grads[r.name]) if r.name in grads else local(lay)
            updated = parts.pop("updated")
            parts["optimizer_state"] = self.cost.optimizer_bytes(updated)
            state = sum(parts.values())
            stash = self._stash_bytes(cut, s)
            inflight = self.schedule_in_flight(s)
            out.append({"stage": s, "rank": self.schedule.rank_of(s), **parts, "state": state, "stash": stash,
                        "in_flight": inflight, "peak": state + inflight * stash})
        return out

    def roles_requires_grad(self, name: str) -> bool:
        return any(r.name == name and r.requires_grad for r in self.traced.placeholders)

    def _stash_bytes(self, cut: MicrobatchCut, stage: int) -> int:
        """Values one microbatch keeps on ``stage`` after its forward: what the later pieces read
        from the forward piece or from messages (not the inputs, parameters or prologue)."""
        pieces = [p for p in cut.piece_order(stage) if p.phase in ("B", "W")]
        f = cut.pieces.get((stage, "F"))
        made = set(f.nodes) if f is not None else set()
        received = {cut.nodes[m.value] for m in cut.messages if m.dst == stage}
        keep = {v for p in pieces for v in p.inputs if v in made or v in received}
        total = 0
        for v in keep:
            lay = cut.layout_of(v.name)
            total += lay.local_numel(self.vmesh, 0) * lay.itemsize
        return total

    def schedule_in_flight(self, stage: int) -> int:
        """The most microbatches ``stage`` holds between their forward and their last backward
        piece, in its rank's action order (search/schedules.Schedule.in_flight)."""
        return self.schedule.in_flight(stage)

    # -- figures ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per step, for the busiest pipeline rank (the microbatch plan's own: ``self.plan.stats()``):
        ``est_step_time_s`` (the modelled schedule's
        makespan plus the epilogues), ``bubble_fraction`` (its idle share over every rank),
        ``comm_bytes`` (collectives of the other mesh dims plus point-to-point messages each rank
        sends), ``p2p_bytes`` (messages only), ``collectives`` {kind: count}, ``peak_memory_bytes``
        (the largest stage's, stage_memory), and ``pipeline``: schedule, split points, and per
        stage its rank, layers, modelled forward/backward seconds and memory."""
        cut, m, secs = self.cut(0), self.config.microbatches, self.piece_seconds
        msgs = self.message_bytes(cut)
        per_rank: list = []
        for r in range(self.schedule.p):
            mine = set(self.schedule.stages_of(r))
            kinds: Counter = Counter()
            nbytes = 0
            for p in cut.pieces.values():
                if p.stage not in mine:
                    continue
                times = 1 if p.phase == "E" else m
                for n in p.nodes:
                    st = n.meta.get("sw_step")
                    if st is not None and st.is_collective and st.mesh_dim != self.dim and n not in p.skip:
                        kinds[st.kind] += times
                        nbytes += times * st.bytes
            p2p = sum(b for (src, _), b in msgs.items() if src in mine) * m
            n_msgs = sum(1 for msg in cut.messages if msg.src in mine) * m
            if n_msgs:
                kinds["p2p"] += n_msgs
            per_rank.append((nbytes + p2p, p2p, dict(kinds)))
        busiest = max(range(len(per_rank)), key=lambda r: per_rank[r][0])
        memory = self.stage_memory()
        worst = max(memory, key=lambda mem: mem["peak"])
        tl = self.timeline
        epilogue = max((secs.get((s, "E"), 0.0) for s in range(self.schedule.n_stages)), default=0.0)
        stages = []
        for s, mem in enumerate(memory):
            stages.append({**mem, "layers": self.stages.layers(self.traced.gm)[s],
                           "forward_s": secs.get((s, "F"), 0.0),
                           "backward_s": secs.get((s, "B"), 0.0) + secs.get((s, "W"), 0.0),
                           "weight_grad_s": secs.get((s, "W"), 0.0)})
        return {
            "comm_bytes": per_rank[busiest][0],
            "p2p_bytes": max(b for _, b, _ in per_rank),
            "collectives": per_rank[busiest][2],
            "est_step_time_s": tl.end + epilogue,
            "bubble_fraction": tl.bubble_fraction(),
            "peak_memory_bytes": worst["peak"],
            "memory": {k: worst[k] for k in ("masters", "parameters", "gradients", "optimizer_state")}
            | {"peak_activations": worst["in_flight"] * worst["stash"]},
            "flops_per_rank": self._flops(),
            "recompute_flops": self._flops(recompute=True),
            "pipeline": {"schedule": self.schedule.name, "ranks": self.schedule.p,
                         "stages_per_rank": self.schedule.v, "microbatches": m,
                         "split_points": list(self.stages.names), "stages": stages,
                         "idle_fraction": [tl.idle_fraction(r) for r in range(self.schedule.p)]},
        }

    def _flops(self, recompute: bool = False) -> float:
        """The busiest pipeline rank's flops per step (``recompute``: of the forward nodes backward
        recomputes, activation checkpointing; their rank is the busiest rank's by all flops)."""
        costs, by_rank, again = self.plan.costs, Counter(), Counter()
        nodes = {n.name: n for n in self.plan.prop.gm.graph.nodes}
        for name, f in costs.node_flops.items():
            r = self.schedule.rank_of(self.stages.of[name])
            by_rank[r] += f * self.config.microbatches
            if RECOMPUTE in nodes[name].meta:
                again[r] += f * self.config.microbatches
        if not by_rank:
            return 0.0
        busiest = max(by_rank, key=lambda r: by_rank[r])
        return again[busiest] if recompute else by_rank[busiest]

    # -- text ----------------------------------------------------------------------------------
    def schedule_table(self) -> str:
        return self.schedule.table()

    def summary(self) -> str:
        st = self.stats()
        pp = st["pipeline"]
        lines = [(f"# stage: pipeline plan on {self.mesh!r}: {self.mesh.names[self.dim]!r} runs {pp['ranks']} x "
                  f"{pp['stages_per_rank']} stage(s), schedule {pp['schedule']}, {pp['microbatches']} microbatches "
                  f"(the microbatch plan below is on {self.vmesh!r})")]
        lines += [f"# note: {n}" for n in self.notes]
        lines.append(f"split points: {', '.join(pp['split_points']) or '(one stage)'}")
        for s in pp["stages"]:
            lines.append(f"stage {s['stage']} on pipeline rank {s['rank']}: {', '.join(s['layers'])}; forward "
                         f"{fmt_seconds(s['forward_s'])}, backward {fmt_seconds(s['backward_s'])} per microbatch; "
                         f"memory: state {fmt_bytes(s['state'])} + {s['in_flight']} x stash {fmt_bytes(s['stash'])} = "
                         f"{fmt_bytes(s['peak'])}")
        lines.append(f"est. step {fmt_seconds(st['est_step_time_s'])}, bubble {st['bubble_fraction']:.1%}, "
                     f"p2p {fmt_bytes(st['p2p_bytes'])} per rank, collectives {st['collectives']}")
        lines += ["modelled timeline (F forward, B backward, W weight gradient):", self.timeline.table(),
                  self.schedule_table(), "", self.plan.summary()]
        return "\n".join(lines)

    def program(self, rank: int = 0, guards: bool = False, annotate: bool = False) -> str:
        """Rank ``rank``'s pieces for microbatch 0, in the order each stage runs them, as Python."""
        cut = self.cut(self.vrank(rank, 0))
        out = [f"# stage: pipeline program (rank {rank}, pipeline rank {self.pp_rank(rank)}, microbatch 0)"]
        if cut.prologue:
            out.append(f"# prologue (every microbatch, before the pipeline): {[n.name for n in cut.prologue]}")
        for s in self.stages_of(rank):
            for piece in cut.piece_order(s):
                recv = [msg for msg in cut.messages if msg.dst == s and msg.phase == piece.phase]
                send = [msg for msg in cut.messages if msg.src == s and msg.value in {v.name for v in piece.outputs}]
                out.append(f"# stage {s} {piece.phase}: receives {[(m.value, m.src) for m in recv]}, sends "
                           f"{[(m.value, m.dst) for m in send]}")
                out.append(piece.module(cut.program).code.strip())
        return "\n".join(out) + "\n"

    def __str__(self) -> str:
        return self.summary()


class _Program:
    """A program's graph and the module holding its constants (what pieces are cut from), without
    the Python a GraphModule would make of the whole program."""

    def __init__(self, root, graph):
        self.root, self.graph = root, graph

    def __getattr__(self, name):
        return getattr(self.__dict__["root"], name)


def _structure(graph) -> tuple:
    """A graph's nodes as plain data (ops, arguments with nodes by name): equal for equal programs."""
    def plain(a):
        if hasattr(a, "name") and hasattr(a, "op"):
            return ("%", a.name)
        if isinstance(a, (list, tuple)):
            return tuple(plain(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, plain(v)) for k, v in a.items())
        return repr(a)

    return tuple((n.op, n.name, str(n.target), plain(n.args), plain(n.kwargs)) for n in graph.nodes)


__all__ = ["ORDER", "PipelinePlan"]
