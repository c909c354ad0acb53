"""A mixed-precision policy (core/precision.py) in the traced step.

- every floating parameter is traced in ``param_dtype``: its placeholder holds the compute
  copy, and carries ``MASTER_DTYPE`` (the parameter's own dtype); each rank's program takes the
  master shard and casts it first thing (lower/program.py), so everything the planner places
  and every collective that moves a parameter is in ``param_dtype``: a gathered shard is cast,
  then gathered;
- floating inputs are cast to ``param_dtype`` and floating model outputs to ``output_dtype``
  inside the traced function (graph nodes, local to every layout);
- every gradient not already in ``reduce_dtype`` gets a cast node right after the node that makes
  it, tagged ``REDUCE_AFTER``: the planners never reduce a partial sum on its way into it
  (search/propagate.py, search/ilp.py), so gradients are reduced in ``reduce_dtype``.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

MASTER_DTYPE = "sw_master_dtype"  # placeholder meta: the master's dtype; the program casts it to the traced one
REDUCE_AFTER = "sw_reduce_after"  # node meta: no input of it is reduced before it (a gradient's reduce cast)


def traced_dtypes(param_names: list, real: list, precision) -> list:
    """Per flat argument (parameters first): the dtype its placeholder is traced in, None to keep it."""
    out = [None] * len(real)
    if precision is None or precision.param_dtype is None:
        return out
    for i in range(len(param_names)):
        if real[i].is_floating_point() and real[i].dtype != precision.param_dtype:
            out[i] = precision.param_dtype
    return out


def _cast(tree, dtype):
    if dtype is None:
        return tree
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                           tree)


def cast_inputs(tree, precision):
    """Floating tensors of the model's inputs in ``param_dtype`` (FSDP2's cast_forward_inputs)."""
    return tree if precision is None else _cast(tree, precision.param_dtype)


def cast_outputs(tree, precision):
    """Floating tensors of the model's output in ``output_dtype``."""
    return tree if precision is None else _cast(tree, precision.output_dtype)


def mark_masters(gm: fx.GraphModule, dtypes: list, real: list) -> None:
    """Tag each placeholder traced in another dtype than its argument's with ``MASTER_DTYPE``."""
    for n, dt, t in zip(gm.graph.find_nodes(op="placeholder"), dtypes, real):
        if dt is not None:
            n.meta[MASTER_DTYPE] = t.dtype


def cast_gradients(gm: fx.GraphModule, grad_indices: list, dtype: torch.dtype | None) -> list[str]:
    """Cast the gradient outputs (at ``grad_indices`` of the graph output) to ``dtype`` right
    where each is made, the cast tagged ``REDUCE_AFTER`` (module docstring)."""
    if dtype is None:
        return []
    (out,) = gm.graph.find_nodes(op="output")
    vals = list(out.args[0])
    cast = {}
    for i in grad_indices:
        g = vals[i]
        if not isinstance(g, fx.Node) or g.meta["val"].dtype == dtype:
            continue
        if g not in cast:
            with gm.graph.inserting_after(g):
                c = gm.graph.call_function(torch.ops.aten._to_copy.default, (g,), {"dtype": dtype})
            c._rename(f"{g.name}_{str(dtype).replace('torch.', '')}")
            val = g.meta["val"]
            with val.fake_mode:
                c.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)
            c.meta.update({k: g.meta[k] for k in ("nn_module_stack", "stack_trace") if k in g.meta})
            c.meta.update({"autograd_backward": True, REDUCE_AFTER: True})
            cast[g] = c
        vals[i] = cast[g]
    out.args = (tuple(vals),)
    return [f"{len(cast)} gradient(s) cast to {str(dtype).replace('torch.', '')} to be reduced in it"] if cast else []
