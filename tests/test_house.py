"""The package surface: a frozen, hashable Mesh; one Replicate constant; parallelize's keywords
visible to help(); ``__all__`` naming the documented API."""
from __future__ import annotations

import pickle

import pytest

from shardwise.core.mesh import Mesh


def test_mesh_is_frozen_and_hashable():
    """Plans and lru_caches are keyed by a Mesh: changing one in place would leave stale entries."""
    mesh = Mesh((2, 3), ("dp", "tp"))
    for mutate in (lambda: setattr(mesh, "shape", (6,)), lambda: setattr(mesh, "names", ("a", "b")),
                   lambda: delattr(mesh, "shape"), lambda: setattr(mesh, "extra", 1)):
        with pytest.raises(AttributeError, match="frozen"):
            mutate()
    assert mesh.shape == (2, 3) and mesh.names == ("dp", "tp")
    twin = Mesh((2, 3), ("dp", "tp"))
    assert {mesh: 1}[twin] == 1 and hash(mesh) == hash(twin)
    assert pickle.loads(pickle.dumps(mesh)) == mesh and mesh.groups("tp") == ((0, 1, 2), (3, 4, 5))
    assert Mesh((2, 3)) != mesh  # the names are part of the key


def test_parallelize_lists_its_keywords():
    """help(sw.parallelize) and editors see every keyword, with ParallelModule's defaults."""
    import inspect
    import pydoc

    import shardwise as sw

    fn, cls = inspect.signature(sw.parallelize), inspect.signature(sw.ParallelModule.__init__)
    assert [p for p in fn.parameters.values()] == [p for n, p in cls.parameters.items() if n != "self"]
    text = pydoc.render_doc(sw.parallelize)
    for name, p in fn.parameters.items():
        assert name in text
        if p.kind is p.KEYWORD_ONLY:
            assert f"{name}=" in text, name
    assert not any(p.kind is p.VAR_KEYWORD for p in fn.parameters.values())


def test_all_names_the_documented_api():
    import shardwise as sw

    assert all(hasattr(sw, n) for n in sw.__all__) and len(set(sw.__all__)) == len(sw.__all__)
    documented = {"Mesh", "parallelize", "Shard", "Replicate", "Partial", "Layout", "distribute", "collect",
                  "redistribute", "plan_redistribute", "registered_ops", "verify_rule", "attention", "ShardingError",
                  "UnsupportedOpError", "rule", "recipes", "CostModel"}  # the public API (README, docs/guide.md)
    assert documented <= set(sw.__all__), documented - set(sw.__all__)
    ns: dict = {}
    exec("from shardwise import *", ns)
    assert set(sw.__all__) <= set(ns)


def test_errors_a_user_can_land_on_are_typed_with_a_fix(monkeypatch):
    """The attention op's checks, settings, launching, collective options, checkpoint chunks and
    rebuilding traced outputs raise ShardingError subclasses with a fix (still ValueError / TypeError
    for callers that catch those)."""
    import torch

    import shardwise as sw
    from shardwise.core.errors import ConfigTypeError
    from shardwise.run.collectives import TIMEOUT_ENV, default_timeout, reduce_list
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from shardwise.module.checkpoint import ShardChunks
    from shardwise.run.launch import run_script, spawn
    from shardwise.core.scope import current
    from shardwise.trace.roles import flatten

    from shardwise.search.propagate import Planner
    from shardwise.rules import DEFAULT, load_all
    from shardwise.trace import trace_step

    load_all()
    step = trace_step(torch.nn.Linear(3, 2), (torch.randn(4, 3),), loss_fn=lambda o: o.sum())
    ph = {n.name: [sw.Replicate()] for n in step.placeholder_nodes()}
    q = torch.randn(2, 4, 5, 8)
    chunks = ShardChunks((8,), torch.float32, [((0,), torch.zeros(4))], 1)
    cases = [(lambda: sw.attention(q, q[:, :3], q[:, :3]), sw.AttentionError, "enable_gqa"),
             (lambda: sw.attention(q, q, q, torch.ones(3, 5, dtype=torch.bool)), sw.AttentionError, "broadcast"),
             (lambda: sw.attention(q, q.double(), q), sw.AttentionError, "floating dtype"),
             (lambda: sw.AttentionSettings(is_causal=True, q_offset=3).check_blocks(5, 5), sw.AttentionError,
              "q_len_global"),
             (lambda: sw.AttentionSettings(is_causal=1), ConfigTypeError, "must be a bool"),
             (lambda: spawn(print, 0), sw.ConfigError, "nproc >= 1"),
             (lambda: run_script(__file__, 2, timeout=-1), sw.ConfigError, "positive number of seconds"),
             (lambda: reduce_list([q, q], "median"), sw.ConfigError, "unknown reduce op"),
             (lambda: chunks.sum(), ConfigTypeError, "only carries shards"),
             (lambda: chunks.__get_tensor_shard__(MetadataIndex("w", (4,))), sw.ShardingError, "no chunk at offset"),
             (lambda: flatten((q, 1)).rebuild([q, q]), sw.ShardingError, "expected 1 tensors"),
             (lambda: current(), sw.ConfigError, "no shardwise collectives are active"),
             (lambda: Planner(sw.Mesh((2,)), DEFAULT).run(step.gm, ph, [None]), sw.ConfigError, "3 outputs but 1")]
    for call, kind, words in cases:
        with pytest.raises(kind, match=words) as e:
            call()
        assert isinstance(e.value, sw.ShardingError) and isinstance(e.value, ValueError) and e.value.fix, words
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(sw.ConfigError, match=TIMEOUT_ENV):
        default_timeout()
    assert issubclass(ConfigTypeError, TypeError)


