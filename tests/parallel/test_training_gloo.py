"""Training-loop habits on the torch backend, 2 gloo processes, against one device (issue 10):
local uneven inputs on ranks seeded differently, clip_grad_norm_, rank-0-only state_dict,
the global-input check, and the user guide's torchrun script (examples/torchrun_train.py) run by torch's own launcher.

    python -m pytest tests/parallel/test_training_gloo.py -q -m dist --durations=0
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn

from .harness import assert_close

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrun_train.py"
STEPS, LR, MAX_NORM = 2, 0.1, 0.05


def mlp():
    """Default torch init from the global RNG: each rank's seed gives it different weights."""
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch=7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


def _error(fn) -> str | None:
    try:
        fn()
    except sw.ShardingError as e:
        return str(e)
    return None


def _rank_body(rank):
    torch.manual_seed(100 + rank)
    model = mlp()
    init = copy.deepcopy(model.state_dict())
    mesh = sw.Mesh((2,), ("dp",))
    X, Y = data()
    x, y = (X[:4], Y[:4]) if rank == 0 else (X[4:], Y[4:])  # torch.chunk: 4 + 3
    pm = sw.parallelize(model, mesh, (x,), loss_fn=mse, example_targets=(y,), backend="torch", inputs="local",
                        input_placements={0: [S(0)]}, target_placements={0: [S(0)]})
    opt = pm.optimizer(torch.optim.SGD, lr=LR)
    res = {"init": init, "losses": [], "norms": [], "grads": []}
    for _ in range(STEPS):
        res["losses"].append(pm.step(x, y))
        res["norms"].append(pm.clip_grad_norm_(MAX_NORM))
        res["grads"].append(pm.gradients())
        opt.step()
        opt.zero_grad()
    res["forward"] = pm(x)
    res["state"] = pm.state_dict(rank0_only=True)
    res["full_state"] = pm.state_dict()
    own = mlp()  # sync_module_states=False: each rank keeps its own (replicated) weights
    res["unsynced"] = sw.parallelize(copy.deepcopy(own), mesh, (X,), loss_fn=mse, backend="torch",
                                     sync_module_states=False).state_dict()
    res["own"] = own.state_dict()
    glob = sw.parallelize(mlp(), mesh, (X,), loss_fn=mse, backend="torch", input_placements={0: [S(0)]})
    res["global_mismatch"] = _error(lambda: glob.step(X + rank, Y))
    xs, ys = (X[:3], Y[:3]) if rank == 0 else (X[3:], Y[3:])  # 3 + 4: not torch.chunk's pieces
    res["bad_pieces"] = _error(lambda: sw.parallelize(
        mlp(), mesh, (xs,), loss_fn=mse, example_targets=(ys,), backend="torch", inputs="local",
        input_placements={0: [S(0)]}, target_placements={0: [S(0)]}))
    return res


def _reference(init):
    model = mlp()
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    X, Y = data()
    out = {"losses": [], "norms": [], "grads": []}
    for _ in range(STEPS):
        loss = mse(model(X), Y)
        loss.backward()
        out["losses"].append(loss.detach())
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["forward"] = model(X).detach()
    out["state"] = model.state_dict()
    return out


def test_local_uneven_inputs_differently_seeded_ranks_match_rank0s_model_on_one_device():
    outs = spawn(_rank_body, 2, timeout=240)
    init0, init1 = outs[0]["init"], outs[1]["init"]
    assert not torch.equal(init0["0.weight"], init1["0.weight"]), "the ranks built different models"
    want = _reference(init0)
    for rank, got in enumerate(outs):
        where = f"rank {rank}"
        for i in range(STEPS):
            assert_close(got["losses"][i], want["losses"][i], f"{where} step {i} loss")
            assert_close(got["norms"][i], want["norms"][i], f"{where} step {i} total norm")
            for n, g in want["grads"][i].items():
                assert_close(got["grads"][i][n], g, f"{where} step {i} clipped grad of {n}")
        assert_close(got["forward"], want["forward"], f"{where} forward on local inputs (full output)")
        for n, p in want["state"].items():
            assert_close(got["full_state"][n], p, f"{where} parameter {n} after {STEPS} steps")
        for n, p in got["own"].items():
            assert torch.equal(got["unsynced"][n], p), f"{where}: sync_module_states=False kept {n}"
        assert "rank 1" in got["global_mismatch"] and "different values" in got["global_mismatch"], got
        assert "rank 0's piece has shape (3, 6)" in got["bad_pieces"], got["bad_pieces"]
    assert outs[0]["state"].keys() == want["state"].keys() and outs[1]["state"] == {}


# -- the user guide's torchrun script ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("torchrun_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _script_reference(mod, steps, batch, lr):
    """What the script computes, on one device: rank 0's model (seed 0), the same batches and dropout stream."""
    torch.manual_seed(0)
    model = mod.Net()
    data = mod.batches(steps, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(1234)
    losses, norms = [], []
    for x, y in data:
        loss = mod.loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, model.eval()(data[0][0]).sum().item(), model.state_dict()


@pytest.mark.parametrize("inputs", ["local", pytest.param("global", marks=pytest.mark.slow)])
def test_torchrun_script_on_two_gloo_processes_matches_one_device(tmp_path, inputs):
    ckpt = tmp_path / "ckpt.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(SCRIPT), "--inputs", inputs, "--steps", "3", "--batch", "7",
           "--out", str(ckpt)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps = [r for r in lines if "step" in r]
    losses, norms, eval_sum, state = _script_reference(_load_script(), 3, 7, 1e-2)
    assert [r["step"] for r in steps] == [0, 1, 2], proc.stdout  # rank 0 alone prints
    for r, loss, norm in zip(steps, losses, norms):
        assert loss == pytest.approx(r["loss"], rel=1e-4), (r, loss)
        assert norm == pytest.approx(r["grad_norm"], rel=1e-4), (r, norm)
    assert [r["eval_out_sum"] for r in lines if "eval_out_sum" in r] == [pytest.approx(eval_sum, rel=1e-4, abs=1e-5)]
    saved = torch.load(ckpt)
    assert saved.keys() == state.keys()
    for n, p in state.items():
        assert_close(saved[n], p, f"checkpoint {n}")
