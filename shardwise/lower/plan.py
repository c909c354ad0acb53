"""Plan: one strategy per node (the search's Propagation), the redistribution on every edge, cost
figures and each rank's program (lower/program.py): lowering's artifact, what run/execute.py runs.
What people read of it: summary(), stats(), compare(other) and program(rank) (each says what it
shows; tools/report/ draws the same rows). Every time is the planner's cost model's (core/cost.py).
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import replace
from functools import cached_property

import torch
import torch.fx as fx

from ..core.collector import collecting_once
from ..core.cost import CostModel
from ..core.units import fmt_bytes
from ..search.classes import plan_classes
from ..search.flops import Costs, plan_costs
from ..search.paths import edge_times, edges
from ..search.params import optimizer_time
from ..search.propagate import Propagation
from ..search.steptime import StepTime, step_time
from ..trace.recompute import RECOMPUTE
from .rows import fmt_placements as _fmt_pl, node_rows, output_rows, short_source
from .annotate import annotate_program
from .buckets import DEFAULT_BUCKET_BYTES, bucket_all_reduce, bucket_reduce_scatter
from ..core.units import fmt_seconds
from .attention_paths import attention_lines
from .explain import MEMORY_PARTS, compare, layer_rows, param_reasons
from .allocator import reserves, training_events
from .memory import MemoryEstimate, plan_memory, program_memory
from .prefetch import start_all_gather
from .program import build_program, program_source


class Plan:
    """``traced``: the step traced (trace/base.py), read by the plan runner (shardwise/run/execute.py) through
    ``arg_layouts``, ``state_args`` and ``flat_args``; None for a plan made for its figures only."""

    def __init__(self, prop: Propagation, param_placeholders: dict, debug: bool = True, stage: str = "step",
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, traced=None, given_params=frozenset(),
                 compile: bool = False, notes=()):
        self.prop, self.traced, self.given_params = prop, traced, given_params
        self.notes = tuple(notes)  # how the planning driver read what was not given (summary's first lines)
        self.compile = compile  # programs run through torch.compile (run/execute.Executable)
        self.bucket_bytes = bucket_bytes  # all_reduce buckets' cap (lower/buckets.py); None: no buckets
        self.mesh = prop.mesh
        self.param_placeholders = dict(param_placeholders)  # placeholder name -> parameter name
        # {parameter name: placements} the ILP chose for the parameters left to it (data the
        # planning driver hands on: module/planning.py)
        self.param_choices = {self.param_placeholders[ph]: tuple(pl) for ph, pl in prop.param_choices.items()}
        self.debug = debug
        self.stage = stage
        self.cost = prop.cost or CostModel()  # the planner's
        self._programs: dict = {}  # guarded programs (debug); the unguarded ones are the prop's
        self._memory_key = (bucket_bytes, tuple(self.param_placeholders.items()))

    # -- programs -----------------------------------------------------------------------
    def program_module(self, rank: int, guards: bool = True) -> fx.GraphModule:
        """Rank ``rank``'s program (built once); ``guards``: with the debug shape checks, if ``debug``."""
        guarded = self.debug and guards
        # unguarded programs are kept on the Propagation: every Plan of it (module/planning.py's budget
        # estimate, then the plan kept) lowers each rank once
        cache, key = (self._programs, rank) if guarded else (self.prop.lowered, (rank, self.bucket_bytes))
        if key not in cache:
            cache[key] = build_program(self.prop, rank, guarded, self.bucket_bytes)
        return cache[key]

    def program(self, rank: int = 0, guards: bool = False, annotate: bool = True) -> str:
        """The per-rank program as Python source: each line that computes a planned node ends in
        a comment with its local shapes, placements and module path. ``guards``: show the
        debug shape checks the program runs (left out by default: they are not the model)."""
        src = program_source(self.program_module(rank, guards and self.debug), rank)
        return annotate_program(src, self, rank) if annotate else src

    @cached_property
    def draws_random(self) -> bool:
        """Whether the programs may draw random numbers: the plan has a seeded aten op (dropout,
        bernoulli, rand_like: its local call draws from the rank's generator, rules/random.py) or an
        op that is not aten's (a custom op's local call may draw). When False the backends leave the
        generators alone (run/backend.py): a run that draws nothing leaves them as it found them."""
        for n in self.prop.gm.graph.nodes:
            t = n.target
            if n.op != "call_function" or t is operator.getitem:
                continue
            if (not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten"
                    or torch.Tag.nondeterministic_seeded in t.tags):
                return True
        return False

    # -- the program's arguments (what shardwise/run/execute.py reads) ------------------------
    @cached_property
    def arg_layouts(self) -> list:
        """Per program argument (placeholder, in order): an input's or target's Layout, None for state."""
        lays = self.prop.layouts
        return [lays[n.name][0] if r.kind in ("input", "target") else None
                for n, r in zip(self.traced.placeholder_nodes(), self.traced.placeholders)]

    @cached_property
    def state_args(self) -> list | None:
        """The parameter and buffer names leading the arguments when the step was traced with plain
        positional tensors only (no constants, nesting or keywords: each input and target an argument
        after them); None otherwise (``flat_args`` sorts the arguments out)."""
        a = self.traced.args
        plain = all(t.paths == [(*head, i) for i in range(len(t.leaves))] and len(t.tensor_idx) == len(t.leaves)
                    for t, head in ((a.inputs, (0,)), (a.targets, ())))
        return list(a.param_names) + list(a.buffer_names) if plain else None

    def flat_args(self, state: dict, inputs: tuple, targets: tuple, kwargs: dict | None = None) -> list:
        """The program's arguments from a rank's state and the step's inputs, targets and keyword
        inputs (any nesting, constants checked against the traced ones), as given."""
        a = self.traced.args
        return a.flat({n: state[n] for n in a.param_names}, {n: state[n] for n in a.buffer_names}, tuple(inputs),
                      dict(kwargs or {}), tuple(targets))

    # -- figures ------------------------------------------------------------------------
    @cached_property
    def edges(self) -> list:
        """The redistributions the program emits, each once: (consumer, producer, steps)
        (search/paths.edges: what the ILP prices)."""
        return edges(self.prop)

    def collective_steps(self) -> list:
        return [s for _, _, steps in self.edges for s in steps if s.is_collective]

    @cached_property
    def edge_seconds(self) -> list:
        """Per edge, its steps' modelled seconds as the program runs them: gradients in their
        buckets, FSDP gathers one latency per coalesced call (search/paths.edge_times)."""
        return edge_times(self.prop, self.cost, self.bucket_bytes)

    @cached_property
    def step_time(self) -> StepTime:
        """The modelled step (search/steptime.py): what the planner minimised, as stats() reports it."""
        return step_time(self.prop, self.cost, self.bucket_bytes)

    @cached_property
    def costs(self) -> Costs:
        """Flops and compute seconds per node and per rank (search/flops.py)."""
        return plan_costs(self.prop, self.cost)

    @collecting_once
    def memory(self) -> dict:
        """Per-rank figures of the busiest rank, from a liveness analysis of its program
        (lower/memory.py): parameters, gradients (each counted once; those made by the peak), and
        peak_activations: everything else live at the peak (inputs, activations, collective
        buffers), so the three add up to the peak. ``memory_estimate(rank)`` has one rank's curve."""
        return plan_memory(self)

    def reserved_memory(self) -> dict:
        """What PyTorch's CUDA caching allocator would hold for the busiest rank's program
        (``memory()["rank"]``) over three training steps, the optimizer's state (the cost model's
        ``optimizer_state``, AdamW's two moments) made after the first (none for a forward-only
        plan): {"expandable": Reserve, "segments": Reserve} (lower/allocator.py), with
        ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and with torch's default segments;
        ``.reserved`` as ``torch.cuda.max_memory_reserved`` reports it."""
        est = self.memory_estimate(self.memory()["rank"])
        params = [b for _, b in est.param_storages] if self.stage == "step" else []
        return reserves(training_events([b for _, b in est.resident_storages], params, est.intervals, est.temps,
                                        len(est.curve), state=self.cost.optimizer_state))

    @property
    def rank_classes(self):
        """Ranks whose programs see the same shapes (search/classes.py): one stands for its class."""
        return plan_classes(self.prop)

    @collecting_once
    def memory_estimate(self, rank: int = 0) -> MemoryEstimate:
        """Rank ``rank``'s MemoryEstimate: peak, resident arguments, gradients, bytes live per node
        (one fake run of the program of its rank class's first rank, made once per class)."""
        rep = self.rank_classes.of(rank)
        key = ("memory", rep, *self._memory_key)
        if key not in self.prop.lowered:
            self.prop.lowered[key] = program_memory(self, rep)
        est = self.prop.lowered[key]
        return est if rep == rank else replace(est, rank=rank)

    def collective_calls(self, rank: int = 0) -> dict:
        """{kind: calls} that rank ``rank``'s program makes per run: a bucket of all_reduces (of
        reduce_scatters) is one ``"all_reduce"`` (``"reduce_scatter"``) call; collectives a
        local call runs itself are not seen here."""
        one_call = {bucket_all_reduce: "all_reduce", bucket_reduce_scatter: "reduce_scatter",
                    start_all_gather: "all_gather"}  # a bucket; prefetched all_gathers (lower/prefetch.py)
        calls = Counter()
        for n in self.program_module(rank, guards=False).graph.nodes:
            if n.op == "call_function" and n.target in one_call:
                calls[one_call[n.target]] += 1
            elif n.op == "call_function" and "sw_step" in n.meta and n.meta["sw_step"].is_collective:
                calls[n.meta["sw_step"].kind] += 1
        return dict(calls)

    @collecting_once
    def stats(self) -> dict:
        """Figures per rank per run. ``collectives``: {kind: count} of planned collectives, one
        per redistributed tensor (a bucket counts as its members, so the count does not depend
        on ``bucket_bytes``), with those ops run inside their local call (Rule.comm: halo and
        ring send_recvs, statistics all_reduces); ``comm_bytes``: what each rank sends for them
        (a bucket sends exactly its members' bytes), ``comm_bytes_by_dim`` per mesh-dim name,
        ``comm_bytes_by_dtype`` per dtype sent ("bfloat16", "float32", ...) and
        ``collectives_by_dtype`` {kind: {dtype: count}} (``collectives`` by the dtype each sends);
        ``collective_calls``: {kind: calls} rank 0's program makes, a bucket being one call
        (fewer than ``collectives`` when gradients are bucketed), not counting ``op_collectives``:
        {kind: count} of those run inside ops' local calls (in ``collectives`` too).
        ``flops_per_rank``: the busiest rank's, ``recompute_flops`` of them the forward recomputed
        in backward (activation checkpointing); ``est_step_time_s``: the modelled step the planner
        minimised (search/steptime.py), ``compute_time_s`` (each node on its busiest rank) plus
        ``exposed_comm_time_s``: all of ``comm_time_s``, or with a cost model that overlaps
        (``CostModel.overlap``) what compute does not hide, plus ``optimizer_time_s`` (a step's
        optimizer update of the parameter shards, search/params.optimizer_time); ``peak_memory_bytes``: the sum of
        ``memory``'s parts (lower/memory.plan_memory): fp32 ``masters`` (mixed precision; else 0),
        the ``parameters`` compute reads, ``gradients``, ``optimizer_state`` (the cost model's
        ``optimizer_state`` times the parameters the optimizer updates, for a step) and
        ``peak_activations``. Times are the plan's cost model's (``self.cost``)."""
        steps = self.collective_steps()
        mem = dict(self.memory())
        mem["optimizer_state"] = self.cost.optimizer_bytes(mem.pop("updated")) if self.stage == "step" else 0
        by_dim = dict.fromkeys(self.mesh.names, 0)
        by_dtype: dict = {}
        kinds_by_dtype: dict = {}
        for s in steps:
            by_dim[self.mesh.names[s.mesh_dim]] += s.bytes
            dtype = str(s.src.dtype).replace("torch.", "")
            by_dtype[dtype] = by_dtype.get(dtype, 0) + s.bytes
            counts = kinds_by_dtype.setdefault(s.kind, {})
            counts[dtype] = counts.get(dtype, 0) + 1
        step = self.step_time
        # the optimizer step after backward (memory-bound, per rank: search/params.py), in the modelled step
        optimizer_s = optimizer_time(self.prop, self.param_placeholders, self.cost) if self.stage == "step" else 0.0
        return {
            "comm_bytes": sum(s.bytes for s in steps),
            "comm_bytes_by_dim": by_dim,
            "comm_bytes_by_dtype": by_dtype,
            "comm_time_s": step.comm_s,
            "collectives": dict(Counter(s.kind for s in steps)),
            "collectives_by_dtype": kinds_by_dtype,
            "collective_calls": self.collective_calls(0),
            "op_collectives": dict(Counter(s.kind for dst, src, ss in self.edges if dst == src
                                           for s in ss if s.is_collective)),
            "flops_per_rank": max(self.costs.flops_by_rank, default=0.0),
            "recompute_flops": self.recompute_flops(),
            "compute_time_s": step.compute_s,
            "exposed_comm_time_s": step.exposed_comm_s,
            "optimizer_time_s": optimizer_s,
            "est_step_time_s": step.total_s + optimizer_s,
            "peak_memory_bytes": sum(mem[k] for k in MEMORY_PARTS),
            "memory": mem,
            "nodes": len(self.prop.nodes),
        }

    def recompute_flops(self) -> float:
        """Flops of the forward nodes backward recomputes (activation checkpointing; each on its
        busiest rank), included in ``flops_per_rank``."""
        return sum(self.costs.node_flops.get(n.name, 0.0) for n in self.prop.gm.graph.nodes if RECOMPUTE in n.meta)

    def compare(self, other: "Plan", names: tuple[str, str] = ("this", "other")) -> str:
        """What differs between this plan and ``other`` (strategies per node, parameter
        placements, bytes per mesh dim, modelled time, memory) and what each costs, as text."""
        return compare(self, other, names)

    @collecting_once
    def summary(self) -> str:
        """The plan as a table: one row per node (op, module, placements, source, collectives)
        and one per redistributed graph output, then totals and memory per rank."""
        lines = [f"# stage: plan ({self.stage}) on {self.mesh!r}"] + [f"# note: {n}" for n in self.notes]
        if self.prop.solve_report is not None:
            lines.append(f"# planner: {self.prop.solve_report}")
        table = [("node", "op", "module", "inputs -> outputs", "source", "collectives")]
        for r in node_rows(self) + output_rows(self):
            comm = ", ".join(map(repr, r.steps))
            ins = " ".join(_fmt_pl(p) for p in r.ins)
            outs = " ".join(_fmt_pl(p) for p in r.outs)
            table.append((r.name, r.op, r.module, f"{ins} -> {outs}", short_source(r.source),
                          comm + (" [replicate fallback]" if r.fallback else "")))
        lines += _columns(table)
        st = self.stats()
        mem = st["memory"]
        dims = ", ".join(f"{d!r} {fmt_bytes(b)}" for d, b in st["comm_bytes_by_dim"].items())
        lines += [
            f"totals: {sum(st['collectives'].values())} collectives {st['collectives']}, "
            f"{fmt_bytes(st['comm_bytes'])} sent per rank per {self.stage} ({dims}), "
            f"est. {st['comm_time_s'] * 1e6:.1f} us",
            f"est. {self.stage} time (busiest rank): {fmt_seconds(st['est_step_time_s'])} = "
            + (f"exposed communication {fmt_seconds(st['exposed_comm_time_s'])} (of {fmt_seconds(st['comm_time_s'])})"
               if self.step_time.overlap else f"communication {fmt_seconds(st['comm_time_s'])}")
            + f" + compute {fmt_seconds(st['compute_time_s'])} ({st['flops_per_rank']:.4g} flop"
            + (f", {st['recompute_flops']:.4g} of it recomputed)" if st["recompute_flops"] else ")")
            + (f" + optimizer {fmt_seconds(st['optimizer_time_s'])}" if st["optimizer_time_s"] else ""),
            f"memory per rank, at the peak: {'masters ' + fmt_bytes(mem['masters']) + ', ' if mem['masters'] else ''}"
            f"parameters {fmt_bytes(mem['parameters'])}, gradients {fmt_bytes(mem['gradients'])}, "
            f"optimizer state {fmt_bytes(mem['optimizer_state'])}, "
            f"peak activations {fmt_bytes(mem['peak_activations'])}",
        ]
        return "\n".join(lines + attention_lines(self) + self._explained())

    def _explained(self) -> list:
        """The cost per layer and why each parameter has its placement (lower/explain.py)."""
        table = [("layer", "comm", "comm time", "compute", "flop", "params+grads+optimizer", "peak live")]
        for lc in layer_rows(self):
            table.append((lc.layer, fmt_bytes(lc.comm_bytes), fmt_seconds(lc.comm_s), fmt_seconds(lc.compute_s),
                          f"{lc.flops:.3g}", fmt_bytes(lc.state_bytes), fmt_bytes(lc.peak_live_bytes)))
        lines = [f"cost per layer (per rank; compute on each node's busiest rank; peak live: the most bytes live "
                 f"while one of its nodes runs on rank {self.memory()['rank']})"] + _columns(table)
        reasons = param_reasons(self)
        if reasons:
            lines += ["parameters:"] + _columns([("parameter", "placements", "why")] + reasons)
        return lines

    def __str__(self) -> str:
        return self.summary()


def _columns(table: list, cap: int = 44) -> list:
    """Left-aligned columns as wide as their widest cell (at most ``cap``; the last column free)."""
    widths = [min(cap, max(len(row[c]) for row in table)) for c in range(len(table[0]) - 1)]
    return [(" ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " " + row[-1]).rstrip() for row in table]
