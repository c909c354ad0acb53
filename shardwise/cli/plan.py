"""``shardwise plan TARGET``: plan a user's model without running it.

    shardwise plan mymodel.py:build --mesh 2x2 --names dp,tp --placements megatron
    shardwise plan mypkg.models:build --mesh 8 --json > plan.json
    shardwise plan model.py:make --mesh 2x4 --names dp,tp --html report.html

TARGET is ``module:factory`` or ``path.py:factory``. The factory is called with no arguments
(on the meta device unless ``--real``, so any size plans without memory: weights are never
allocated, tracing uses fake tensors) and returns the model and example inputs, as a tuple
``(model, example_inputs[, example_targets[, loss_fn]])`` or a dict / object with those names
and optionally ``input_placements`` and ``param_placements``.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import sys

from ..core.errors import CliError
from ..core.layout import Partial, Replicate, Shard

_FIELDS = ("model", "example_inputs", "example_targets", "loss_fn")

# `shardwise plan --help`'s examples: each runs outside the repository (tests/cli/test_plan_help.py runs them)
FACTORY_FILE = """import torch

def build():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    return model, (torch.randn(8, 64),), (torch.randn(8, 64),), torch.nn.functional.mse_loss
"""
EXAMPLES = ("shardwise plan mymodel.py:build --mesh 2x2 --names dp,tp",
            "shardwise plan mymodel.py:build --mesh 4 --placements fsdp --nodes",
            "shardwise plan llama3-8b --gpu h100 --gpus 64 --gpus-per-node 8 --seq 8192 --local-batch 2",
            "shardwise plan gpt2 --gpus 8")
HELP_EPILOG = ("examples (mymodel.py is a file you write: build() returns the model, example inputs, and "
               "optionally targets and a loss function):\n  " + "\n  ".join(EXAMPLES)
               + "\n\nmymodel.py, for instance:\n\n    " + FACTORY_FILE.replace("\n", "\n    ").rstrip()
               + "\n\na named model (llama3-8b, gpt2, ...) or --config config.json runs the cluster calculator.")


def load_factory(target: str):
    """``module:factory`` or ``path.py:factory`` -> the callable."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CliError(f"TARGET {target!r} is not module:factory or path.py:factory",
                       fix="e.g. shardwise plan mymodels.py:build (build() returns model, example inputs)")
    if where.endswith(".py") or os.sep in where:
        if not os.path.exists(where):
            raise CliError(f"no file {where!r}", fix="give the path to a .py file, relative to this directory")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.getcwd())
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise CliError(f"cannot import module {where!r}: {e}", fix="check the module name, or give path.py:factory") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        known = sorted(n for n, v in vars(module).items() if not n.startswith("_") and inspect.isfunction(v)
                       and getattr(v, "__module__", None) == module.__name__)[:12]
        raise CliError(f"{where} has no callable {name!r}", fix=f"one of: {', '.join(known)}")
    return fn


