"""Training-loop habits on a ParallelModule (issue 10), each against one device on the threads
backend: train/eval modes and dropout, gradient accumulation and zero_grad, sharding-aware
gradient norms and clipping, forward-only models, local inputs as per-rank lists, sync_to,
and the one validation path for input and parameter placements (issue 9).

    python -m pytest tests/parallel/test_training_loop.py -q

The torch-backend versions (gloo processes, torchrun) are in test_training_gloo.py.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S

from .harness import assert_close

MEGATRON = {"0.weight": S(0), "0.bias": S(0), "3.weight": S(1)}


def mlp(seed=0, p_drop=0.0, hidden=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.GELU(), torch.nn.Dropout(p_drop),
                               torch.nn.Linear(hidden, 3))


def mse(out, y):
    return ((out - y) ** 2).mean()


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- modes -------------------------------------------------------------------------------------
def test_eval_and_train_modes_follow_the_module():
    model = mlp(p_drop=0.5)
    ref = copy.deepcopy(model)
    x, y = data(5)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    assert pm.training
    pm.eval()
    assert not pm.training and not model.training
    assert_close(pm(x), ref.eval()(x), "pm.eval() output")
    pm.train()
    model.eval()  # on the module directly, not through pm
    assert_close(pm(x), ref(x), "model.eval() output")
    assert_close(pm.step(x, y), mse(ref(x), y), "eval-mode step loss")
    model.train()
    ref.train()
    torch.manual_seed(7)
    out = pm(x)
    torch.manual_seed(7)
    want = ref(x)
    assert_close(out, want, "train-mode output (same dropout mask as one device)")
    assert not torch.allclose(out, ref.eval()(x)), "dropout is active again in train mode"


def test_a_submodule_in_eval_mode_gets_its_own_plan():
    model = mlp(p_drop=0.5)
    x, _ = data(4)
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), (x,), loss_fn=mse,
                        param_placements={n: [p] for n, p in MEGATRON.items()})
    model[2].eval()  # only the dropout
    assert_close(pm(x), copy.deepcopy(model).eval()(x), "submodule eval output")


# -- gradient accumulation -----------------------------------------------------------------------
def test_three_accumulated_steps_equal_three_backward_calls_megatron_2x2():
    model = mlp(hidden=6)
    ref = copy.deepcopy(model)
    batches = [data(5, seed=s) for s in (1, 2, 3)]
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    pm = sw.parallelize(model, mesh, (batches[0][0],), loss_fn=mse, input_placements={0: {"dp": S(0)}},
                        param_placements={n: {"tp": p} for n, p in MEGATRON.items()})
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    losses = [pm.step(x, y) for x, y in batches]
    for i, (x, y) in enumerate(batches):
        loss = mse(ref(x), y)
        loss.backward()
        assert_close(losses[i], loss.detach(), f"accumulated step {i} loss")
    got = pm.gradients()
    for n, g in grads_of(ref).items():
        assert_close(got[n], g, f"grad of {n} after 3 accumulated steps")
    opt.zero_grad()  # set_to_none: the next step starts afresh
    ref.zero_grad()
    x, y = batches[1]
    pm.step(x, y)
    mse(ref(x), y).backward()
    got = pm.gradients()
    for n, g in grads_of(ref).items():
        assert_close(got[n], g, f"grad of {n} after zero_grad and one step")
    pm.zero_grad()
    assert all(p.grad is None for p in pm.parameters())
    assert all(g is None for g in pm.gradients().values())


def test_zero_grad_set_to_none_false_keeps_zero_tensors():
    x, y = data(4)
    model = mlp()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    with torch.no_grad():  # the step differentiates whatever the caller's grad mode
        loss = pm.step(x, y)
    want = mse(ref(x), y)
    want.backward()
    assert_close(loss, want.detach(), "loss of a step under no_grad")
    assert_close(pm.gradients()["0.weight"], ref[0].weight.grad, "grad of a step under no_grad")
    pm.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in pm.parameters())


def test_broadcast_gradients_are_owned_before_in_place_updates():
    """d(sum(w + x))/dw is an expanded view of one 1 (stride 0): accumulating into it or clipping
    it in place must work, as after backward() (autograd makes such gradients contiguous)."""
    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 3))

        def forward(self, x):
            return self.w + x

    x = torch.randn(4, 3)
    model = Shift()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=lambda o: o.sum(), example_targets=(),
                        param_placements={"w": [S(0)]})
    for _ in range(2):
        pm.step(x)
        ref(x).sum().backward()
    assert_close(pm.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), "norm")
    assert_close(pm.gradients()["w"], ref.w.grad, "accumulated, clipped grad")


# -- gradient norms and clipping -----------------------------------------------------------------
CLIP_CASES = {
    "data_parallel": ((2,), ("dp",), dict(input_placements={0: [S(0)]})),
    "fsdp_shard0_uneven": ((3,), ("dp",), dict(input_placements={0: [S(0)]},
                                               param_placements={n: [S(0)] for n in
                                                                 ("0.weight", "0.bias", "3.weight", "3.bias")})),
    "tensor_parallel_2d": ((2, 2), ("tp", "sp"), dict(param_placements={"0.weight": [S(0), S(1)],
                                                                        "0.bias": [S(0), R()],
                                                                        "3.weight": [R(), S(1)]})),
}


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
def test_clip_grad_norm_equals_one_device(case, norm_type):
    shape, names, kwargs = CLIP_CASES[case]
    model = mlp(hidden=7)
    ref = copy.deepcopy(model)
    x, y = data(5)
    pm = sw.parallelize(model, sw.Mesh(shape, names), (x,), loss_fn=mse, **kwargs)
    pm.step(x, y)
    mse(ref(x), y).backward()
    max_norm = 0.05
    assert_close(pm.grad_norm(norm_type), torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters()], norm_type), f"{case} grad_norm")
    total = pm.clip_grad_norm_(max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
    assert_close(total, want, f"{case} total norm")
    got = pm.gradients()
    for n, g in grads_of(ref).items():
        assert_close(got[n], g, f"{case} clipped grad of {n}")
    assert_close(pm.grad_norm(norm_type), torch.tensor(max_norm), f"{case} norm after clipping", rtol=1e-3)


def test_torch_clip_over_local_shards_overcounts_replicas():
    """Why pm.clip_grad_norm_ exists: torch's sees every replicated shard once per rank."""
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = data(4)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    pm.step(x, y)
    mse(ref(x), y).backward()
    one_device = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    naive = torch.nn.utils.get_total_norm([p.grad for p in pm.parameters()])
    assert_close(naive, one_device * math.sqrt(2), "torch's norm over replicated shards")
    assert_close(pm.grad_norm(), one_device, "pm.grad_norm")


