"""Where a node came from: the user's source line, for forward and backward nodes.

make_fx(record_stack_traces=True) records ``node.meta['stack_trace']`` for forward ops only,
extracting and formatting the whole Python stack for every node (a seventh of a deep model's
trace); ``forward_lines`` records the one frame ``source_line`` reads instead, once per torch
call, and leaves the rest to make_fx. For backward ops we hook the autograd graph before ``torch.autograd.grad`` runs: each grad_fn
announces its sequence number while it runs (torch.fx.traceback's seq_nr bookkeeping, as
aot_autograd does), so a backward node gets the same ``meta['seq_nr']`` as the forward op
that created that grad_fn, and every node made during the backward gets
``meta['autograd_backward'] = True``; ``link_backward`` then copies the forward stack trace
over. Ops run by the autograd engine between grad_fns (gradient accumulation adds) are marked
``meta['gradient_accumulation'] = True``. These use torch.fx.traceback's underscore helpers
(checked in torch 2.13); without them provenance is skipped, the trace itself is unaffected.
"""
from __future__ import annotations

import contextlib
import importlib.util
import linecache
import os
import re
import sys

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

_ACC = "<shardwise: gradient accumulation>"
_BWD = "<shardwise: backward>"  # set while a grad_fn runs: make_fx then records no stack of its own
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _package_dir(name: str) -> str | None:
    """The directory of installed package ``name`` (with a trailing separator), or None."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "")


# Not the user's source: torch itself, and Hugging Face's hub-kernel wrappers (the ``kernels``
# package, used by transformers >= 5.2x when installed), whose ``forward`` passes a decorated model
# function's call through (``apply_rotary_pos_emb``): the model line that called it is the source.
_LIBRARY_DIRS = tuple(d for d in (_TORCH_DIR, _package_dir("kernels")) if d)


def _grad_fns(root):
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        yield fn
        stack.extend(f for f, _ in fn.next_functions)


@contextlib.contextmanager
def backward_provenance(loss: torch.Tensor):
    """Around ``torch.autograd.grad(loss, ...)`` inside a make_fx trace run under
    ``fx_traceback.preserve_node_meta()``: tag backward nodes with their grad_fn's seq_nr."""
    meta = fx_traceback.get_current_meta  # looked up on each call: torch may rebind it
    mark = getattr(fx_traceback, "_set_autograd_backward", None)
    if mark is None or not hasattr(fx_traceback, "set_grad_fn_seq_nr") or loss.grad_fn is None:
        yield
        return
    handles = []

    def pre(seq):
        def hook(grad_outputs):
            meta()["stack_trace"] = _BWD  # no user frame on a backward stack: not worth extracting
            fx_traceback.set_grad_fn_seq_nr(seq)
        return hook

    def post(grad_inputs, grad_outputs):
        fx_traceback.reset_grad_fn_seq_nr()
        meta()["stack_trace"] = _ACC

    for fn in _grad_fns(loss.grad_fn):
        handles.append(fn.register_prehook(pre(fn._sequence_nr())))
        handles.append(fn.register_hook(post))
    try:
        with mark():
            yield
    finally:
        for key in ("stack_trace", "in_grad_fn", "grad_fn_seq_nr"):
            meta().pop(key, None)
        for h in handles:
            h.remove()


@contextlib.contextmanager
def module_scope(model: torch.nn.Module):
    """While ``model`` runs inside a make_fx trace under ``preserve_node_meta()``: every node
    records the modules it ran in as ``meta['nn_module_stack']`` ({path: (path, class name)},
    outermost first; torch's own key, kept through the functionalising re-trace), so a plan
    can name ``transformer.h.0.attn.c_attn`` next to the node. Backward nodes get their
    forward node's (link_backward)."""
    names = {}
    for name, mod in model.named_modules():
        names.setdefault(id(mod), name)
    stack: list = []
    register = torch.nn.modules.module

    def pre(mod, args):
        name = names.get(id(mod))
        if name:
            stack.append((name, type(mod).__qualname__))
            fx_traceback.get_current_meta()["nn_module_stack"] = {n: (n, c) for n, c in stack}

    def post(mod, args, out):
        if names.get(id(mod)) and stack:
            stack.pop()
            meta = fx_traceback.get_current_meta()
            if stack:
                meta["nn_module_stack"] = {n: (n, c) for n, c in stack}
            else:
                meta.pop("nn_module_stack", None)

    handles = [register.register_module_forward_pre_hook(pre),
               register.register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        fx_traceback.get_current_meta().pop("nn_module_stack", None)


class _ForwardLines(torch.overrides.TorchFunctionMode):
    """On each torch function call in forward, the node meta's stack trace is the one frame that
    ``source_line`` would pick from make_fx's own record: the innermost frame named ``forward``
    (or an anchored function's, ``anchor``) outside torch. make_fx then extracts no stack for the
    nodes the call makes (it does where this finds no such frame, and in backward, as before)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        meta = fx_traceback.get_current_meta()
        line = None if meta.get("autograd_backward") else _forward_frame(sys._getframe(1))
        if line is None:
            return func(*args, **(kwargs or {}))
        before = meta.get("stack_trace")
        meta["stack_trace"] = line
        try:
            return func(*args, **(kwargs or {}))
        finally:
            if before is None:
                meta.pop("stack_trace", None)
            else:
                meta["stack_trace"] = before


def _forward_frame(f) -> str | None:
    anchors = getattr(fx.proxy, "_STACK_TRACE_ANCHORS", ())
    while f is not None:
        co = f.f_code
        if ((co.co_name == "forward" or (co.co_filename, co.co_name) in anchors)
                and not co.co_filename.startswith(_LIBRARY_DIRS)):
            code = linecache.getline(co.co_filename, f.f_lineno).strip()
            return f'File "{co.co_filename}", line {f.f_lineno}, in {co.co_name}\n    {code}'
        f = f.f_back
    return None


@contextlib.contextmanager
def forward_lines():
    """Inside a make_fx trace under ``preserve_node_meta()``: each forward node's source line
    recorded once per torch call (``_ForwardLines``) rather than by make_fx per node."""
    with _ForwardLines():
        yield


def module_path(node: fx.Node) -> str | None:
    """The innermost module path a node ran in (``blocks.0.attn.qkv``), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]


