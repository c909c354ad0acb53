"""One microbatch's program cut into pipeline stages: what each stage runs, keeps and sends.

    cut = MicrobatchCut(program, graph, stages, roles, layouts, mb_dim, split_w)
    cut.pieces[(stage, "F")].module()   # the stage's forward as an fx program (prints as Python)
    cut.messages                        # values one stage sends another, each with its tag index
    cut.prologue                        # nodes run before the pipeline, over every microbatch

The program is a virtual rank's (module/pipeline.py): the whole step for one microbatch, its
collectives on the other mesh dims explicit. Every program node belongs to the graph node it
was made for (``meta['sw_origin']``, lower/program.py), so a redistribution runs with its
consumer; that graph node's stage (search/stages.py) and direction give the piece:

- F (forward), B (backward), and with ``split_w`` (zero-bubble) B keeps the backward nodes
  that lead to a value another stage reads (the input gradient) and W gets the rest (the
  weight gradients); E, the epilogue, runs the moves of the graph's outputs once per step
  on their sums over the microbatches (gradients and loss are partial sums over the
  microbatch dim, so the all-reduce of data parallelism runs once, not per microbatch).
- A value read in another piece of the same stage is kept (stashed) until then; read in
  another stage it is a point-to-point message, received by the first piece there that reads
  it. A parameter read by another stage than its owner's (a tied head) is one message per step.
- A collective on the microbatch dim is a reduction over the microbatches. One whose inputs
  come from the inputs and targets alone (the count of non-ignored labels, trace/microbatch.py)
  is the prologue: run for every microbatch before the pipeline starts, reduced across them.
  One that needs the model's parameters or activations would need every microbatch at once:
  MicrobatchError, naming the op.
- Under mixed precision each master's compute copy (its cast, lower/program.py) is made once
  per step by the ranks owning it (``casts``), not per microbatch, and is one step message to
  another stage that reads it (a tied head receives the bf16 copy, half the master's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..core.errors import MicrobatchError, ShardingError
from ..trace.roles import BUFFER, INPUT, PARAM, TARGET
from .prefetch import CAST_OF
from .program import ORIGIN, ORIGIN_OUTPUT

ORDER = {"F": 0, "B": 1, "W": 2, "E": 3}


@dataclass
class Piece:
    """The program nodes one stage runs in one phase; ``inputs``: values it reads from outside
    (placeholders, stashed or received values, prologue results, and for E the summed
    outputs); ``outputs``: values read after it."""

    stage: int
    phase: str
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    skip: set = field(default_factory=set)  # E: partial_local steps on the microbatch dim (the sum is taken once)
    _module: fx.GraphModule | None = None

    def read(self, v: fx.Node) -> None:
        if v not in self.inputs:
            self.inputs.append(v)

    def give(self, v: fx.Node) -> None:
        if v not in self.outputs:
            self.outputs.append(v)

    def module(self, root: torch.nn.Module) -> fx.GraphModule:
        """The piece as an fx program: ``module(*inputs) -> tuple(outputs)`` (built once)."""
        if self._module is None:
            g, env = fx.Graph(), {}
            for v in self.inputs:
                env[v] = g.placeholder(v.name)
            attrs = torch.nn.Module()

            def arg(a: fx.Node):
                if a not in env and a.op == "get_attr":
                    setattr(attrs, a.target, getattr(root, a.target))
                    env[a] = g.get_attr(a.target)
                return env[a]

            for n in self.nodes:
                env[n] = arg(n.args[0]) if n in self.skip else g.node_copy(n, arg)
            g.output(tuple(env[v] for v in self.outputs))
            self._module = fx.GraphModule(attrs, g, class_name=f"Stage{self.stage}{self.phase}")
        return self._module


@dataclass(frozen=True)
class Message:
    """``value`` (a program node name) from stage ``src`` to stage ``dst``, received before the
    ``phase`` piece there; ``index``: its tag index within the microbatch (or the step)."""

    value: str
    src: int
    dst: int
    phase: str
    index: int


@dataclass(frozen=True)
class Output:
    """Graph output ``index``: ``value`` (the pre-move program node) summed over microbatches
    (``first``: taken from microbatch 0 only, a value the same for every microbatch), then the
    E piece of ``stage`` moves it to ``final`` (a program node name)."""

    index: int
    value: str
    final: str
    stage: int
    first: bool


class MicrobatchCut:
    """``program`` (fx.GraphModule of one virtual rank) of the traced ``graph`` cut by ``stages``
    (search/stages.Stages of the graph); ``roles``: {placeholder name: PlaceholderRole};
    ``layouts``: the plan's {graph node name: [Layout]}; ``mb_dim``: the microbatch mesh dim;
    ``split_w``: the backward split into B and W."""

    def __init__(self, program: fx.GraphModule, graph: fx.GraphModule, stages, roles: dict, layouts: dict,
                 mb_dim: int, split_w: bool = False):
        self.program, self.stages, self.roles, self.layouts = program, stages, roles, layouts
        self.mb_dim, self.split_w = mb_dim, split_w
        self.nodes = {n.name: n for n in program.graph.nodes}
        self.pieces: dict = {}
        self.where: dict = {}  # program node -> Piece
        self.prologue: list = []  # program nodes, in order
        self.casts: list = []  # mixed precision: each master's compute copy, made once per step by its owner
        self.messages: list[Message] = []
        self.step_messages: list[Message] = []  # parameters read by another stage than their owner's
        self.outputs: list[Output] = []
        self._graph_nodes = {n.name: n for n in graph.graph.nodes}
        self._place()
        self._outputs()
        if split_w:
            self._split_w()
        self._edges()

    # -- placing every node ------------------------------------------------------------------
    def piece(self, stage: int, phase: str) -> Piece:
        if (stage, phase) not in self.pieces:
            self.pieces[(stage, phase)] = Piece(stage, phase)
        return self.pieces[(stage, phase)]

    def _step(self, n: fx.Node):
        return n.meta.get("sw_step")

    def _on_mb(self, n: fx.Node) -> bool:
        st = self._step(n)
        return st is not None and st.mesh_dim == self.mb_dim and st.is_collective

    def _place(self) -> None:
        pro = self._prologue_nodes()
        for n in self.program.graph.nodes:
            if n.op in ("placeholder", "get_attr", "output") or n.meta.get(ORIGIN) == ORIGIN_OUTPUT:
                continue
            if n in pro:
                self.prologue.append(n)
                continue
            if CAST_OF in n.meta:  # a master's compute copy (mixed precision): made once per step
                self.casts.append(n)
                continue
            origin = n.meta[ORIGIN]
            phase = "B" if self._graph_nodes[origin].meta.get("autograd_backward") else "F"
            p = self.piece(self.stages.of[origin], phase)
            p.nodes.append(n)
            self.where[n] = p

    def _prologue_nodes(self) -> set:
        """Collectives on the microbatch dim and everything they read: to run before the pipeline.
        They may read the inputs and targets only (MicrobatchError otherwise)."""
        out: set = set()
        for n in self.program.graph.nodes:
            if not self._on_mb(n) or n.meta.get(ORIGIN) == ORIGIN_OUTPUT:
                continue
            if self._step(n).kind not in PROLOGUE_KINDS:
                self._refuse(n, f"a {self._step(n).kind} over the microbatches")
            stack = [n]
            while stack:
                x = stack.pop()
                if x in out:
                    continue
                if x.op == "placeholder":
                    if self.roles[x.name].kind not in (INPUT, TARGET):
                        self._refuse(n, f"the {self._step(n).kind} of a value computed from "
                                        f"{self.roles[x.name].kind} '{self.roles[x.name].name}'")
                    continue
                if x.op == "get_attr":
                    continue
                out.add(x)
                stack.extend(x.all_input_nodes)
        return out

    def _refuse(self, n: fx.Node, what: str):
        origin = n.meta.get(ORIGIN)
        g = self._graph_nodes.get(origin)
        op = g.target if g is not None else origin
        raise MicrobatchError(
            f"node '{origin}' ({op}) needs {what}: a value of the whole batch that a pipeline, running the batch in "
            "microbatches one after another, cannot form before this op runs", op=op, node=origin,
            fix="make the op's result a sum over the batch (a sum, or a mean by a count of the batch's inputs or "
                "targets), put it outside the model, or train without pipeline=")

    # -- outputs ---------------------------------------------------------------------------------
    def _outputs(self) -> None:
        (out,) = self.program.graph.find_nodes(op="output")
        finals = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        for i, x in enumerate(finals):
            if not isinstance(x, fx.Node):
                continue
            chain, y = [], x
            while y.meta.get(ORIGIN) == ORIGIN_OUTPUT and y.op == "call_function":
                chain.append(y)
                y = y.args[0]
            first = False
            for c in chain:
                if self._step(c) is not None and self._step(c).mesh_dim == self.mb_dim:
                    if self._step(c).kind != "partial_local":
                        self._refuse(c, f"a {self._step(c).kind} of the output over the microbatches")
                    first = True
            if y.op == "placeholder" or y in self.prologue:
                raise ShardingError(f"pipeline: graph output {i} is '{y.name}', not computed by a stage",
                                    fix="report this: a traced step's outputs are its loss and gradients")
            stage = self.where[y].stage
            e = self.piece(stage, "E")
            for c in reversed(chain):
                if c not in e.nodes:
                    e.nodes.append(c)
                    self.where[c] = e
                    if self._step(c) is not None and self._step(c).mesh_dim == self.mb_dim:
                        e.skip.add(c)
            e.read(y)
            e.give(x)
            self.outputs.append(Output(i, y.name, x.name, stage, first))

    # -- zero bubble: the backward's input-gradient part, then the rest ----------------------------------
    def _split_w(self) -> None:
        for (stage, phase), b in list(self.pieces.items()):
            if phase != "B":
                continue
            keep: set = set()
            stack = [n for n in b.nodes if any(self.where.get(u) is not None and self.where[u].stage != stage
                                                for u in n.users)]
            while stack:
                x = stack.pop()
                if x in keep or self.where.get(x) is not b:
                    continue
                keep.add(x)
                stack.extend(x.all_input_nodes)
            w = self.piece(stage, "W")
            b.nodes, w.nodes = [n for n in b.nodes if n in keep], [n for n in b.nodes if n not in keep]
            for n in w.nodes:
                self.where[n] = w

    # -- what crosses pieces -----------------------------------------------------------------------
    def _edges(self) -> None:
        for o in self.outputs:
            self.where[self.nodes[o.value]].give(self.nodes[o.value])
        sent: dict = {}  # (value, dst stage) -> Message
        for p in sorted(self.pieces.values(), key=lambda p: (p.stage, ORDER[p.phase])):
            for n in p.nodes:
                for u in n.all_input_nodes:
                    self._edge(p, n, u, sent)
        ordered = sorted(sent.values(), key=lambda m: (m.src, m.dst, m.value))
        self.messages = [Message(m.value, m.src, m.dst, m.phase, k) for k, m in enumerate(ordered)]

    def _edge(self, p: Piece, n: fx.Node, u: fx.Node, sent: dict) -> None:
        if u.op == "get_attr" or self.where.get(u) is p:
            return
        if p.phase == "E" and u.name in {o.value for o in self.outputs}:
            return  # the summed output, read by E already
        if u.op == "placeholder":
            p.read(u)
            role = self.roles[u.name]
            if role.kind in (PARAM, BUFFER) and self.stages.of[u.name] != p.stage:
                if not any(m.value == u.name and m.dst == p.stage for m in self.step_messages):
                    self.step_messages.append(Message(u.name, self.stages.of[u.name], p.stage, "F",
                                                      len(self.step_messages)))
            return
        if u in self.prologue:
            p.read(u)
            return
        if CAST_OF in u.meta:  # a compute copy: its owner's, sent once per step to another stage reading it
            p.read(u)
            owner = self.stages.of[u.meta[CAST_OF]]
            if owner != p.stage and not any(m.value == u.name and m.dst == p.stage for m in self.step_messages):
                self.step_messages.append(Message(u.name, owner, p.stage, "F", len(self.step_messages)))
            return
        src = self.where[u]
        if src.stage == p.stage:
            if ORDER[src.phase] > ORDER[p.phase]:
                raise ShardingError(f"pipeline: '{n.name}' ({p.phase} of stage {p.stage}) reads '{u.name}', made later "
                                    f"in {src.phase}", fix="report this: the cut of the step into stages is wrong")
            src.give(u)
            p.read(u)
            return
        self._check_direction(src, p, u, n)
        src.give(u)
        p.read(u)
        key = (u.name, p.stage)
        if key not in sent or ORDER[p.phase] < ORDER[sent[key].phase]:
            sent[key] = Message(u.name, src.stage, p.stage, p.phase, -1)

    def _check_direction(self, src: Piece, dst: Piece, u: fx.Node, n: fx.Node) -> None:
        ok = {("F", "F"): src.stage < dst.stage, ("B", "B"): src.stage > dst.stage,
              ("B", "W"): src.stage > dst.stage}.get((src.phase, dst.phase), src.phase == "F")
        if not ok or dst.phase == "E":
            raise ShardingError(f"pipeline: '{n.name}' ({dst.phase} of stage {dst.stage}) reads '{u.name}' from "
                                f"{src.phase} of stage {src.stage}, which the schedule does not run before it",
                                fix="choose split points at block boundaries, or split_points=None")

    # -- what the runner asks ---------------------------------------------------------------------------
    def layout_of(self, value: str):
        """The planned Layout of program value ``value`` (shape and dtype of a message)."""
        n = self.nodes[value]
        st = self._step(n)
        if st is not None:
            return st.dst
        if CAST_OF in n.meta:  # a master's compute copy: its parameter's planned layout
            return self.layouts[n.meta[CAST_OF]][0]
        origin = n.meta.get(ORIGIN) if n.op != "placeholder" else n.name
        return self.layouts[origin][0]

    def piece_order(self, stage: int) -> list:
        return sorted((p for p in self.pieces.values() if p.stage == stage), key=lambda p: ORDER[p.phase])

    def random_pieces(self) -> set:
        """(stage, phase) of the pieces that draw random numbers."""
        return {(p.stage, p.phase) for p in self.pieces.values() for n in p.nodes
                if self._step(n) is None and _seeded(self._graph_nodes.get(n.meta.get(ORIGIN)))}


PROLOGUE_KINDS = ("all_reduce", "all_gather")


def _seeded(g) -> bool:
    return (g is not None and isinstance(g.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in g.target.tags)


__all__ = ["ORDER", "PROLOGUE_KINDS", "Message", "MicrobatchCut", "Output", "Piece"]
