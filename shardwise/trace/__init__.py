"""Stage 1: model + loss -> joint forward+backward aten graph (make_fx, fake tensors), normalised.

    trace_step(model, example_inputs, example_targets=(), loss_fn=None) -> TracedStep
    trace_forward(model, example_inputs) -> TracedForward

Both print as ``# stage: trace`` followed by the graph's Python code. ``node_call(node)``
gives a call_function node as the ``OpCall`` rules consume; ``source_line(node)`` the user's
source line (backward nodes: the forward line they differentiate).
"""
from .base import KEEP_GATHERED, Arguments, Traced
from .forward import TracedForward, trace_forward
from .joint import NoLossError, TracedStep, select_loss, trace_step
from .normalize import aten_ops, is_view, is_view_op, node_call, tensor_arg_nodes
from .provenance import source_line
from .roles import BUFFER, GRAD, INPUT, LOSS, OUTPUT, PARAM, TARGET, OutputRole, PlaceholderRole

__all__ = [
    "Arguments", "NoLossError", "Traced", "TracedForward", "TracedStep", "trace_forward", "trace_step", "select_loss",
    "aten_ops", "is_view", "is_view_op", "node_call", "tensor_arg_nodes", "source_line", "OutputRole", "PlaceholderRole",
    "PARAM", "BUFFER", "INPUT", "TARGET", "LOSS", "GRAD", "OUTPUT", "KEEP_GATHERED",
]