def test_clip_error_if_nonfinite_and_bad_norm_type():
    x, y = data(4)
    pm = sw.parallelize(mlp(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    pm.step(x, y)
    pm.parameters()[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        pm.clip_grad_norm_(1.0, error_if_nonfinite=True)
    with pytest.raises(sw.ShardingError, match="norm_type"):
        pm.grad_norm(0)


# -- forward only ----------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_forward_only_model_without_loss(grad_mode):
    model = mlp(p_drop=0.3).eval()
    x, y = data(5)
    ctx = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with ctx():
        pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), (x,), input_placements={0: {"dp": S(0)}},
                            param_placements={n: {"tp": p} for n, p in MEGATRON.items()})
        out = pm(x)
        want = model(x)
    assert_close(out, want, "forward-only output")
    stats = pm.plan.stats()
    assert pm.plan.stage == "forward" and stats["memory"]["gradients"] == 0
    assert pm.has_loss is False
    with pytest.raises(sw.ShardingError, match="no loss") as e:
        pm.step(x, y)
    assert "loss_fn" in str(e.value)
    assert_close(pm(x), model(x), "forward outside the grad mode it was planned in")


def test_model_returning_its_loss_still_trains():
    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x, y):
            return mse(self.net(x), y)

    model = WithLoss()
    ref = copy.deepcopy(model)
    x, y = data(5)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x, y), input_placements={0: [S(0)], 1: [S(0)]})
    assert pm.has_loss is True
    loss = ref(x, y)
    loss.backward()
    assert_close(pm.step(x, y), loss.detach(), "loss")
    for n, g in grads_of(ref).items():
        assert_close(pm.gradients()[n], g, f"grad of {n}")


# -- local inputs on the threads backend ---------------------------------------------------------------
def test_local_inputs_as_per_rank_lists_2x2():
    """dp x tp: the dp pieces are 3 + 2 rows, tp peers get the same piece."""
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = data(5)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    xs, ys = [x[:3], x[:3], x[3:], x[3:]], [y[:3], y[:3], y[3:], y[3:]]
    pm = sw.parallelize(model, mesh, (xs,), loss_fn=mse, inputs="local", example_targets=(ys,),
                        input_placements={0: {"dp": S(0)}}, target_placements={0: {"dp": S(0)}},
                        param_placements={n: {"tp": p} for n, p in MEGATRON.items()})
    loss = mse(ref(x), y)
    loss.backward()
    assert_close(pm.step(xs, ys), loss.detach(), "local-input loss")
    for n, g in grads_of(ref).items():
        assert_close(pm.gradients()[n], g, f"grad of {n}")
    assert_close(pm(xs), ref(x), "local-input forward (full output)")