def layer_of(module: str) -> str:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3`` (up to the first index);
    ``fc1`` -> ``fc1``; no module -> ``(top level)``."""
    if not module:
        return "(top level)"
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def fsdp_unit(consumer: fx.Node) -> str:
    """The unit whose parameters are gathered together (lower/prefetch.py): the consumer's
    indexed block (``transformer.h.3``, layer_of), else the root ("": embeddings, final norm,
    head), as FSDP2's fully_shard per block plus the root."""
    layer = layer_of(module_path(consumer) or "")
    return layer if any(part.isdigit() for part in layer.split(".")) else ""


def anchor(fn) -> None:
    """Record stack traces in ``fn`` too (make_fx keeps only frames named ``forward``);
    used for the user's loss_fn. A no-op where torch lacks the hook."""
    register = getattr(fx.proxy, "_register_stack_trace_anchor", None)
    if register is not None and callable(fn):
        register(fn)


def link_backward(graph: fx.Graph) -> None:
    """Copy each forward node's stack trace to the backward nodes with its seq_nr.

    Run on the pass-1 graph (seq_nr is not carried through a re-trace; stack_trace and
    autograd_backward are)."""
    first: dict[int, fx.Node] = {}
    for n in graph.nodes:
        s = n.meta.get("seq_nr")
        if s is not None and not n.meta.get("autograd_backward") and n.meta.get("stack_trace"):
            first.setdefault(s, n)
    for n in graph.nodes:
        if n.meta.get("stack_trace") == _BWD:
            del n.meta["stack_trace"]
        if not n.meta.get("autograd_backward") or n.meta.get("stack_trace"):
            continue
        fwd = first.get(n.meta.get("seq_nr"))
        if fwd is not None:
            n.meta["stack_trace"] = fwd.meta["stack_trace"]
            if "nn_module_stack" in fwd.meta:
                n.meta["nn_module_stack"] = fwd.meta["nn_module_stack"]


def mark_accumulation(graph: fx.Graph) -> None:
    """Nodes the autograd engine ran between grad_fns: ``meta['gradient_accumulation']``."""
    for n in graph.nodes:
        if n.meta.get("stack_trace") == _ACC:
            del n.meta["stack_trace"]
            n.meta["gradient_accumulation"] = True


def _frames(stack_trace: str) -> list[dict]:
    return [m.groupdict() for m in _FRAME.finditer(stack_trace)]


def source_line(node: fx.Node) -> str | None:
    """The user's source line that produced ``node``: ``"file:line in fn: code"``.

    Frames inside torch itself (and hub-kernel wrappers, ``_LIBRARY_DIRS``) are skipped (the
    innermost user frame wins). Backward nodes carry the forward line with a ``" (backward)"``
    suffix; gradient accumulation adds, which have no single forward line, give
    ``"(gradient accumulation in backward)"``.
    None when nothing was recorded.
    """
    st = node.meta.get("stack_trace")
    suffix = " (backward)" if node.meta.get("autograd_backward") else ""
    if not st:
        return "(gradient accumulation in backward)" if node.meta.get("gradient_accumulation") else None
    frames = _frames(st)
    if not frames:
        return st.strip().splitlines()[-1].strip() + suffix
    user = [f for f in frames if not f["file"].startswith(_LIBRARY_DIRS)] or frames
    f = user[-1]
    return f"{f['file']}:{f['line']} in {f['fn'].strip()}: {f['code'].strip()}{suffix}"
