"""``parallelize(attention="ulysses" | "ring" | "gather")`` needs an attention op to act on.

The trace maps attention onto ``shardwise.attention`` where it can (trace/attention.py: aten's
SDPA kernels; eager_attention.py: eager chains and the F.sdpa calls torch decomposes). Each
call the tracing mode (eager_attention.py) passes over leaves a note starting with ``PASSED``
(where, how many calls, why); a
request that finds no op in the graph raises, naming those calls and the softmaxes of scores
(3-d or more) still in the graph, so the error says which attention the model has and why
none of it became the op, rather than pointing at the first softmax (a router's, say).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..core.errors import ShardingError
from .provenance import source_line

PASSED = "attention: passed over "
_SOFTMAX = (torch.ops.aten._softmax.default, torch.ops.aten._safe_softmax.default)
_LISTED = 8  # calls named in the error at most (the rest counted)


def passed_note(what: str, why: str, calls: int = 1) -> str:
    """The trace note of ``calls`` attention call(s) ``what`` (with where) passed over because ``why``."""
    return f"{PASSED}{what} ({calls} call(s)): {why}"


def _softmaxes(gm: fx.GraphModule, named: str) -> list[str]:
    """Forward softmaxes of 3-d or more scores, by source line, that ``named`` does not already name."""
    lines: dict[str, int] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val") if n.op == "call_function" and n.target in _SOFTMAX else None
        if val is None or val.dim() < 3 or n.meta.get("autograd_backward"):
            continue
        line = source_line(n) or n.name
        if line not in named:
            lines[line] = lines.get(line, 0) + 1
    return [f"softmax of scores at {line} ({k} call(s)): an eager attention chain (matmul -> scale -> additive "
            "terms -> softmax -> matmul) the trace did not follow to its end" for line, k in lines.items()]


def check_request(gm: fx.GraphModule, mode: str, notes=()) -> None:
    """``attention=`` other than "auto" needs an attention op in the graph to act on; ``notes``:
    the trace's (the passed-over calls)."""
    if mode == "auto":
        return
    if any(n.op == "call_function" and n.target is torch.ops.shardwise.attention.default for n in gm.graph.nodes):
        return
    passed = [note[len(PASSED):] for note in notes if note.startswith(PASSED)]
    calls = passed + _softmaxes(gm, "\n".join(passed))
    if calls:
        listed = "\n".join(f"  - {c}" for c in calls[:_LISTED])
        more = f"\n  (and {len(calls) - _LISTED} more)" if len(calls) > _LISTED else ""
        what = f"; the attention calls it has, and why each was passed over:\n{listed}{more}\n"
    else:
        what = "; it has no scaled_dot_product_attention call and no softmax of scores. "
    raise ShardingError(
        f"attention={mode!r} cannot be honoured: the traced graph has no attention op to apply it to{what}"
        "shardwise maps F.scaled_dot_product_attention (without dropout) and the eager chain matmul (or baddbmm) -> "
        "scale -> soft-cap -> additive bias / mask -> softmax over the keys -> matmul onto shardwise.attention",
        fix="call torch.nn.functional.scaled_dot_product_attention (no dropout) or shardwise.attention in the model "
            "(Hugging Face: attn_implementation='sdpa', attention_dropout=0), or leave attention='auto'")