def test_local_inputs_nested_on_both_mesh_dims_uneven():
    """7 rows sharded on dp then tp: torch.chunk gives 4 + 3, then 2 + 2 and 2 + 1."""
    model = mlp()
    ref = copy.deepcopy(model)
    x, y = data(7)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    rows = [(0, 2), (2, 4), (4, 6), (6, 7)]
    xs, ys = [x[a:b] for a, b in rows], [y[a:b] for a, b in rows]
    pm = sw.parallelize(model, mesh, (xs,), loss_fn=mse, inputs="local", example_targets=(ys,),
                        input_placements={0: [S(0), S(0)]}, target_placements={0: [S(0), S(0)]})
    loss = mse(ref(x), y)
    loss.backward()
    assert_close(pm.step(xs, ys), loss.detach(), "nested local-input loss")
    for n, g in grads_of(ref).items():
        assert_close(pm.gradients()[n], g, f"grad of {n}")


def test_local_inputs_that_are_not_the_ranks_chunks_are_refused():
    x, y = data(5)
    mesh = sw.Mesh((2,), ("dp",))
    kw = dict(loss_fn=mse, inputs="local", input_placements={0: [S(0)]}, target_placements={0: [S(0)]})
    pm = sw.parallelize(mlp(), mesh, ([x[:3], x[3:]],), example_targets=([y[:3], y[3:]],), **kw)
    with pytest.raises(sw.ShardingError, match=r"rank 0's piece has shape \(2, 6\)"):
        pm.step([x[:2], x[2:]], [y[:2], y[2:]])  # 2 + 3: torch.chunk gives 3 + 2
    with pytest.raises(sw.ShardingError, match="list of 2 per-rank values"):
        pm.step(x, y)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    pm = sw.parallelize(mlp(), mesh, ([x[:3], x[:3], x[3:], x[3:]],), loss_fn=mse, inputs="local",
                        input_placements={0: {"dp": S(0)}})
    with pytest.raises(sw.ShardingError, match=r"ranks 0 and 1 hold the same chunk.*rank 1 differs"):
        pm([x[:3], x[:3] + 1, x[3:], x[3:]])
    with pytest.raises(sw.ShardingError, match="inputs="):
        sw.parallelize(mlp(), mesh, (x,), inputs="mine")


# -- sync_to, state_dict ---------------------------------------------------------------------------
def test_sync_to_copies_trained_weights_and_buffers():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.register_buffer("scale", torch.full((3,), 2.0), persistent=False)

        def forward(self, x):
            return self.net(x) * self.scale

    model = WithBuffer()
    ref = copy.deepcopy(model)
    x, y = data(5)
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), (x,), loss_fn=mse,
                        param_placements={f"net.{n}": [p] for n, p in MEGATRON.items()} | {"scale": [S(0)]})
    opt = pm.optimizer(torch.optim.AdamW, lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for _ in range(2):
        pm.step(x, y)
        opt.step()
        opt.zero_grad()
        mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    fresh = WithBuffer()
    fresh.scale.zero_()
    assert pm.sync_to(fresh) is fresh
    for n, t in {**dict(ref.named_parameters()), **dict(ref.named_buffers())}.items():
        assert_close(dict(fresh.named_parameters()).get(n, dict(fresh.named_buffers()).get(n)), t.detach(),
                     f"synced {n}")
    pm.sync_to()  # into the module given to parallelize
    assert_close(model(x), ref(x), "original module after sync_to")
    assert pm.state_dict(rank0_only=True).keys() == ref.state_dict().keys()  # threads: this process is rank 0
    with pytest.raises(sw.ShardingError, match="sync_to"):
        pm.sync_to(mlp())


# -- one validation path for placements (issue 9) -------------------------------------------------------
@pytest.mark.parametrize("where", ["input", "parameter"])
def test_nested_unit_spec_fails_at_parallelize_naming_the_tensor(where):
    model = torch.nn.Linear(2, 6)
    mesh = sw.Mesh((3, 2), ("a", "b"))
    bad = [S(0), S(0, unit=3)]
    kw = (dict(input_placements={0: bad}) if where == "input" else dict(param_placements={"weight": bad}))
    with pytest.raises(sw.ShardingError) as e:
        sw.parallelize(model, mesh, (torch.randn(6, 2),), loss_fn=lambda o: o.sum(), **kw)
    msg = str(e.value)
    assert ("input 0" if where == "input" else "parameter 'weight'") in msg, msg
    assert "unit=3" in msg and "(6, 2)" in msg and "fix:" in msg, msg


def test_guide_shows_the_torchrun_script_as_tested():
    """The user guide's "Several processes" script (docs/guide.md) is examples/torchrun_train.py (run
    on 2 gloo processes by test_training_gloo.py), code for code."""
    from pathlib import Path
    import re

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```py\n(.*?)```", (root / "docs" / "guide.md").read_text(), re.S)
    script = (root / "examples" / "torchrun_train.py").read_text()
    assert any("init_process_group" in b and b.strip() in script for b in blocks), "the guide's script drifted"
