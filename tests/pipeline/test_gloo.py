"""Pipelined training on the torch backend (gloo processes) equals one device: loss, every
gradient and the parameters after two AdamW steps (rtol 1e-4); point-to-point messages between
processes, the loss and the random state broadcast over the pipeline dim.

    python -m pytest tests/pipeline/test_gloo.py -q -m "dist or slow" --durations=0
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.module import recipes
from shardwise.run.launch import spawn
from tests.parallel.harness import assert_close, single_step

from .models import ADAM, Net, data, hf, mse, pipe
from .wrapped import wrapped_gpt2

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def _build(case):
    """(model, inputs, targets, loss_fn, parallelize keywords) of one case, the same in every process."""
    kind, name, names, schedule, m = case["kind"], case.get("name"), case["names"], case["schedule"], case["m"]
    kw = {"pipeline": pipe(schedule, m)}
    if kind == "net":
        x, y = data(case.get("batch", 7))
        model, inputs, targets, loss_fn = Net(), (x,), (y,), mse
        kw["example_targets"] = (y,)
        if "dp" in names:
            kw |= {"input_placements": {0: {"dp": S(0)}}, "target_placements": {0: {"dp": S(0)}}}
        if "tp" in names:
            kw["param_placements"] = {f"blocks.{k}.0.{w}": {"tp": S(0)} for k in range(4) for w in ("weight", "bias")}
    elif kind == "wrapped":  # the model inside the user's module (tests/pipeline/test_wrapped.py)
        model, inputs = wrapped_gpt2(case["tied"], case["own_loss"], layers=case["layers"])
        targets, loss_fn = (), None
    else:
        model, inputs = hf(name, layers=case["layers"])
        targets, loss_fn = (), None
        if "dp" in names:
            kw["input_placements"] = {"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}
        if "tp" in names:
            kw["param_placements"] = {n: {"tp": pl} for n, pl in recipes.megatron(model).items()}
    return model, tuple(inputs), tuple(targets), loss_fn, kw


def _rank_body(rank, case):
    model, inputs, targets, loss_fn, kw = _build(case)
    mesh = sw.Mesh(case["shape"], case["names"])
    pm = sw.parallelize(model, mesh, inputs, loss_fn=loss_fn, backend="torch", **kw)
    opt = pm.optimizer(torch.optim.AdamW, lr=ADAM["lr"], **ADAM["optim_kwargs"])
    res = {"losses": [], "grads": []}
    for _ in range(ADAM["steps"]):
        res["losses"].append(pm.step(*inputs, *targets))
        res["grads"].append(pm.gradients())
        opt.step()
        opt.zero_grad()
    res["state"] = pm.state_dict()
    res["p2p"] = pm.plan.stats()["p2p_bytes"]
    return res


def _reference(case):
    model, inputs, targets, loss_fn, _ = _build(case)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=ADAM["lr"], **ADAM["optim_kwargs"])
    out = {"losses": [], "grads": []}
    for _ in range(ADAM["steps"]):
        loss, grads = single_step(ref, inputs, targets, loss_fn)
        out["losses"].append(loss)
        out["grads"].append({n: g.clone() for n, g in grads.items()})
        opt.step()
    out["state"] = ref.state_dict()
    return out


def check(case):
    nproc = 1
    for s in case["shape"]:
        nproc *= s
    outs = spawn(_rank_body, nproc, case, timeout=500)
    want = _reference(case)
    for rank, got in enumerate(outs):
        where = f"rank {rank}"
        assert got["p2p"] > 0
        for i in range(ADAM["steps"]):
            assert_close(got["losses"][i], want["losses"][i], f"{where} step {i} loss")
            for n, g in want["grads"][i].items():
                assert_close(got["grads"][i][n], g, f"{where} step {i} grad of {n}")
        for n, p in want["state"].items():
            assert_close(got["state"][n], p, f"{where} parameter {n} after {ADAM['steps']} steps")


def net(shape, names, schedule, m, **kw):
    return {"kind": "net", "shape": shape, "names": names, "schedule": schedule, "m": m, **kw}


def hf_case(name, shape, names, schedule, m, layers):
    return {"kind": "hf", "name": name, "shape": shape, "names": names, "schedule": schedule, "m": m,
            "layers": layers}


def test_net_pp2_1f1b_two_processes():
    """The quick one: 7 rows in 4 uneven microbatches over 2 gloo processes."""
    check(net((2,), ("pp",), "1f1b", 4))


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    hf_case("gpt2", (4,), ("pp",), "1f1b", 8, 4),
    hf_case("llama", (4,), ("pp",), "zero-bubble", 4, 4),
    hf_case("gpt2", (2, 2), ("pp", "dp"), "interleaved", 4, 2),
    hf_case("llama", (2, 2), ("pp", "tp"), "gpipe", 8, 2),
], ids=lambda c: f"{c['name']}-{'x'.join(c['names'])}-{c['schedule']}-m{c['m']}")
def test_hf_four_processes(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, tied, own_loss", [("1f1b", True, False), ("interleaved", False, True),
                                                     ("gpipe", False, False), ("zero-bubble", True, True)])
def test_wrapped_gpt2_four_processes(schedule, tied, own_loss):
    """The GPT-2 inside the user's module on 4 gloo pipeline ranks, vs one device."""
    check({"kind": "wrapped", "name": "gpt2", "shape": (4,), "names": ("pp",), "schedule": schedule, "m": 8,
           "layers": 6 if schedule == "interleaved" else 4, "tied": tied, "own_loss": own_loss})


@pytest.mark.slow
def test_net_pp_dp_tp_eight_processes():
    check(net((2, 2, 2), ("pp", "dp", "tp"), "zero-bubble", 4, batch=8))


@pytest.mark.slow
def test_hf_pp_dp_tp_eight_processes():
    check(hf_case("gpt2", (2, 2, 2), ("pp", "dp", "tp"), "1f1b", 4, 2))