def unpack(made) -> dict:
    """The factory's result as {model, example_inputs, example_targets, loss_fn, input_placements, param_placements}."""
    if isinstance(made, dict):
        got = dict(made)
    elif hasattr(made, "model") and hasattr(made, "example_inputs"):
        got = {k: getattr(made, k) for k in _FIELDS + ("input_placements", "param_placements") if hasattr(made, k)}
    elif isinstance(made, (tuple, list)) and len(made) >= 2:
        got = dict(zip(_FIELDS, made))
    else:
        raise CliError(f"the factory returned a {type(made).__name__}",
                       fix="return (model, example_inputs[, example_targets[, loss_fn]]) or a dict with those keys")
    if "model" not in got or "example_inputs" not in got:
        raise CliError("the factory's result lacks model or example_inputs",
                       fix="return (model, example_inputs, ...) or {'model': ..., 'example_inputs': (...)}")
    inputs = got["example_inputs"]  # a dict: keyword inputs (model(**inputs), a Hugging Face batch)
    got["example_inputs"] = inputs if isinstance(inputs, dict) else (
        tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
    targets = got.get("example_targets")
    got["example_targets"] = None if targets is None else (tuple(targets) if isinstance(targets, (tuple, list))
                                                           else (targets,))
    return got


def build(target: str, real: bool) -> tuple[dict, str]:
    """Call the factory on the meta device (or for real); the note says which."""
    import torch

    fn = load_factory(target)
    if real:
        return unpack(fn()), "built for real (--real)"
    try:
        with torch.device("meta"):
            return unpack(fn()), "weights on the meta device, traced with fake tensors (nothing allocated)"
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - some factories need real tensors; said, not hidden
        return unpack(fn()), f"built for real: on the meta device the factory failed ({type(e).__name__}: {e})"


_PLACEMENT = re.compile(r"^\s*(?:(?:sw|shardwise)\.)?(S|Shard|R|Replicate|P|Partial)\s*(\((.*)\))?\s*$")


def parse_placement(text):
    """The one reader of a placement written as text (--inputs, --placements files): the short
    forms 'S(0)', 'S(0, unit=4)', 'R', 'P', 'P(max)' and Python's spelling 'Shard(0)',
    'Shard(dim=1, groups=3)', 'Replicate()', 'Partial()', 'Partial("sum")', 'Partial(op="max")',
    with or without a 'sw.' prefix."""
    if not isinstance(text, str):
        raise CliError(f"a placement must be a string like 'S(0)' or 'R', got {text!r}", fix="write 'S(0)', 'R' or 'P'")
    m = _PLACEMENT.match(text)
    if not m:
        raise CliError(f"cannot read placement {text!r}",
                       fix="write S(dim), S(dim, groups=g), S(dim, unit=u), R or P (or Shard(0), Replicate(), "
                           "Partial(\"sum\") as in Python)")
    kind, args = m.group(1)[0], (m.group(3) or "").strip()
    try:
        pos, kw = _arguments(args)
        if kind == "R":
            if pos or kw:
                raise ValueError("Replicate takes no arguments")
            return Replicate()
        if kind == "P":
            op = kw.pop("op", pos[0] if pos else "sum")
            if kw or len(pos) > 1:
                raise ValueError("Partial takes one op: sum, max or min")
            return Partial(str(op))
        if "dim" in kw:
            pos = [kw.pop("dim"), *pos]
        if len(pos) != 1:
            raise ValueError("Shard takes one dim")
        return Shard(int(pos[0]), **{k: int(v) for k, v in kw.items()})
    except CliError:
        raise
    except (IndexError, ValueError, TypeError) as e:
        raise CliError(f"cannot read placement {text!r}: {e}",
                       fix="write S(dim), S(dim, groups=g), S(dim, unit=u), R, P or P(max)") from e


def _arguments(args: str) -> tuple[list, dict]:
    """'0, unit=4' -> ([0], {'unit': 4}); quoted words lose their quotes."""
    pos, kw = [], {}
    for part in (a.strip() for a in args.split(",") if a.strip()):
        key, eq, value = part.partition("=")
        value = (value if eq else key).strip().strip("'\"")
        value = int(value) if value.lstrip("-").isdigit() else value
        if eq:
            kw[key.strip()] = value
        else:
            pos.append(value)
    return pos, kw


def _spec(value):
    """{mesh dim: 'S(0)'} or ['S(0)', 'R'] -> placements."""
    if isinstance(value, dict):
        return {k: parse_placement(v) for k, v in value.items()}
    if isinstance(value, list):
        return [parse_placement(v) for v in value]
    return parse_placement(value)


def _keyed(spec: dict) -> dict:
    """Input keys "0" -> 0 (JSON keys are strings); names stay names."""
    return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: _spec(v) for k, v in spec.items()}


def read_placements(arg: str | None, model, names: tuple,
                    shape: tuple | None = None) -> tuple[dict | None, dict | None]:
    """--placements: a file (JSON, or YAML when PyYAML is there) or a recipe name (``shape``: the
    mesh's, for a recipe that splits heads by the tensor-parallel size)."""
    if arg is None:
        return None, None
    if not os.path.exists(arg):
        from ..module import recipes

        if re.fullmatch(r"[a-z+]+", arg):
            return None, recipes.by_name(arg, model, names, shape)
        raise CliError(f"--placements {arg!r} is neither a file nor a recipe",
                       fix="give a .json/.yaml file or one of megatron, fsdp, sequence, megatron+fsdp")
    with open(arg, encoding="utf-8") as f:
        text = f.read()
    if arg.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise CliError("reading a YAML placements file needs PyYAML", fix="pip install pyyaml, or use JSON") from e
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"{arg} is not valid JSON: {e}", fix="check the file, e.g. with python -m json.tool") from e
    if not isinstance(data, dict) or set(data) - {"inputs", "params", "targets"}:
        raise CliError(f"{arg} must be an object with 'inputs' and/or 'params'",
                       fix='e.g. {"inputs": {"0": {"dp": "S(0)"}}, "params": {"fc.weight": {"tp": "S(0)"}}}')
    inputs = _keyed(data["inputs"]) if "inputs" in data else None
    params = {k: _spec(v) for k, v in data["params"].items()} if "params" in data else None
    return inputs, params


