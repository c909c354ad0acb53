"""A random program as Python source: an nn.Module, its data, a mesh and placements.

The fuzzer's one artifact is source text. The test execs it and compares the sharded run
with one device; a failure prints the very same text (plus the comparison function) as a
standalone reproducer, so what a developer pastes is exactly what failed.

``Builder`` holds the values computed so far (name, global shape, whether equal elements may
occur) and writes one line of ``forward`` per op; ``ops.py`` holds the op catalogue.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MESH_NAMES = ("a", "b", "c")


@dataclass
class Val:
    """One tensor of the program. ``tied``: equal elements may occur (relu zeros, expanded
    copies, repeated embedding rows): sort/topk/amax then pick an index or split a gradient
    in a way that float noise decides, so those ops only take untied values."""

    name: str
    shape: tuple
    tied: bool = False
    index: bool = False  # integer indices (embedding input), not a float value

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass
class Tensor:
    """A parameter, buffer, input or target: its source expression and its placements."""

    name: str
    shape: tuple
    init: str  # expression building it (uses generator g)
    placements: list = field(default_factory=list)  # one per mesh dim, as source; [] = not given


class Builder:
    """Collects inputs, parameters and forward lines; ``source()`` renders the program."""

    def __init__(self, c, mesh_shape: tuple, seed: int):
        self.c, self.mesh_shape, self.seed = c, tuple(mesh_shape), seed
        self.inputs: list[Tensor] = []
        self.params: list[Tensor] = []
        self.buffers: list[Tensor] = []
        self.targets: list[Tensor] = []
        self.vals: list[Val] = []
        self.used: set[str] = set()
        self.lines: list[str] = []
        self.returns = ""
        self.loss_src = "loss_fn = None"
        self.counter = 0
        # the default cost model gathers almost everything at toy sizes (latency dominates);
        # latency-free links, and slow compute on top, make the planners keep shards
        self.cost_model = c.choice(("None", "sw.CostModel(latency=0.0)", "sw.CostModel(latency=0.0, flops=1e6)"))

    # -- names and tensors --------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def placements(self, shape: tuple) -> list:
        """Random valid placements: per mesh dim Replicate or Shard of any tensor dim."""
        out = []
        for _ in self.mesh_shape:
            d = self.c.int(-1, len(shape) - 1) if shape else -1
            out.append("Replicate()" if d < 0 else f"Shard({d})")
        return out

    def placed(self, t: Tensor, kind: list) -> Tensor:
        if self.c.coin(0.7):
            t.placements = self.placements(t.shape)
        kind.append(t)
        return t

    def param(self, shape: tuple, scale: float = 0.5, shift: float = 0.0) -> str:
        """A new parameter, or sometimes one of the same shape used again (shared weights:
        gradients from two uses add up)."""
        same = [t for t in self.params if t.shape == tuple(shape)]
        if same and self.c.coin(0.2):
            return f"self.{self.c.choice(same).name}"
        init = f"{self.randn(shape)} * {scale}" + (f" + {shift}" if shift else "")
        t = self.placed(Tensor(self.fresh("p"), tuple(shape), init), self.params)
        return f"self.{t.name}"

    def randn(self, shape: tuple) -> str:
        """A random tensor expression, sometimes a transposed (non-contiguous) one."""
        if len(shape) >= 2 and self.c.coin(0.2):
            return f"torch.randn({_tup(shape[::-1])}, generator=g).permute({', '.join(map(str, range(len(shape) - 1, -1, -1)))})"
        return f"torch.randn({_tup(shape)}, generator=g)"

    def buffer(self, shape: tuple) -> str:
        t = self.placed(Tensor(self.fresh("w"), tuple(shape), f"torch.randn({_tup(shape)}, generator=g)"), self.buffers)
        return f"self.{t.name}"

    def input(self, shape: tuple, init: str | None = None, index: bool = False) -> Val:
        name = self.fresh("x")
        self.placed(Tensor(name, tuple(shape), init or self.randn(shape)), self.inputs)
        v = Val(name, tuple(shape), index, index)
        self.vals.append(v)
        return v

    def target(self, shape: tuple, init: str) -> str:
        t = self.placed(Tensor(self.fresh("y"), tuple(shape), init), self.targets)
        return t.name

    # -- values -------------------------------------------------------------------------
    def pick(self, ok=lambda v: True) -> Val | None:
        """A value accepted by ``ok``, recent ones likelier (chains more than fans); shrinks to the latest."""
        cands = [v for v in reversed(self.vals) if not v.index and ok(v)]
        if not cands:
            return None
        return cands[min(self.c.int(0, len(cands) - 1), self.c.int(0, len(cands) - 1))]

    def emit(self, expr: str, shape: tuple, tied: bool, *args: Val) -> Val:
        v = Val(self.fresh("v"), tuple(shape), tied or any(a.tied for a in args))
        self.used.update(a.name for a in args)
        self.lines.append(f"{v.name} = {expr}")
        self.vals.append(v)
        return v

    def emit_many(self, expr: str, shapes: list, tied: bool, *args: Val) -> list[Val]:
        vs = [Val(self.fresh("v"), tuple(s), tied or any(a.tied for a in args)) for s in shapes]
        self.used.update(a.name for a in args)
        self.lines.append(f"{', '.join(v.name for v in vs)} = {expr}")
        self.vals.extend(vs)
        return vs

    def sinks(self) -> list[Val]:
        """Values nothing consumed: every one feeds the loss, so no computation is dead."""
        return [v for v in self.vals if v.name not in self.used and not v.index]

    # -- rendering ----------------------------------------------------------------------
    def source(self) -> str:
        init = [f"        self.{p.name} = torch.nn.Parameter({p.init})" for p in self.params]
        init += [f'        self.register_buffer("{b.name}", {b.init})' for b in self.buffers]
        body = [f"        {line}" for line in self.lines] + [f"        return {self.returns}"]
        data = [f"    {t.name} = {t.init}" for t in self.inputs + self.targets]
        mesh_names = MESH_NAMES[: len(self.mesh_shape)]
        return "\n".join([
            "import torch",
            "import torch.nn.functional as F",
            "",
            "import shardwise as sw",
            "from shardwise import Replicate, Shard",
            "",
            "",
            "class Program(torch.nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            f"        g = torch.Generator().manual_seed({self.seed})",
            *init,
            "",
            f"    def forward(self, {', '.join(t.name for t in self.inputs)}):",
            *body,
            "",
            "",
            self.loss_src,
            "",
            "",
            "def make_data():",
            f"    g = torch.Generator().manual_seed({self.seed + 1})",
            *data,
            f"    return {_tup([t.name for t in self.inputs])}, {_tup([t.name for t in self.targets])}",
            "",
            "",
            f"MESH = sw.Mesh({_tup(self.mesh_shape)}, {_tup(tuple(repr(n) for n in mesh_names))})",
            f"INPUT_PLACEMENTS = {_spec(self.inputs, index=True)}",
            f"PARAM_PLACEMENTS = {_spec(self.params + self.buffers)}",
            f"TARGET_PLACEMENTS = {_spec(self.targets, index=True)}",
            f"COST_MODEL = {self.cost_model}",
            "",
        ])


def _tup(xs) -> str:
    """A Python tuple literal."""
    xs = [str(x) for x in xs]
    return f"({xs[0]},)" if len(xs) == 1 else f"({', '.join(xs)})"


def _spec(tensors: list[Tensor], index: bool = False) -> str:
    items = [f"{i if index else repr(t.name)}: [{', '.join(t.placements)}]"
             for i, t in enumerate(tensors) if t.placements]
    return "{" + ", ".join(items) + "}"