# The rooms of the house in pipeline order (docs/architecture.md): a module imports only modules of
# its own room or of rooms before it; shardwise/__init__.py, the public facade, re-exports from any
# room, and the tools and the command line may use it as any user does.
ROOMS = ("core", "ops", "trace", "rules", "search", "lower", "run", "module", "tools", "cli")


def import_graph(root) -> dict:
    """{module: the shardwise modules it imports} for every module under ``root`` (a shardwise tree),
    lazy imports and TYPE_CHECKING ones included; ``from pkg import name`` is an import of the
    module ``pkg.name`` where that is a module, else of ``pkg`` (its __init__)."""
    import ast
    import pathlib

    root = pathlib.Path(root)

    def name_of(p):
        parts = list(p.with_suffix("").relative_to(root.parent).parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(p): p for p in root.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.split(".")[0] == root.name}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != root.name:
                    continue
                out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names}
        graph[mod] = out - {mod}
    return graph


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package facade (shardwise/__init__.py)


def arrows_back_up(root) -> list:
    """Each import that runs from a room to a later room (or to no room at all)."""
    bad = []
    for mod, targets in import_graph(root).items():
        room = _room(mod)
        if room is None:
            continue
        for t in sorted(targets):
            there = _room(t)
            if there is None and ROOMS.index(room) >= ROOMS.index("tools"):
                continue  # the tools and the command line use the public API (import shardwise as sw)
            if there not in ROOMS or ROOMS.index(there) > ROOMS.index(room):
                bad.append(f"{mod} -> {t}")
    return sorted(bad)


def circles(root) -> list:
    """The modules that reach themselves through their imports, one sorted list per circle."""
    graph = import_graph(root)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _package_root():
    import pathlib

    return pathlib.Path(__file__).resolve().parent.parent / "shardwise"


def test_every_module_lives_in_a_room():
    """The tree is the drawing: every package and module of shardwise is one of the rooms."""
    loose = sorted(p.name for p in _package_root().iterdir()
                   if p.name not in ROOMS and p.name not in ("__init__.py", "__pycache__"))
    assert not loose, loose


def _probe_tree(tmp_path, files: dict):
    root = tmp_path / "shardwise"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in path.relative_to(root).parents:
            (root / d / "__init__.py").touch()
        path.write_text(text)
    return root


def test_no_arrow_runs_back_up_the_pipeline(tmp_path):
    """core < ops < trace < rules < search < lower < run < module < tools < cli: nothing imports a later
    room (so no rule module reaches the runtime, lower/ never imports run/, and no pipeline room
    imports a tool). A probe tree with one arrow back up of each import form proves the check fails."""
    assert not arrows_back_up(_package_root()), arrows_back_up(_package_root())
    probe = _probe_tree(tmp_path, {
        "core/mesh.py": "from ..search import paths\n",
        "rules/halo.py": "def f():\n    from ..run.collectives import current\n",
        "rules/loss.py": "import shardwise.run.threads\n",
        "search/paths.py": "from ..core import mesh\n",
        "lower/program.py": "from .. import run\n",
        "run/threads.py": "", "run/collectives.py": "from ..core.mesh import Mesh\n",
        "module/api.py": "from ..tools.report import html\n", "tools/report/html.py": "",
    })
    assert arrows_back_up(probe) == ["shardwise.core.mesh -> shardwise.search.paths",
                                     "shardwise.lower.program -> shardwise.run",
                                     "shardwise.module.api -> shardwise.tools.report.html",
                                     "shardwise.rules.halo -> shardwise.run.collectives",
                                     "shardwise.rules.loss -> shardwise.run.threads"]


