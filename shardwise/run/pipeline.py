"""The pipeline runner: every rank runs its schedule's actions on its stages' pieces.

    exe = PipelineExecutable(pplan)          # lower/pipeline.PipelinePlan
    outs = exe.run(backend, shards, inputs, targets, kwargs)   # {rank: [loss, grads...]}
    exe.timeline()                           # the measured timeline of the last run (pm.pipeline_timeline())

One step on one rank (``_RankStep``), inside the backend's run (threads: one thread per rank;
torch: this process), with the rank's collectives and random generator in scope:

1. The prologue: collectives over the microbatches of values made from the inputs and targets
   alone (the count of non-ignored labels), computed for every microbatch and reduced across
   them in microbatch order, before any stage runs (lower/stages.py).
2. Step messages: a parameter another stage reads (a tied head) goes there once.
3. The actions, in the schedule's order (search/schedules.py). Before an action its messages
   are received (blocking: point-to-point recv on the pipeline dim's group, tags per
   microbatch and value); its piece runs; its outputs are sent (never blocking: the sends are
   waited for at the end of the step) or kept for the stage's later pieces of that
   microbatch, and freed after their last reader. Messages between two stages of one rank
   (interleaved) are handed over in memory.
4. The outputs (loss, gradients) of each microbatch are summed in microbatch-action order;
   the epilogue pieces then run their reductions over the other mesh dims once; the loss is
   broadcast from its stage over the pipeline dim.

Random numbers: each stage's forward draws what one device draws for the whole batch and keeps
its microbatch's slice (rules/random.py), so every microbatch of a stage starts from the same
generator state: the state a single device has after the earlier stages' draws. Stage 0 starts
from the step's state; the first forward of stage s hands its end state to stage s + 1 (a
message); the last stage's end state, one device's after the step, is broadcast to every rank.

Measured: per action its start and end (``RunRecord``; with ``Pipeline(timed=True)`` the step
starts and ends on a barrier, so every rank's idle share is counted against the same span), and
the most bytes the rank kept between actions (stashed activations, received values, pending
hand-overs); ``PipelineExecutable.timeline`` gives them as a search/schedules.Timeline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..core import scope
from ..core.errors import ConfigError
from ..lower.stages import ORDER
from ..search.schedules import Timeline
from ..trace.roles import BUFFER, PARAM
from ..trace.value_guards import check_call
from .collectives import reduce_list

STRIDE = 1 << 16  # tag = microbatch * STRIDE + message index (a microbatch's messages < STRIDE)


@dataclass
class RunRecord:
    """One rank's last step: ``actions`` [(Action, start s, end s)] from ``t0`` (the step's start),
    ``t_end`` (its end), ``peak_stash_bytes``: the most bytes held between actions."""

    actions: list = field(default_factory=list)
    t0: float = 0.0
    t_end: float = 0.0
    peak_stash_bytes: int = 0

    def busy(self) -> float:
        return sum(e - s for _, s, e in self.actions)

    def idle_fraction(self) -> float:
        span = self.t_end - self.t0
        return 1.0 - self.busy() / span if span > 0 else 0.0


class PipelineExecutable:
    """Runs one PipelinePlan; ``timing`` (the plan's ``Pipeline(timed=...)``): barriers around
    each step (common start and end); ``records``: {rank: RunRecord} of the last run of each
    rank held here."""

    def __init__(self, plan):
        self.plan = plan
        self.inputs_checked = False  # inputs="global" on the torch backend (module/inputs.check_same_inputs)
        self.timing = bool(getattr(plan.config, "timed", False))
        self.records: dict = {}
        self._modules: dict = {}

    def timeline(self) -> Timeline | None:
        """The last run as a Timeline over pipeline ranks (the first rank held here of each
        pipeline coordinate; its actions' starts and ends from its step's start, its span and the
        most bytes it held); None before the first run."""
        if not self.records:
            return None
        tl, seen = Timeline(span=0.0), set()
        for rank, rec in sorted(self.records.items()):
            pp = self.plan.pp_rank(rank)
            if pp in seen:
                continue
            seen.add(pp)
            for a, s, e in rec.actions:
                tl.start[a], tl.finish[a], tl.rank_of[a] = s, e, pp
            tl.span = max(tl.span, rec.t_end)
            tl.held_bytes[pp] = rec.peak_stash_bytes
        return tl

    def owns(self, rank: int, indices: tuple) -> bool:
        """As Executable.owns; not told for a pipelined step's outputs, gathered from its pieces."""
        return False

    def run(self, backend, shards: dict, inputs: tuple, targets: tuple, kwargs: dict | None = None,
            local: dict | None = None) -> dict:
        if local is not None:
            raise ConfigError('pipeline= runs global inputs only', fix='pass inputs="global"')
        plan = self.plan
        a = plan.traced.args
        check_call(plan.traced.gm, a, inputs, targets, kwargs)
        flat = a.flat(dict.fromkeys(a.param_names), dict.fromkeys(a.buffer_names), tuple(inputs), dict(kwargs or {}),
                      tuple(targets))
        for r in backend.ranks:  # programs and pieces made here, before the ranks start
            for i in range(plan.config.microbatches):
                cut = plan.cut(plan.vrank(r, i))
                for s in plan.stages_of(r):
                    for piece in cut.piece_order(s):
                        piece.module(cut.program)
        steps = {r: _RankStep(self, r, shards[r], flat) for r in backend.ranks}
        outs = backend.run(steps, lambda r: ())
        for r, st in steps.items():
            self.records[r] = st.record
        return outs


class _RankStep:
    """One rank's step (module docstring); called by the backend with the rank's scope set."""

    def __init__(self, exe: PipelineExecutable, rank: int, state: dict, flat: list):
        self.exe, self.plan, self.rank, self.state, self.flat = exe, exe.plan, rank, state, flat
        p = self.plan
        self.sched, self.m, self.dim = p.schedule, p.config.microbatches, p.dim
        self.me = p.pp_rank(rank)
        self.mine = set(p.stages_of(rank))
        self.cuts = [p.cut(p.vrank(rank, i)) for i in range(self.m)]
        self.record = RunRecord()
        self._index = {n.name: k for k, n in enumerate(p.traced.placeholder_nodes())}

    # -- the step ----------------------------------------------------------------------------
    def __call__(self):
        self.comm, self.gen = scope.current(), scope.rank_generator()
        self.envs: dict = {}  # (stage, microbatch) -> {program node: value}
        self.mail: dict = {}  # (value, dst stage, microbatch) -> value handed over on this rank
        self.sends: list = []  # (handle, tensor) until the step's end
        self.acc: dict = {}  # output index -> running sum
        self.random = bool(self.cuts[0].random_pieces())  # then every stage hands the state on
        self.rng: dict = {}
        if self.random:
            if self.gen is None:
                raise ConfigError("pipeline: random ops need the rank's generator", fix="run through a backend")
            self.rng[0] = self.gen.get_state()
        self.prologue = self._prologue()
        self.casts = self._casts()
        self.step_values = self._step_messages()
        if self.exe.timing:
            self.comm.barrier()
        self.record.t0 = time.perf_counter()
        for a in self.sched.ranks[self.me]:
            start = self._act(a)  # after its receives: the wait for them is idle time
            self.record.actions.append((a, start - self.record.t0, time.perf_counter() - self.record.t0))
            self._measure()
        for handle, _ in self.sends:
            handle.wait()
        out = self._epilogue()
        if self.exe.timing:
            self.comm.barrier()
        self.record.t_end, self.record.t0 = time.perf_counter() - self.record.t0, 0.0
        return out

    # -- arguments -----------------------------------------------------------------------------
    def _arg(self, i: int, name: str):
        """Placeholder ``name``'s value for microbatch ``i``: this rank's shard of a parameter or
        buffer (or the owner's, received once per step), or microbatch i's local input."""
        role = self.plan.roles[name]
        if role.kind in (PARAM, BUFFER):
            return self.state.get(role.name)
        k = self._index[name]
        lay = self.plan.plan.arg_layouts[k]
        return lay.local_view(self.flat[k], self.plan.vmesh, self.plan.vrank(self.rank, i))

    def _value(self, stage: int, i: int, v: fx.Node):
        env = self.envs.get((stage, i), {})
        if v in env:
            return env[v]
        if v.name in self.casts:
            return self.casts[v.name]
        if (v.name, stage) in self.step_values:
            return self.step_values[(v.name, stage)]
        if v.op == "placeholder":
            role = self.plan.roles[v.name]
            if role.kind in (PARAM, BUFFER) and role.name not in self.state:
                return self.step_values[(v.name, stage)]
            return self._arg(i, v.name)
        return self.prologue[i][v.name]

    # -- prologue and step messages -------------------------------------------------------------
    def _prologue(self) -> list:
        """{name: value} per microbatch of the prologue nodes the stages here read."""
        cut0 = self.cuts[0]
        wanted = {v.name for s in self.mine for p in cut0.piece_order(s) for v in p.inputs}
        if not cut0.prologue or not wanted & {n.name for n in cut0.prologue}:
            return [{} for _ in range(self.m)]
        envs = [{} for _ in range(self.m)]
        for k, n0 in enumerate(cut0.prologue):
            nodes = [cut.prologue[k] for cut in self.cuts]
            step = n0.meta.get("sw_step")
            if step is not None and step.mesh_dim == self.dim and step.is_collective:
                parts = [envs[i][nodes[i].args[0].name] for i in range(self.m)]
                whole = reduce_list(parts, step.op or "sum") if step.kind == "all_reduce" else \
                    torch.cat(parts, dim=nodes[0].args[2])
                for env, n in zip(envs, nodes):
                    env[n.name] = whole
                continue
            for i, (env, n) in enumerate(zip(envs, nodes)):
                env[n.name] = _call(n, lambda a, i=i, env=env: env[a.name] if a.name in env else self._leaf(i, a))
        return envs

    def _leaf(self, i: int, a: fx.Node):
        if a.op == "get_attr":
            return getattr(self.cuts[i].program, a.target)
        return self._arg(i, a.name)

    def _casts(self) -> dict:
        """Mixed precision: {cast node: the compute copy} of each master held here, made once per step."""
        out = {}
        for n in self.cuts[0].casts:
            master = self.state.get(self.plan.roles[n.args[0].name].name)
            if master is not None:
                out[n.name] = _call(n, lambda a: master)
        return out

    def _step_messages(self) -> dict:
        """Parameters (or their compute copies) read by another stage than their owner's: sent
        once, before the actions."""
        out, cut, handles = {}, self.cuts[0], []
        tag0 = self.m * STRIDE
        for msg in cut.step_messages:
            value = self.casts.get(msg.value)
            if value is None and msg.src in self.mine:
                value = self.state[self.plan.roles[msg.value].name]
            if msg.src in self.mine and msg.dst in self.mine:
                out[(msg.value, msg.dst)] = value
            elif msg.src in self.mine:
                self.sends.append((self.comm.send(value, self.dim, self.sched.rank_of(msg.dst),
                                                  tag0 + msg.index), value))
        for msg in cut.step_messages:
            if msg.dst in self.mine and msg.src not in self.mine:
                lay = cut.layout_of(msg.value)
                shape = lay.local_shape(self.plan.vmesh, self.plan.vrank(self.rank, 0))
                handles.append(((msg.value, msg.dst), self.comm.recv(shape, lay.dtype, self.dim,
                                                                      self.sched.rank_of(msg.src), tag0 + msg.index)))
        for key, h in handles:
            out[key] = h.wait()
        return out

    # -- one action ---------------------------------------------------------------------------------
    def _act(self, a) -> float:
        """Run action ``a``; returns when its work began (its messages received)."""
        i, s = a.mb, a.stage
        cut = self.cuts[i]
        env = self.envs.setdefault((s, i), {})
        self._receive(cut, s, a.kind, i, env)
        piece = cut.pieces.get((s, a.kind))
        if a.kind == "F" and self.random:
            self.gen.set_state(self._rng_state(s))
        start = time.perf_counter()
        if piece is not None:
            outs = piece.module(cut.program)(*[self._value(s, i, v) for v in piece.inputs])
            env.update(zip(piece.outputs, outs))
            self._send(cut, piece, i, env)
            self._collect(cut, piece, i, env)
        if a.kind == "F" and self.random:
            self._hand_rng(s)
        self._free(cut, s, a.kind, i)
        return start

    def _receive(self, cut, s: int, phase: str, i: int, env: dict) -> None:
        waits = []
        for msg in cut.messages:
            if msg.dst != s or msg.phase != phase:
                continue
            v = cut.nodes[msg.value]
            if self.sched.rank_of(msg.src) == self.me:
                env[v] = self.mail.pop((msg.value, s, i))
                continue
            lay = cut.layout_of(msg.value)
            shape = lay.local_shape(self.plan.vmesh, self.plan.vrank(self.rank, i))
            waits.append((v, self.comm.recv(shape, lay.dtype, self.dim, self.sched.rank_of(msg.src),
                                            i * STRIDE + msg.index)))
        for v, h in waits:
            env[v] = h.wait()

    def _send(self, cut, piece, i: int, env: dict) -> None:
        made = {v.name for v in piece.outputs}
        for msg in cut.messages:
            if msg.src != piece.stage or msg.value not in made:
                continue
            t = env[cut.nodes[msg.value]]
            if self.sched.rank_of(msg.dst) == self.me:
                self.mail[(msg.value, msg.dst, i)] = t
            else:
                self.sends.append((self.comm.send(t, self.dim, self.sched.rank_of(msg.dst), i * STRIDE + msg.index),
                                   t))

    def _collect(self, cut, piece, i: int, env: dict) -> None:
        """Add this microbatch's loss and gradient parts made by ``piece`` into the running sums."""
        made = set(piece.outputs)
        for o in cut.outputs:
            v = cut.nodes[o.value]
            if v not in made or (o.first and i != 0):
                continue
            x = env[v]
            if o.index not in self.acc:
                self.acc[o.index] = x.clone()
            else:
                self.acc[o.index].add_(x)

    def _free(self, cut, s: int, phase: str, i: int) -> None:
        """Keep only what the stage's later pieces of microbatch ``i`` read."""
        later = [p for p in cut.piece_order(s) if ORDER[p.phase] > ORDER[phase] and p.phase != "E"]
        if phase == "B" and not self.sched.split_w:
            later = []
        keep = {v for p in later for v in p.inputs}
        env = self.envs.get((s, i), {})
        if keep:
            self.envs[(s, i)] = {v: x for v, x in env.items() if v in keep}
        else:
            self.envs.pop((s, i), None)

    def _measure(self) -> None:
        seen, total = set(), 0
        for env in [*self.envs.values(), self.mail]:
            for x in env.values():
                if isinstance(x, torch.Tensor) and x.numel():
                    key = (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel())
                    if key not in seen:
                        seen.add(key)
                        total += x.numel() * x.element_size()
        self.record.peak_stash_bytes = max(self.record.peak_stash_bytes, total)

    # -- random generator states ------------------------------------------------------------------------
    def _rng_state(self, s: int) -> torch.Tensor:
        if s not in self.rng:
            src = self.sched.rank_of(s - 1)
            if src == self.me:
                self.rng[s] = self.mail.pop(("rng", s, -1))
            else:
                n = self.rng_numel()
                self.rng[s] = self.comm.recv((n,), torch.uint8, self.dim, src, (self.m + 1) * STRIDE + s).wait()
        return self.rng[s]

    def rng_numel(self) -> int:
        return torch.Generator().get_state().numel()

    def _hand_rng(self, s: int) -> None:
        """After stage ``s``'s first forward: its end state is stage s + 1's start (or the step's end)."""
        if s + 1 in self.rng or ("rng", s + 1, -1) in self.mail or ("sent", s + 1) in self.rng:
            return
        end = self.gen.get_state()
        if s + 1 == self.sched.n_stages:
            self.rng[s + 1] = end
        elif self.sched.rank_of(s + 1) == self.me:
            self.mail[("rng", s + 1, -1)] = end
        else:
            self.rng[("sent", s + 1)] = True
            self.sends.append((self.comm.send(end, self.dim, self.sched.rank_of(s + 1),
                                              (self.m + 1) * STRIDE + s + 1), end))

    # -- the end of the step ------------------------------------------------------------------------------
    def _epilogue(self) -> list:
        cut = self.cuts[0]
        n_out = len(self.plan.traced.outputs)
        res: list = [None] * n_out
        for s in sorted(self.mine):
            e = cut.pieces.get((s, "E"))
            if e is None:
                continue
            by_value = {o.value: o for o in cut.outputs if o.stage == s}
            finals = e.module(cut.program)(*[self.acc[by_value[v.name].index] for v in e.inputs])
            got = dict(zip((v.name for v in e.outputs), finals))
            for o in by_value.values():
                res[o.index] = got[o.final]
        loss = next(o for o in cut.outputs if o.index == 0)
        res[0] = self._broadcast(res[0], loss.stage, cut.layout_of(loss.final))
        if self.random:
            final = self.rng.get(self.sched.n_stages)
            final = self._broadcast(final, self.sched.n_stages - 1, None, shape=(self.rng_numel(),),
                                    dtype=torch.uint8)
            self.gen.set_state(final)
        return res

    def _broadcast(self, value, stage: int, layout, shape=None, dtype=None):
        """``value`` of ``stage``'s ranks on every rank of the pipeline dim."""
        if self.plan.mesh.shape[self.dim] == 1:
            return value
        src = self.sched.rank_of(stage)
        if value is None:
            shape = shape if shape is not None else layout.local_shape(self.plan.vmesh, self.plan.vrank(self.rank, 0))
            value = torch.zeros(shape, dtype=dtype or layout.dtype)
        return self.comm.broadcast(value.contiguous(), self.dim, src)


def _call(n: fx.Node, lookup):
    """Run one program node with its arguments looked up."""
    args = fx.node.map_arg(n.args, lookup)
    kwargs = fx.node.map_arg(n.kwargs, lookup)
    return n.target(*args, **kwargs)


__all__ = ["STRIDE", "PipelineExecutable", "RunRecord"]
