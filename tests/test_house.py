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
                  "UnsupportedOpError", "rule", "recipes", "CostModel"}  # DESIGN.md's Public API and the README
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


TOOLS = {"verify", "report", "demo", "cli", "cli_plan", "cli_progress", "tools"}  # beside the pipeline


def test_no_pipeline_room_imports_a_tool_room():
    """trace, rules, plan, lower, runtime and the op packages never import the tools (tools/verify/, tools/report/,
    tools/demo/, the command line, tools/: bench): the tools sit beside the pipeline (docs/architecture.md)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
    bad = []
    for room in ("trace", "rules", "plan", "lower", "runtime", "attention", "moe"):
        for path in sorted((root / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.level not in (0, 2):
                    continue
                module = (node.module or "").removeprefix("shardwise.") if node.level == 0 else node.module
                if node.level == 0 and not (node.module or "").startswith("shardwise"):
                    continue
                names = [module.split(".")[0]] if module else [a.name for a in node.names]
                bad += [f"{path.relative_to(root)}: imports {n}" for n in names if n in TOOLS]
    assert not bad, bad


def _imported_rooms(path, package_depth: int) -> set:
    """The top-level shardwise modules/packages ``path`` imports (any depth of the AST, lazy imports
    included); ``package_depth``: how many dots lead from the file to the shardwise package."""
    import ast

    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            rooms |= {a.name.split(".")[1] for a in node.names if a.name.startswith("shardwise.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").startswith("shardwise"):
                parts = node.module.split(".")[1:]
            elif node.level == package_depth:
                parts = (node.module or "").split(".") if node.module else []
            else:
                continue
            rooms |= {parts[0]} if parts and parts[0] else {a.name for a in node.names}
    return rooms


def test_no_rule_module_imports_the_runtime(tmp_path):
    """Rules whose local calls communicate or draw random numbers read the running rank's scope
    (shardwise/core/scope.py, below rules/ and run/, filled by the runtime's backends); no arrow
    runs from rules/ up to run/. A probe proves the check sees every import form."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
    bad = [str(p.relative_to(root)) for p in sorted((root / "rules").rglob("*.py"))
           if "runtime" in _imported_rooms(p, 2)]
    assert not bad, bad
    probe = tmp_path / "probe.py"
    for text in ("from ..runtime import collectives", "from ..runtime.collectives import current",
                 "from .. import runtime", "import shardwise.run.threads", "from shardwise.run import x",
                 "def f():\n    from ..runtime import y"):
        probe.write_text(text + "\n")
        assert "runtime" in _imported_rooms(probe, 2), text
    scoped = {p.stem for p in (root / "rules").glob("*.py") if "scope" in _imported_rooms(p, 2)}
    assert {"halo", "loss", "norm_batch", "random"} <= scoped, scoped


def test_runtime_and_lower_import_nothing_above_them(tmp_path):
    """run/ keeps the collectives, the two backends and launching: the plan runner
    (shardwise/run/execute.py) hands it ready programs, so it imports no plan, lowering, api module or
    the runner; lower/ takes the running rank's collectives from core/scope.py, never from run/."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
    above_runtime = {"api", "api_layout", "api_inputs", "api_grads", "spec", "execute", "plan", "lower", "trace",
                     "rules"}
    bad = [f"{p.relative_to(root)}: {sorted(_imported_rooms(p, 2) & above_runtime)}"
           for p in sorted((root / "runtime").rglob("*.py")) if _imported_rooms(p, 2) & above_runtime]
    bad += [f"{p.relative_to(root)}: runtime" for p in sorted((root / "lower").rglob("*.py"))
            if "runtime" in _imported_rooms(p, 2)]
    assert not bad, bad
    probe = tmp_path / "probe.py"
    for text, room in (("from ..api_layout import collect", "api_layout"), ("from .. import execute", "execute"),
                       ("def f():\n    from ..lower.plan import Plan", "lower")):
        probe.write_text(text + "\n")
        assert room in _imported_rooms(probe, 2) & above_runtime, text


# room -> the rooms it must not import: those later in the pipeline (trace -> rules -> plan -> lower ->
# execute): each room imports only rooms to its left (docs/architecture.md); the modules below them all
# import only each other.
LATER = {"trace": {"rules", "plan", "lower", "execute"}, "rules": {"plan", "lower", "execute"},
         "plan": {"lower", "execute"}, "lower": {"execute"}}
BELOW = {"mesh", "layout", "errors", "kinds", "scope", "cost", "calls"}


def _arrows_back_up(root) -> list:
    """Each import in ``root`` (a shardwise tree) that runs back up the pipeline or out of BELOW."""
    bad = [f"{p.relative_to(root)}: {sorted(_imported_rooms(p, 2) & later)}" for room, later in LATER.items()
           for p in sorted((root / room).rglob("*.py")) if _imported_rooms(p, 2) & later]
    return bad + [f"{m}.py: {sorted(_imported_rooms(root / f'{m}.py', 1) - BELOW)}"
                  for m in sorted(BELOW) if _imported_rooms(root / f"{m}.py", 1) - BELOW]


def test_no_arrow_runs_back_up_the_pipeline(tmp_path):
    """trace/ imports no rules/ (it builds calls.OpCall), rules/ neither search/ nor lower/ (a rule's
    comm steps are kinds.RedistStep priced by core/cost.py), search/ no lower/ (planning a redistribution
    and a move's identity are search/paths.py's; the Plan, which offers each rank's program, is
    lower/'s), lower/ no run/execute.py, and the modules below the pipeline import only each other. A
    probe tree with one arrow back up of each kind proves the check fails."""
    import pathlib
    import shutil

    root = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
    assert not _arrows_back_up(root), _arrows_back_up(root)
    probe = tmp_path / "shardwise"
    for room in LATER:
        (probe / room).mkdir(parents=True)
    for m in BELOW:
        shutil.copy(root / f"{m}.py", probe / f"{m}.py")
    (probe / "trace" / "normalize.py").write_text("from ..rules.registry import OpCall\n")
    (probe / "rules" / "halo.py").write_text("from ..lower.redistribute import RedistStep\n")
    (probe / "plan" / "propagate.py").write_text("def f():\n    from ..lower.paths import plan_redistribute\n")
    (probe / "lower" / "program.py").write_text("from .. import execute\n")
    (probe / "core/cost.py").write_text("from .plan.flops import flops\n")
    assert sorted(_arrows_back_up(probe)) == ["core/cost.py: ['plan']", "lower/program.py: ['execute']",
                                              "search/propagate.py: ['lower']", "rules/halo.py: ['lower']",
                                              "trace/normalize.py: ['rules']"]


def _rooms(root) -> dict:
    """{room: the other rooms it imports} for each package and module of ``root`` (a shardwise tree)."""
    rooms = {}
    for p in root.iterdir():
        if p.is_dir() and (p / "__init__.py").exists():
            rooms[p.name] = set().union(*(_imported_rooms(f, 2) for f in p.rglob("*.py")))
        elif p.suffix == ".py" and p.stem != "__init__":
            rooms[p.stem] = _imported_rooms(p, 1)
    return {room: imported - {room} for room, imported in rooms.items()}


def _on_circles(rooms: dict) -> list:
    """The rooms that reach themselves through the rooms they import."""
    def reach(start) -> set:
        seen, todo = set(), list(rooms.get(start, ()))
        while todo:
            room = todo.pop()
            if room not in seen:
                seen.add(room)
                todo += rooms.get(room, ())
        return seen

    return sorted(room for room in rooms if room in reach(room))


def test_no_import_circle_among_the_rooms(tmp_path):
    """No room of the house (a package or module of shardwise, the tools beside the pipeline too:
    the command line's errors live in core/errors.py, so cli_plan imports nothing from cli) reaches
    itself through its imports, lazy ones included. A probe tree whose search/ imports lower/ as
    lower/ imports search/ proves the check sees a circle."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
    rooms = _rooms(root)
    assert {"trace", "rules", "plan", "lower", "execute", "runtime", "api", "cli", "cli_plan"} <= set(rooms)
    assert not _on_circles(rooms), _on_circles(rooms)
    probe = tmp_path / "shardwise"
    for room in ("plan", "lower", "trace"):
        (probe / room).mkdir(parents=True)
        (probe / room / "__init__.py").write_text("")
    (probe / "plan" / "ilp.py").write_text("def f():\n    from ..lower.program import move_key\n")
    (probe / "lower" / "program.py").write_text("from ..plan.paths import move_key\nfrom ..trace import x\n")
    (probe / "core/mesh.py").write_text("from . import errors\n")
    assert _on_circles(_rooms(probe)) == ["lower", "plan"]
