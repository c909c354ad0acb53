"""Run a fuzz program sharded and on one device; on a mismatch, print a standalone reproducer.

Tolerance (float32): rtol 1e-4 as everywhere in the project, and an absolute floor of
``1e-5 * max(1, max |reference|)``. A sharded run sums the same terms in another order (a
partial sum per rank, then an all-reduce), which moves a float32 result by a few ulps of
the largest partial sum, ~1e-7 relative; gradients that are zero in exact arithmetic
(softmax then a sum over the same dim, LayerNorm over one element) come out as such noise on
both sides, so a purely relative check would fail them. AdamW runs with ``eps=1e-3``: with
the default 1e-8, Adam's first step ``g / (|g| + eps)`` turns a noise gradient of 1e-9 into
a full-size step of sign decided by the noise; with 1e-3 a noise gradient δ moves a weight
by at most ``lr * δ / eps`` (1e-2 * 1e-6 / 1e-3 = 1e-5), inside the floor, while a real
gradient (|g| >> 1e-3) still takes Adam's normalised step.
"""
from __future__ import annotations

import inspect
import linecache
import textwrap
import time

import torch

import shardwise as sw

FILENAME = "<shardwise fuzz program>"


def compare_with_one_device(Program, data, loss_fn, mesh, input_placements, param_placements, target_placements,
                            planner, cost_model=None, steps=2, lr=1e-2, eps=1e-3, rtol=1e-4, atol=1e-5, reference=None,
                            dtype=torch.float32):
    """Loss and every gradient of ``steps`` training steps, and the parameters after ``steps``
    AdamW updates, equal one device's. Raises AssertionError naming the first mismatch.
    ``reference``: the single-device model (default: a copy of the sharded one). ``dtype``:
    float64 (with rtol=1e-9, atol=1e-9) tells a real bug from float32 rounding noise."""
    import copy

    inputs, targets = ([t.to(dtype) if t.is_floating_point() else t for t in ts] for ts in data)
    inputs, targets = tuple(inputs), tuple(targets)
    model = Program().to(dtype)
    ref = copy.deepcopy(model) if reference is None else reference
    pm = sw.parallelize(model, mesh, inputs, input_placements=input_placements, param_placements=param_placements,
                        target_placements=target_placements, loss_fn=loss_fn, planner=planner,
                        cost_model=cost_model)
    opt = pm.optimizer(torch.optim.AdamW, lr=lr, eps=eps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps)

    def close(got, want, what):
        if want is None:  # a parameter the loss does not reach: nothing or zeros
            assert got is None or not got.any(), f"{what}: expected no gradient, got {got}"
            return
        assert got is not None, f"{what}: missing"
        floor = atol * max(1.0, want.detach().abs().max().item()) if want.numel() else atol
        torch.testing.assert_close(got, want.detach(), rtol=rtol, atol=floor, msg=lambda m: f"{what}: {m}")

    for step in range(steps):
        loss = pm.step(*inputs, *targets)
        ref_opt.zero_grad(set_to_none=True)
        out = ref(*inputs)
        ref_loss = out if loss_fn is None else loss_fn(out, *targets)
        ref_loss.backward()
        close(loss, ref_loss, f"step {step}: loss ({planner})")
        grads = pm.gradients()
        for name, p in ref.named_parameters():
            close(grads[name], p.grad, f"step {step}: gradient of {name} ({planner})")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    state = pm.state_dict()
    for name, t in ref.state_dict().items():
        close(state[name], t, f"{name} after {steps} AdamW steps ({planner})")
    return pm


def load(source: str) -> dict:
    """Exec a program's source; its lines show in tracebacks and in shardwise's node provenance."""
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
    ns: dict = {"__name__": "shardwise_fuzz_program"}
    exec(compile(source, FILENAME, "exec"), ns)
    return ns


def run(source: str, planner: str, **kwargs):
    ns = load(source)
    return compare_with_one_device(ns["Program"], ns["make_data"](), ns["loss_fn"], ns["MESH"], ns["INPUT_PLACEMENTS"],
                                   ns["PARAM_PLACEMENTS"], ns["TARGET_PLACEMENTS"], planner, ns["COST_MODEL"], **kwargs)


def float64_agrees(source: str, planner: str) -> bool:
    """True when the same program in float64 matches one device to 1e-9: a float32 mismatch is
    then rounding noise the generator should not have produced (a degenerate program), not a bug."""
    try:
        run(source, planner, dtype=torch.float64, rtol=1e-9, atol=1e-9)
    except Exception:
        return False
    return True


def reproducer(source: str, planner: str) -> str:
    """The program, the comparison function and the call: paste into a file and run it."""
    compare = textwrap.dedent(inspect.getsource(compare_with_one_device))
    call = ("compare_with_one_device(Program, make_data(), loss_fn, MESH, INPUT_PLACEMENTS, PARAM_PLACEMENTS, "
            f"TARGET_PLACEMENTS, planner={planner!r}, cost_model=COST_MODEL)")
    return f"{source}\n\n{compare}\n\nif __name__ == \"__main__\":\n    {call}\n    print(\"equal to one device\")\n"


def check(source: str, planners=("propagate", "ilp")) -> dict:
    """Both planners; a failure (mismatch or exception) raises AssertionError with a reproducer.
    Returns {planner: seconds to plan and run}."""
    seconds = {}
    for planner in planners:
        t0 = time.perf_counter()
        try:
            run(source, planner)
            seconds[planner] = time.perf_counter() - t0
        except Exception as e:  # every error is a finding: the program and placements are valid
            bar = "-" * 30
            raise AssertionError(f"{type(e).__name__}: {e}\n{bar} reproducer (python repro.py) {bar}\n"
                                 f"{reproducer(source, planner)}{bar}") from e
    return seconds