def test_no_rule_module_reaches_the_runtime():
    """Rules whose local calls communicate or draw random numbers read the running rank's scope
    (core/scope.py, filled by the backends): nothing a rule module imports, however indirectly,
    is run/."""
    graph = import_graph(_package_root())
    bad = []
    for mod in (m for m in graph if _room(m) == "rules"):
        seen, todo = set(), [mod]
        while todo:
            for t in graph.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        bad += [f"{mod} -> {t}" for t in sorted(seen) if _room(t) == "run"]
    assert not bad, bad
    scoped = {m.rsplit(".", 1)[1] for m in graph if _room(m) == "rules" and "shardwise.core.scope" in graph[m]}
    assert {"halo", "loss", "norm_batch", "random"} <= scoped, scoped


def test_no_import_circle(tmp_path):
    """No module reaches itself through its imports (lazy ones included), inside a room or across
    rooms. A probe tree with a two-module circle and a circle through a package's __init__ proves
    the check sees them."""
    assert not circles(_package_root()), circles(_package_root())
    probe = _probe_tree(tmp_path, {
        "lower/buckets.py": "def f():\n    from .program import shape_guard\n",
        "lower/program.py": "from .buckets import bucket_program\n",
        "rules/__init__.py": "from .registry import Rule\n",
        "rules/registry.py": "def f():\n    from . import load_all\n",
    })
    assert circles(probe) == [["shardwise.lower.buckets", "shardwise.lower.program"],
                              ["shardwise.rules", "shardwise.rules.registry"]]


def bolted_state(root) -> list:
    """Writes of ``__dict__`` entries, attributes set on a Plan outside lower/plan.py, and undeclared
    attributes set on a Propagation, under ``root`` (a shardwise tree)."""
    import ast
    import dataclasses

    from shardwise.search.propagate import Propagation

    fields = {f.name for f in dataclasses.fields(Propagation)}
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "__dict__" and isinstance(node.ctx, ast.Store):
                bad.append(f"{rel}:{node.lineno}: writes __dict__[...]")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "setdefault" and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "__dict__":
                bad.append(f"{rel}:{node.lineno}: __dict__.setdefault")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = ast.unparse(t.value)
                if owner.split(".")[-1] == "plan" and rel != "lower/plan.py":
                    bad.append(f"{rel}:{node.lineno}: sets {owner}.{t.attr} on a Plan")
                if owner.split(".")[-1] in ("prop", "best", "greedy") and t.attr not in fields:
                    bad.append(f"{rel}:{node.lineno}: sets undeclared {owner}.{t.attr} on a Propagation")
    return sorted(bad)


def test_no_state_bolted_onto_plans(tmp_path):
    """What running a Plan needs beyond it is declared on run/execute.Executable, and a Plan's own
    caches in lower/plan.py: nothing writes ``__dict__`` entries, no module but lower/plan.py sets
    an attribute on a Plan, and attributes set on a Propagation are its declared fields. A probe
    tree with one of each proves the check fails."""
    assert not bolted_state(_package_root()), bolted_state(_package_root())
    probe = _probe_tree(tmp_path, {
        "run/execute.py": "def f(plan):\n    plan.__dict__.setdefault('_x', {})\n    plan.inputs_checked = True\n",
        "lower/memory.py": "def g(plan):\n    plan.__dict__['_m'] = 1\n",
        "search/propagate.py": "def h(prop):\n    prop.costs = 1\n    prop.solve_report = 2\n",
    })
    assert bolted_state(probe) == ["lower/memory.py:2: writes __dict__[...]", "run/execute.py:2: __dict__.setdefault",
                                   "run/execute.py:3: sets plan.inputs_checked on a Plan",
                                   "search/propagate.py:2: sets undeclared prop.costs on a Propagation"]
