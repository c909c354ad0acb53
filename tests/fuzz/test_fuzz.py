"""Random small programs, sharded with random placements, equal one device (hypothesis).

    python -m pytest -q -p no:cacheprovider tests/fuzz                       # CI: a fixed set
    SHARDWISE_FUZZ_EXAMPLES=5000 python -m pytest -q -p no:cacheprovider -m fuzz tests/fuzz

Each example is a program (ops.py) on a random mesh with random input, parameter and target
placements, planned with both planners and trained 2 AdamW steps on the threads backend;
loss, every gradient and the parameters must equal one device (runner.py says why the
tolerance is what it is). A failure prints a standalone reproducer. The CI run is
derandomized (same examples every run, no example database; 30 examples, ~30 s of CPU) on
meshes of up to 8 ranks, 1-d to 3-d; the ``fuzz`` run draws new ones each time (hypothesis
prints the seed to replay a failure; SHARDWISE_FUZZ_MESH_NDIM=1|2|3 bounds the meshes).
A long hunt that logs every failure and keeps going: ``python -m tests.fuzz.hunt --help``.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from . import ops
from .choose import Chooser, HypothesisChooser
from .generate import generate, mesh_shape
from .runner import check, compare_with_one_device, load, reproducer

CI_EXAMPLES = 30
CI_MESH_NDIM = 3  # meshes (2,) .. (4, 2) and (2, 2, 2)


def _settings(n: int, derandomize: bool):
    """No deadline (planning time varies with load), no example database (CI reproducible).
    The CI run does not shrink (a shrink re-runs programs for minutes, past pytest's timeout;
    the first failing program's reproducer is printed at once); the long run does."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([] if derandomize else [Phase.shrink])
    return settings(max_examples=n, deadline=None, derandomize=derandomize, database=None, print_blob=True,
                    phases=phases, suppress_health_check=list(HealthCheck))


def _example(data, mesh_ndim: int, max_ops: int) -> str:
    c = HypothesisChooser(data)
    seed = c.int(0, 2**16)
    return generate(c, mesh_shape(c, mesh_ndim), seed, max_ops).source()


@_settings(CI_EXAMPLES, derandomize=True)
@given(st.data())
def test_random_programs_equal_one_device(data):
    torch.set_num_threads(1)
    check(_example(data, CI_MESH_NDIM, max_ops=5))


@pytest.mark.fuzz
@pytest.mark.timeout(0)  # thousands of examples take hours
@_settings(int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", "2000")), derandomize=False)
@given(st.data())
def test_fuzz_many_programs(data):
    torch.set_num_threads(1)
    check(_example(data, int(os.environ.get("SHARDWISE_FUZZ_MESH_NDIM", "3")), max_ops=8))


# -- the fuzzer's own checks: it generates what it says, and its comparison can fail -----
def test_every_op_generates_and_runs_on_one_device():
    """Each op of the catalogue builds valid programs (the single-device forward runs)."""
    for op in ops.OPS:
        for seed in range(8):
            c = Chooser(seed)
            src = generate(c, (2,), seed, 3, (op,)).source()
            ns = load(src)
            (inputs, targets) = ns["make_data"]()
            out = ns["Program"]()(*inputs)
            loss = out if ns["loss_fn"] is None else ns["loss_fn"](out, *targets)
            assert loss.dim() == 0 and torch.isfinite(loss), src


def test_a_wrong_gradient_is_caught_with_a_reproducer():
    """The comparison can fail: a reference with one weight nudged by 0.5 differs in loss
    and gradients, and the failure comes with a reproducer that compiles."""
    src = generate(Chooser(3), (2,), 3, 3, (ops.linear,)).source()
    ns = load(src)
    ref = ns["Program"]()
    with torch.no_grad():
        next(ref.parameters()).view(-1)[0] += 0.5
    with pytest.raises(AssertionError, match="loss|gradient"):
        compare_with_one_device(ns["Program"], ns["make_data"](), ns["loss_fn"], ns["MESH"], ns["INPUT_PLACEMENTS"],
                                ns["PARAM_PLACEMENTS"], ns["TARGET_PLACEMENTS"], "propagate", reference=ref)
    text = reproducer(src, "ilp")
    assert "compare_with_one_device(Program, make_data()" in text and "class Program" in text
    compile(text, "repro.py", "exec")
