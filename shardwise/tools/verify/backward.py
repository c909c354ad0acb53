"""Backward ops without a rule: what the autograd formulas of covered ops emit.

A training step is traced whole, so a covered op whose derivative emits an op with no rule
(cumsum's backward flips) makes every model using it fail at ``parallelize``. For every
registered op and each of its sweep samples, one call and its gradient (``autograd.grad`` of
the outputs' sum w.r.t. its float inputs) are traced the way the training step is
(``trace.capture``: fake tensors, then functionalised), and each aten op in that graph with
no rule is reported with the covered ops whose backward emits it. Ops that are themselves
backward kernels are skipped: their derivatives only matter for double backward.

    python -m shardwise.tools.verify.backward            # missing ops, one a line; exit 1 if any
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch.utils._pytree as pytree

from ...rules.registry import Registry

_IGNORED_PREFIXES = ("aten::_assert", "aten::sym_")


def _float_leaves(leaves) -> list[int]:
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()
            and x.device.type != "meta"]


def _step(op, leaves, spec, grad_at):
    """fn(*inputs at ``grad_at``) -> gradients of the sum of op's float outputs w.r.t. them."""
    def fn(*xs):
        ls = list(leaves)
        for i, x in zip(grad_at, xs):
            ls[i] = x
        args, kwargs = pytree.tree_unflatten(ls, spec)
        outs = [o for o in pytree.tree_leaves(op(*args, **kwargs))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return []
        total = sum(o.float().sum() for o in outs)
        return [g for g in torch.autograd.grad(total, xs, allow_unused=True) if g is not None]
    return fn


def joint_ops(op, args: tuple, kwargs: dict) -> set | None:
    """aten ops in the traced forward + backward of one call of ``op`` (None: not differentiable
    in any float input)."""
    from ...trace.capture import capture, fakeify, new_fake_mode

    leaves, spec = pytree.tree_flatten((args, kwargs))
    floats = _float_leaves(leaves)
    # every float input at once; else each alone (some, like nll_loss's weight, are not differentiable)
    tries = ([floats] if floats else []) + ([[i] for i in floats] if len(floats) > 1 else [])
    for grad_at in tries:
        mode = new_fake_mode()
        fake = fakeify([leaves[i] for i in grad_at], mode, torch.device("cpu"), [True] * len(grad_at))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = capture(_step(op, leaves, spec, grad_at), fake)
        except Exception:  # noqa: BLE001 - not differentiable this way: try the next
            continue
        return {n.target for n in gm.graph.nodes if n.op == "call_function"
                and isinstance(n.target, torch._ops.OpOverload) and not n.target.name().startswith(_IGNORED_PREFIXES)}
    return None


def backward_ops_without_rule(registry: Registry | None = None, ops=None, cap: int | None = 2,
                              samples: dict | None = None) -> dict:
    """{aten op with no rule: sorted names of the covered ops whose traced backward emits it}."""
    from ...rules import DEFAULT, load_all
    from .samples import collect_samples

    registry = registry or load_all(DEFAULT)
    ops = sorted(ops if ops is not None else registry.ops(), key=str)
    ops = [op for op in ops if "backward" not in str(op)]
    samples = samples if samples is not None else collect_samples(ops, cap=cap)
    missing: dict = {}
    for op in ops:
        for s in samples.get(op, []):
            found = joint_ops(op, *s.fresh()) or set()
            for m in found:
                if m not in registry and m.namespace in ("aten", "prims", "shardwise"):
                    missing.setdefault(m, set()).add(str(op))
    return {m: sorted(by) for m, by in sorted(missing.items(), key=lambda kv: str(kv[0]))}


def main(argv=None) -> int:
    missing = backward_ops_without_rule(cap=None if "--full" in (argv or sys.argv[1:]) else 2)
    for m, by in missing.items():
        print(f"{m}  <- backward of {', '.join(by)}")
    print(f"{len(missing)} backward ops without a rule")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
