"""Activation checkpointing as the liveness estimate and the step model price it.

    ck = checkpointing(plan.prop.gm, plan.param_placeholders, "selective")
    est = program_memory(plan, rank, ck)       # lower/memory.py: recomputed values held only where read
    ck.rerun                                    # forward nodes run again in backward (their flops: recompute)

A model of torch.utils.checkpoint applied per numbered block (``model.layers.7``, search/layers.py's
layers, as torchtitan and FSDP wrap them): a value a block computes in forward and its backward
reads is either saved (held from forward into backward) or recomputed (freed after its last forward
read and made again when the block's backward starts, held until its last read then). What a
policy saves:

- ``"full"``: only the block's inputs (values made outside it): every forward node of the block
  runs again in backward;
- ``"selective"``: torchtitan's op-level selective checkpointing (its ``_save_list`` policy): the
  outputs of matrix products (every other ``mm`` of the block in forward order: the 1st, 3rd, ...)
  and of attention are saved, everything else (norms, activations, rotary embeddings, residual
  adds, the other products) is recomputed; the saved ops do not run again.

A value any other block's forward reads (a block's output is the next block's input) is saved.
This is a model of what the run would hold, not a transformation of the program: the program
the planner lowers stores every activation (parallelize has no checkpointing yet).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..search.layers import _layers

aten = torch.ops.aten
POLICIES = ("none", "selective", "full")


def _saved_ops() -> tuple:
    ops = [aten.mm.default, aten.max.default, aten.abs.default,
           aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default]
    sw = getattr(torch.ops, "shardwise", None)
    if sw is not None and hasattr(sw, "attention"):
        ops.append(sw.attention.default)
    return tuple(ops)


@dataclass(frozen=True)
class Checkpointing:
    """``recomputed``: {graph node: its block} of the values recomputed for backward;
    ``held``: {graph node: its block} of the values the checkpoint keeps for the recomputation
    (the saved ops' outputs, the block's inputs), live at least until the block's backward starts;
    ``backward_start``: {block: the first backward graph node of it} (where they are made again);
    ``rerun``: the forward graph nodes that run again in backward."""

    policy: str
    recomputed: dict
    backward_start: dict
    rerun: frozenset
    held: dict


def checkpointing(gm: fx.GraphModule, params: dict, policy: str) -> Checkpointing | None:
    """The Checkpointing of ``policy`` on the traced step ``gm`` (``params``: {placeholder:
    parameter name}, which ties parameters to their block); None for "none" or no blocks."""
    if policy not in POLICIES:
        from ..core.errors import ConfigError

        raise ConfigError(f"unknown activation checkpointing {policy!r}", fix=f"use one of {POLICIES}")
    if policy == "none":
        return None
    blocks = _layers(gm, params)
    saved_ops = _saved_ops()
    of, recomputed, starts, rerun, held = {}, {}, {}, set(), {}
    for key, nodes in blocks.items():
        for n in nodes:
            of[n.name] = key
    for key, nodes in blocks.items():
        fwd = [n for n in nodes if n.op == "call_function" and not n.meta.get("autograd_backward")]
        back = [n for n in nodes if n.op == "call_function" and n.meta.get("autograd_backward")]
        if not fwd or not back:
            continue
        starts[key] = back[0].name
        mm = 0
        for n in fwd:
            save = False
            if policy == "selective" and n.target in saved_ops:
                if n.target is aten.mm.default:
                    mm += 1
                    save = mm % 2 == 1  # torchtitan: every second mm is recomputed
                else:
                    save = True
            for a in n.all_input_nodes:  # the block's inputs: kept by the checkpoint
                if of.get(a.name) != key and a.op != "placeholder":
                    held.setdefault(a.name, key)
            if save:
                held[n.name] = key  # kept for the recomputation (torch's selective checkpoint cache)
                continue
            rerun.add(n.name)
            readers = [u for u in n.users if u.op != "output"]
            if any(not u.meta.get("autograd_backward") and of.get(u.name) != key for u in readers):
                continue  # read by another block's forward: an input there, saved
            if any(u.meta.get("autograd_backward") for u in readers) or _read_in_backward_via_views(n):
                recomputed[n.name] = key
    return Checkpointing(policy, recomputed, starts, frozenset(rerun), held)


def _read_in_backward_via_views(n: fx.Node) -> bool:
    """A view or getitem of ``n`` (a chain of them) that backward reads."""
    from ..trace import is_view

    todo = [u for u in n.users if is_view(u) or (u.op == "call_function" and u.target is operator.getitem)]
    while todo:
        u = todo.pop()
        if u.meta.get("autograd_backward"):
            return True
        todo += [w for w in u.users if w.meta.get("autograd_backward") or is_view(w)]
    return False
