"""Map every aten scaled-dot-product-attention variant onto ``shardwise.attention``.

After this pass the planner sees one attention node (and one backward node) whatever
kernel torch picked (flash for CPU; flash, memory-efficient or cuDNN on CUDA), so one rule covers batch, head and
sequence parallelism for all of them. Calls the op cannot express are left as they are
(and reported): dropout inside attention, and efficient-attention bias gradients.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..core.calls import bound_arguments
from ..ops.attention import op as attn_op  # noqa: F401 (registers torch.ops.shardwise.*)

aten = torch.ops.aten
FORWARD = torch.ops.shardwise.attention.default
BACKWARD = torch.ops.shardwise.attention_backward.default


def _val(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


def _settings(q, k, is_causal, scale) -> tuple:
    """The op's settings args for a whole (unsharded) call: no offsets, GQA when heads differ."""
    gqa = _val(q).shape[-3] != _val(k).shape[-3] if _val(q).dim() >= 3 else False
    return (bool(is_causal), scale, bool(gqa), 0, 0, None, None)


# the variants torch lowers F.scaled_dot_product_attention to: flash for CPU; flash,
# memory-efficient and cuDNN on CUDA (whichever the dtype, shapes and mask allow); q and k are a
# forward's first two arguments and a backward's second and third (search/flops.py reads them so)
FORWARDS = (aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default)
BACKWARDS = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             aten._scaled_dot_product_efficient_attention_backward.default,
             aten._scaled_dot_product_flash_attention_backward.default,
             aten._scaled_dot_product_cudnn_attention_backward.default)


def _named(n: fx.Node) -> dict:
    """{schema argument name: value} of a call: the variants' argument orders differ between them
    and between torch releases, their names do not."""
    return bound_arguments(n.target, n.args, n.kwargs)


def _mask(a: dict):
    return a.get("attn_mask", a.get("attn_bias"))


def _forward_args(n: fx.Node):
    """(q, k, v, mask, settings) of a forward variant, or None when it must stay as is."""
    if n.target not in FORWARDS:
        return None
    a = _named(n)
    if a.get("dropout_p") or a.get("return_debug_mask"):
        return None
    return a["query"], a["key"], a["value"], _mask(a), _settings(a["query"], a["key"], a.get("is_causal"), a.get("scale"))


def _backward_args(n: fx.Node):
    """(grad_out, q, k, v, mask, out, lse, settings) of a backward variant, or None."""
    if n.target not in BACKWARDS:
        return None
    a = _named(n)
    if n.target == aten._scaled_dot_product_efficient_attention_backward.default:
        bias_grad_used = any(u.args[1] == 3 for u in n.users)
        if a["grad_input_mask"][3] and bias_grad_used:
            return None
    if a.get("dropout_p"):
        return None
    g = a.get("grad_out", a.get("grad_out_"))
    return (g, a["query"], a["key"], a["value"], _mask(a), a["out"], a["logsumexp"],
            _settings(a["query"], a["key"], a.get("is_causal"), a.get("scale")))


def _retarget(graph: fx.Graph, n: fx.Node, target, args, n_out: int):
    """Replace ``n`` by ``target(*args)``; getitem users keep their index (< n_out)."""
    with graph.inserting_before(n):
        new = graph.call_function(target, tuple(args))
    new.meta = dict(n.meta)
    new.meta["val"] = target(*[_val(a) for a in args])
    for u in list(n.users):
        if u.target is operator.getitem and u.args[1] < n_out:
            u.args = (new, u.args[1])
            u.meta["val"] = new.meta["val"][u.args[1]]
    return new


def map_attention(gm: fx.GraphModule) -> list[str]:
    """Rewrite attention variants in place; returns notes on what was (not) mapped."""
    graph, notes, replaced = gm.graph, [], []
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        fwd = _forward_args(n)
        if fwd is not None:
            q, k, v, mask, st = fwd
            _retarget(graph, n, FORWARD, (q, k, v, mask, *st), 2)
            notes.append(f"attention: {n.name} ({n.target}) -> shardwise.attention")
            replaced.append(n)
            continue
        bwd = _backward_args(n)
        if bwd is not None:
            g, q, k, v, mask, out, lse, st = bwd
            _retarget(graph, n, BACKWARD, (g, None, q, k, v, mask, out, lse, *st), 3)
            notes.append(f"attention: {n.name} ({n.target}) -> shardwise.attention_backward")
            replaced.append(n)
        elif "scaled_dot_product" in str(n.target):
            notes.append(f"attention: {n.name} ({n.target}) kept (dropout or a bias gradient)")
    # the replaced calls, with the outputs only they read (a forward's seeds and sequence lengths, which
    # its backward took): erased here, backwards first, as dead-code elimination keeps seeded kernels
    for n in reversed(replaced):
        for u in list(n.users):
            if not u.users:
                graph.erase_node(u)
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    return notes
