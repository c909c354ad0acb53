"""Mixture-of-Experts: the experts of a layer as one op (op.py), its math (kernels.py) and
expert parallelism by token dispatch over all-to-alls (dispatch.py)."""
from .op import BACKWARD, FORWARD, moe_experts

__all__ = ["FORWARD", "BACKWARD", "moe_experts"]
