"""parallelize(model, mesh, example_inputs, ...) -> ParallelModule.

    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), (x,),
                        input_placements={"x": {"dp": sw.Shard(0)}}, loss_fn=loss_fn)
    loss = pm.step(x, y); opt = pm.optimizer(torch.optim.AdamW, lr=1e-3); opt.step()

The training step is traced whole (forward and backward), planned once per input
signature, lowered to one program per rank and run on the chosen backend.
"""
from __future__ import annotations

import torch

from .errors import ShardingError
from .layout import Layout
from .mesh import Mesh
from .plan.cost import CostModel
from .plan.plan import Plan
from .plan.propagate import Planner
from .plan.solve import solve
from .rules import DEFAULT, load_all
from .rules.attention import strategy_filter as attention_filter
from .runtime.backend import make_backend
from .spec import check_input_keys, param_specs, placeholder_specs
from .trace import LOSS, trace_forward, trace_step
from .trace.roles import forward_arg_names

PLANNERS = ("propagate", "ilp")
DEFAULT_PLANNER = "propagate"  # the one place that picks the default


class ParallelModule:
    """A model laid out on a mesh. Holds the local shards of every rank this process runs.

    input_placements / target_placements: {forward-arg name or index: placements}; a target
        shaped like a placed input follows that input unless named here.
    param_placements: {param or buffer name: placements}; unnamed ones are Replicate ("auto"
        does the same for now: the cost-driven solver of DESIGN.md is not built yet).
    loss_fn: loss_fn(output, *targets) -> scalar; None: the model's output (or its .loss).
    backend: "threads" (every rank here) or "torch" (this process's rank; needs a process group).
    memory_budget: bytes per rank; a plan whose estimated peak exceeds it raises ShardingError.
    attention: "auto" | "ulysses" | "ring" | "gather": which sequence-parallel attention to allow.
    replicate_fallback: ops (or their names) without a rule to run replicated, reported in the plan.
    planner: "propagate" (node by node in graph order, from the user's placements; fast) or "ilp"
        (every node's strategy chosen together by an integer program minimising the estimated
        communication plus compute time, plan/solve.py, scipy/HiGHS; seconds to plan; never
        costlier than "propagate" under cost_model; on an n-d mesh a local optimum). The
        "# planner:" line of plan.summary() says how the solve went.
    cost_model: link and compute figures (plan.cost.CostModel); registry: the rule table to use;
    debug: check every local result's shape against the plan (on by default).
    """

    def __init__(self, model, mesh: Mesh, example_inputs: tuple, *, input_placements=None, param_placements="auto",
                 loss_fn=None, backend="threads", target_placements=None, example_targets=None,
                 memory_budget=None, replicate_fallback=(), cost_model=None, registry=None, debug=True,
                 attention="auto", planner=DEFAULT_PLANNER):
        if not isinstance(mesh, Mesh):
            raise ShardingError(f"mesh must be a shardwise.Mesh, got {type(mesh).__name__}")
        if not isinstance(example_inputs, tuple):
            raise ShardingError(f"example_inputs must be a tuple for model(*inputs), got {type(example_inputs).__name__}",
                                fix="wrap a single input as (x,)")
        self.model, self.mesh, self.loss_fn = model, mesh, loss_fn
        self.example_inputs, self.n_inputs = example_inputs, len(example_inputs)
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                          or memory_budget <= 0):
            raise ShardingError(f"memory_budget must be a positive number of bytes per rank, got {memory_budget!r}")
        self.debug, self.memory_budget = debug, memory_budget
        if planner not in PLANNERS:
            raise ShardingError(f"unknown planner {planner!r}; expected one of {PLANNERS}",
                                fix='use planner="propagate" (fast, from your placements) or planner="ilp" (global)')
        self.planner_name = planner
        self.registry = load_all(registry or DEFAULT)
        self.planner = Planner(mesh, self.registry, cost_model or CostModel(), replicate_fallback,
                               attention_filter(attention))
        self.input_spec = self._keyed(input_placements, "input_placements")
        self.target_spec = self._keyed(target_placements, "target_placements")
        names, _ = forward_arg_names(model)
        check_input_keys(self.input_spec, names, self.n_inputs)
        self._check_input_specs(example_inputs, names)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        canonical = {id(t): n for n, t in state.items()}
        # model.state_dict() also lists tied aliases (e.g. lm_head.weight = wte.weight)
        self.aliases = {k: canonical[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in canonical}
        self.specs = param_specs({n: tuple(t.shape) for n, t in state.items()}, param_placements, mesh)
        self.backend = make_backend(backend, mesh)
        self.shards = self.backend.shard_state(model, self.specs)  # {rank: {name: local tensor}}
        self._plans: dict = {}
        self.plan_kind = None
        if loss_fn is None or example_targets is not None:
            self._step_plan(example_inputs, tuple(example_targets or ()))

    # -- specs ------------------------------------------------------------------------
    @staticmethod
    def _keyed(spec, what):
        if spec is None:
            return {}
        if not isinstance(spec, dict):
            raise ShardingError(f"{what} must be a dict keyed by forward-arg name or index, got {type(spec).__name__}",
                                fix=f"e.g. {what}={{'x': [sw.Shard(0)]}}")
        return dict(spec)

    def _check_input_specs(self, inputs, names):
        from .spec import check_placements

        for k, pl in self.input_spec.items():
            i = k if isinstance(k, int) else names.index(k)
            x = inputs[i] if -len(inputs) <= i < len(inputs) else None
            if isinstance(x, torch.Tensor):
                check_placements(pl, self.mesh, x.dim(), f"input {k!r}")

    def _target_spec(self, inputs, targets) -> dict:
        """Explicit target placements, else a target shaped like a placed input follows it."""
        spec = dict(self.target_spec)
        names, _ = forward_arg_names(self.model)
        for j, t in enumerate(targets):
            if j in spec or not isinstance(t, torch.Tensor):
                continue
            for k, pl in self.input_spec.items():
                i = k if isinstance(k, int) else names.index(k)
                x = inputs[i]
                if isinstance(x, torch.Tensor) and x.shape == t.shape:
                    spec[j] = pl
                    break
        return spec

    # -- planning ---------------------------------------------------------------------
    @staticmethod
    def _signature(*trees):
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten(trees)
        return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves)

    def _make_plan(self, traced, targets, outputs, stage):
        ph = placeholder_specs(traced, self.mesh, self.input_spec, self._target_spec(self._last_inputs, targets),
                               self.specs, self.n_inputs)
        params = {n.name: r.name for n, r in zip(traced.placeholder_nodes(), traced.placeholders) if r.kind == "param"}
        run = solve if self.planner_name == "ilp" else Planner.run
        prop = run(self.planner, traced.gm, ph, outputs, params=params)
        plan = Plan(prop, params, self.debug, stage)
        plan.traced = traced
        self._check_budget(plan)
        return plan

    def _check_budget(self, plan: Plan) -> None:
        if self.memory_budget is None:
            return
        need = plan.stats()["peak_memory_bytes"]
        if need > self.memory_budget:
            raise ShardingError(
                f"the {plan.stage} plan needs an estimated {need} bytes per rank (parameters, gradients, peak "
                f"activations) but memory_budget is {int(self.memory_budget)}",
                fix="shard more parameters (param_placements, e.g. Shard(0) on the data dim for fully-sharded "
                    "parameters), shard the batch or sequence, or raise the budget")

    def _step_plan(self, inputs, targets) -> Plan:
        key = ("step", self._signature(inputs, targets))
        if key not in self._plans:
            self._last_inputs = inputs
            traced = trace_step(self.model, tuple(inputs), tuple(targets), self.loss_fn)
            outs = [None if r.kind == LOSS else self.specs[r.name] for r in traced.outputs]
            self._plans[key] = self._make_plan(traced, targets, outs, "step")
        self.plan_kind = key
        return self._plans[key]

    def _forward_plan(self, inputs) -> Plan:
        key = ("forward", self._signature(inputs))
        if key not in self._plans:
            self._last_inputs = inputs
            traced = trace_forward(self.model, tuple(inputs))
            self._plans[key] = self._make_plan(traced, (), [None] * len(traced.outputs), "forward")
        if self.plan_kind is None:
            self.plan_kind = key
        return self._plans[key]

    @property
    def plan(self) -> Plan:
        """The plan of the last step (or forward, if no step has been planned yet)."""
        if self.plan_kind is None:
            return self._forward_plan(self.example_inputs)
        return self._plans[self.plan_kind]

    # -- running ----------------------------------------------------------------------
    def step(self, *args):
        """Forward + backward on full inputs and targets; returns the full loss and sets
        ``.grad`` on every local parameter shard."""
        inputs, targets = args[: self.n_inputs], args[self.n_inputs:]
        plan = self._step_plan(inputs, targets)
        outs = self.backend.run(plan, self.shards, inputs, targets)
        loss = None
        for rank, res in outs.items():
            loss, grads = plan.traced.split_outputs(res)  # the loss is replicated: any rank's will do
            for name, g in grads.items():
                self.shards[rank][name].grad = None if g is None else g.detach()
        return loss.detach()

    def __call__(self, *inputs):
        """Forward only; returns the full outputs in the model's output structure."""
        plan = self._forward_plan(inputs)
        outs = self.backend.run(plan, self.shards, inputs, ())
        return plan.traced.rebuild(list(next(iter(outs.values()))))

    def forward(self, *inputs):
        return self(*inputs)

    # -- state ------------------------------------------------------------------------
    def parameters(self) -> list:
        """The local parameter shards of every rank this process holds (torch.optim works on them)."""
        return [p for rank in sorted(self.shards) for p in self.shards[rank].values()
                if isinstance(p, torch.nn.Parameter) and p.requires_grad]

    def named_local_parameters(self, rank: int) -> dict:
        return {n: p for n, p in self.shards[rank].items() if isinstance(p, torch.nn.Parameter)}

    def gradients(self) -> dict:
        """{name: full gradient}, gathered from the local shards."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return {n: self.backend.gather(self.shards, n, self.specs[n], grad=True) for n in names}

    def state_dict(self) -> dict:
        """Full parameters and buffers, gathered, under the keys of ``model.state_dict()``."""
        full = {n: self.backend.gather(self.shards, n, self.specs[n]) for n in self.specs}
        return {k: full[n] for k, n in self.aliases.items()}

    def load_state_dict(self, full_state: dict) -> None:
        """Copy full tensors into the local shards (in place, so optimizers keep their references)."""
        unknown = set(full_state) - set(self.aliases)
        # non-persistent buffers (e.g. rotary inv_freq) are not in a state dict: not required
        missing = set(self.aliases.values()) - {self.aliases[k] for k in full_state if k in self.aliases}
        if unknown or missing:
            raise ShardingError(f"load_state_dict: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}",
                                fix="pass a full state dict with the keys of model.state_dict()")
        for key, t in full_state.items():
            name = self.aliases[key]
            want = Layout(t.shape, t.dtype, self.specs[name])
            for rank, shards in self.shards.items():
                local = shards[name]
                piece = want.local_view(t, self.mesh, rank)
                if piece.shape != local.shape:
                    raise ShardingError(f"load_state_dict: {name!r} has shape {tuple(t.shape)}, which does not match "
                                        f"the model's parameter")
                with torch.no_grad():
                    local.copy_(piece)

    def optimizer(self, cls, **kwargs):
        """``cls(local shards of every rank held here, **kwargs)``; elementwise optimizers such as
        AdamW then update each shard exactly as on one device."""
        return cls(self.parameters(), **kwargs)


def parallelize(model, mesh: Mesh, example_inputs: tuple, **kwargs) -> ParallelModule:
    """Lay ``model`` out on ``mesh``; see ParallelModule for the arguments."""
    return ParallelModule(model, mesh, example_inputs, **kwargs)