def _cost_model(args):
    from ..core.cost import CostModel

    given = {k: getattr(args, k) for k in ("bandwidth", "latency", "flops") if getattr(args, k) is not None}
    if getattr(args, "profile", None):
        if getattr(args, "cost_preset", None):
            raise CliError("--profile and --cost-preset both give the cost model",
                           fix="drop one: --profile is this machine measured, --cost-preset a device's figures")
        return CostModel.from_profile(args.profile, **given)
    if getattr(args, "cost_preset", None):
        return CostModel.preset(args.cost_preset, **given)
    return CostModel(**given) if given else None


def _input_placements(args, made: dict, file_inputs, names: tuple) -> tuple[dict, str]:
    if args.inputs:
        try:
            return _keyed(json.loads(args.inputs)), ""
        except json.JSONDecodeError as e:
            raise CliError(f"--inputs is not valid JSON: {e}", fix='e.g. --inputs \'{"0": {"dp": "S(0)"}}\'') from e
    if file_inputs is not None:
        return file_inputs, ""
    if made.get("input_placements") is not None:
        return made["input_placements"], ""
    inputs = made["example_inputs"]
    key = next(iter(inputs), None) if isinstance(inputs, dict) else (0 if inputs else None)
    if key is not None and getattr(inputs[key], "dim", lambda: 0)() >= 1:
        return {key: {names[0]: Shard(0)}}, (f"inputs: dim 0 of input {key!r} sharded on {names[0]!r} (default; "
                                             "--inputs to change)")
    return {}, "inputs: replicated (default; --inputs to place them)"


def _planner(args, params) -> tuple[dict, str]:
    """(parallelize's planner keyword, what the first lines say about the parameters): with no
    parameter placements given, the ILP places every parameter (propagation would leave them all
    replicated); given ones are kept (the default planner propagates from them)."""
    if args.planner:
        if params:
            note = "placed as given (--placements)"
        elif args.planner == "propagate":
            note = "none given, left replicated (--planner propagate places none)"
        else:
            note = "none given, so the planner places every one"
        return {"planner": args.planner}, f"parameters: {note}; --planner {args.planner}"
    if params:
        return {}, f"parameters: {len(params)} placed as given (--placements), the rest replicated; propagation"
    return {"planner": "ilp"}, ("parameters: none given, so the planner places every one (ILP, "
                                "param_placements='auto'); --placements keeps yours")


def plan_command(args) -> int:
    """Build, plan, print (text or JSON) and optionally write the HTML report."""
    from ..module.parallel_module import parallelize
    from ..core.mesh import Mesh
    from ..tools.report import brief, plan_data, write_html

    mesh = tuple(args.mesh)
    names = args.names
    if len(names) != len(mesh):
        raise CliError(f"--mesh {'x'.join(map(str, mesh))} has {len(mesh)} dims but --names gives {len(names)}",
                       fix="give one name per mesh dim, e.g. --mesh 2x2 --names dp,tp")
    made, built = build(args.target, args.real)
    file_inputs, file_params = read_placements(args.placements, made["model"], names, mesh)
    inputs, inputs_note = _input_placements(args, made, file_inputs, names)
    params = file_params or made.get("param_placements")
    kw, params_note = _planner(args, params)
    cost = _cost_model(args)
    if cost is not None:
        kw["cost_model"] = cost
    pm = parallelize(made["model"], Mesh(mesh, names), made["example_inputs"], input_placements=inputs,
                     param_placements=params or "auto",
                     loss_fn=made.get("loss_fn"), example_targets=made.get("example_targets"), **kw)
    data = plan_data(pm.plan, title=args.title or args.target)
    data.update(target=args.target, built=built, inputs_note=inputs_note, params_note=params_note)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(f"{args.target}: {built}")
        print(params_note)
        if inputs_note:
            print(inputs_note)
        print(brief(data))
        if args.nodes:
            print(pm.plan.summary())
    if args.html:
        write_html(data, args.html)
        print(f"wrote {args.html}", file=sys.stderr if args.json else sys.stdout)
    return 0
