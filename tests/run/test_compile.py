"""``compile=True`` (run/compiled.py): each rank's program through torch.compile (inductor,
fullgraph) with torch's functional collectives, exact against one device on two gloo
processes (loss, every gradient, parameters after 2 AdamW steps); compiled once per plan and
rank (a step after the first compiled one compiles nothing); dropout drawing one device's masks;
refused with a typed error where it cannot run (threads backend, ops that communicate inside
their local call other than by an all_reduce). Inductor compiles C++ with gcc: ~10-15 s of CPU per program on this
machine, so the default run compiles one MLP program (data parallel); tensor parallel,
FSDP-style and GPT-2 are slow.

    python -m pytest tests/run/test_compile.py -q --durations=0 [-m slow]
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S
from shardwise.core.errors import ConfigError
from shardwise.run.execute import check_compilable
from shardwise.run.launch import spawn
from tests.models import zoo
from tests.parallel.harness import assert_close, check_training, single_step

MEGATRON = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(1)], "2.bias": [R()]}
FSDP = {"0.weight": [S(0)], "0.bias": [S(0)], "2.weight": [S(0)], "2.bias": [S(0)]}


def mse(out, y):
    return ((out - y) ** 2).mean()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _inductor_cache(tmp: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp  # no leftovers from other runs: each test compiles afresh
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers to start on a busy machine


def _compiled_mlp(rank, mesh_dim: str, **kw) -> dict:
    """The seeded MLP, batch 5 on 2 ranks, compiled: exact against one device for 2 AdamW steps,
    then a third step that compiles nothing; the program printed is the one compiled."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    pm = check_training(zoo.seeded_mlp(), sw.Mesh((2,), (mesh_dim,)), (x,), (y,), mse, steps=2, backend="torch",
                        compile=True, **kw)
    compiled = pm._executable(pm.plan)._compiled[rank]
    before = _graphs()
    pm.step(x, y)
    assert _graphs() == before, f"{kw}: a step after the first compiled one compiled again"
    assert compiled.first_call_s is not None and compiled.first_call_s > 0
    assert pm.plan.program(rank) and compiled.code == pm.plan.program_module(rank, guards=False).code
    return {"first_call_s": compiled.first_call_s, "calls": pm.plan.stats()["collective_calls"],
            "program": compiled.code}


def _dp_body(rank, tmp):
    """Data parallel (uneven, gradients in one bucket: launch + wait) with the debug guards' eager
    first run; ring attention refused at parallelize."""
    _inductor_cache(tmp)
    out = _compiled_mlp(rank, "dp", input_placements={0: [S(0)]})
    with pytest.raises(ConfigError, match="compile=False"):
        _ring(compile=True, backend="torch")
    return out


def test_compiled_mlp_data_parallel_uneven_matches_one_device_on_gloo(tmp_path):
    """One compile per rank (~15 s of CPU; minutes of wall time when the machine is loaded)."""
    for out in spawn(_dp_body, 2, str(tmp_path), timeout=500):
        assert "bucket_all_reduce" in out["program"] and "wait_bucket" in out["program"], out["program"]


def _tp_fsdp_body(rank, tmp):
    """Tensor parallel (Megatron, debug off: the first step compiles) and FSDP-style (prefetched
    gathers, reduce_scattered gradients in a bucket)."""
    _inductor_cache(tmp)
    return {"tp": _compiled_mlp(rank, "tp", param_placements=MEGATRON, debug=False),
            "fsdp": _compiled_mlp(rank, "dp", input_placements={0: [S(0)]}, param_placements=FSDP, debug=False)}


@pytest.mark.slow
def test_compiled_mlp_tensor_parallel_and_fsdp_style_match_one_device_on_gloo(tmp_path):
    for rank, out in enumerate(spawn(_tp_fsdp_body, 2, str(tmp_path), timeout=590)):
        assert out["tp"]["calls"] == {"all_reduce": 1}, f"rank {rank}: {out['tp']}"  # the forward partial sum
        fsdp = out["fsdp"]
        assert fsdp["calls"].get("all_gather") and fsdp["calls"].get("reduce_scatter"), fsdp
        assert "start_all_gather" in fsdp["program"] and "wait_gathers" in fsdp["program"], fsdp["program"]


def _gpt2_body(rank, tmp):
    _inductor_cache(tmp)
    c = zoo.gpt2(batch=5)
    data = {"input_ids": [S(0)], "labels": [S(0)]}
    # eps: the attention key bias's gradient is zero in exact arithmetic, float noise (which inductor's
    # kernels round differently) that Adam's m / sqrt(v) would turn into a full step (tests/parallel/harness.py)
    pm = check_training(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, c.example_targets, c.loss_fn, steps=2,
                        input_placements=data, backend="torch", compile=True, lr=1e-3, optim_kwargs={"eps": 1e-6})
    before = _graphs()
    pm.step(*c.example_inputs, *c.example_targets)
    assert _graphs() == before, "a step after the first compiled one compiled again"
    # cross_entropy's total weight is all-reduced inside nll_loss's local call: traced too
    return pm._executable(pm.plan)._compiled[rank].first_call_s


@pytest.mark.slow
def test_compiled_gpt2_data_parallel_uneven_matches_one_device_on_gloo(tmp_path):
    firsts = spawn(_gpt2_body, 2, str(tmp_path), timeout=590)
    assert all(s > 0 for s in firsts)


def _one_rank_body(rank, tmp):
    _inductor_cache(tmp)
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])
    # cross_entropy: the count of targets and the loss are all-reduced on "dp", a group of one
    pm = check_training(zoo.seeded_mlp(), sw.Mesh((1,), ("dp",)), (x,), (y,), torch.nn.functional.cross_entropy,
                        steps=2, backend="torch", compile=True, debug=False,
                        input_placements={0: [S(0)]}, target_placements={0: [S(0)]})
    program = pm.plan.program(rank)
    assert program.count("bucket_all_reduce((sum_default,)") == 1 and "wait_bucket" in program, program
    return pm._executable(pm.plan)._compiled[rank].first_call_s


@pytest.mark.slow
def test_compiled_one_member_group_matches_one_device(tmp_path):
    """A mesh dim of one rank sends nothing: its all_reduce is the tensor itself, no wait_tensor
    (inductor cannot lower a wait on a tensor no collective made)."""
    (first,) = spawn(_one_rank_body, 1, str(tmp_path), timeout=300)
    assert first > 0


def _inlined_body(rank):
    """GPT-2's per-rank program with its custom-op calls as their plain functions (what compile=True
    hands dynamo): every attention call of this data-parallel plan is on the whole-call fast path and
    every index_aligned is aten.index, so none of the ops is left, and the program run as it is gives
    the op program's outputs bit for bit."""
    from shardwise.run.collectives import using
    from shardwise.run.compiled import inline_custom_ops
    from shardwise.run.execute import Executable

    c = zoo.gpt2(batch=4)
    pm = sw.parallelize(c.model, sw.Mesh((1,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, input_placements={"input_ids": [S(0)]}, backend="torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # the shardwise ops a run dispatches
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "shardwise":
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    program = pm.plan.program_module(rank, guards=False)
    inlined, changed = inline_custom_ops(program)
    args = Executable(pm.plan).flat_locals(pm.shards, rank, c.example_inputs, c.example_targets)
    with using(pm.backend.comm, process_wide=True), torch.no_grad():
        with Ops() as before:
            want = program(*args)
        with Ops() as after:
            got = inlined(*args)
    same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    return before.seen, changed, after.seen, same


def test_compile_hands_dynamo_the_custom_ops_plain_calls():
    ((before, changed, after, same),) = spawn(_inlined_body, 1, timeout=300)
    # 2 blocks: attention forward and backward, and the mask's aligned index ops
    assert len(before) >= 8 and changed == len(before), (before, changed)
    assert after == [], after  # every call on the fast path: aten's kernels, nothing left for a Python frame
    assert same


# -- refused, with the fix named ---------------------------------------------------------------
def _ring(**kw):
    torch.manual_seed(0)
    block = zoo.Block(16, 2)
    x = torch.randn(2, 8, 16)
    return sw.parallelize(block, sw.Mesh((2,), ("sp",)), (x,), input_placements={0: [S(1)]},
                          loss_fn=lambda o: o.sum(), example_targets=(), attention="ring",
                          param_placements={n: [R()] for n, _ in block.named_parameters()}, **kw)


def test_threads_backend_refuses_compile():
    x = torch.randn(4, 6)
    with pytest.raises(ConfigError, match="backend='torch'"):
        sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2,), ("dp",)), (x,), compile=True)
    with pytest.raises(ConfigError, match="True or False"):
        sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2,), ("dp",)), (x,), compile="yes")


def test_dropout_compiles():
    c = zoo.gpt2(batch=4, dropout=True)
    pm = sw.parallelize(c.model, sw.Mesh((2,), ("dp",)), c.example_inputs, loss_fn=c.loss_fn,
                        example_targets=c.example_targets, input_placements={"input_ids": [S(0)], "labels": [S(0)]})
    assert any(n.op == "call_function" and n.target is torch.ops.aten.bernoulli.p for n in pm.plan.prop.gm.graph.nodes)
    assert check_compilable(pm.plan) is True


def _dropout_steps(rank, model, inputs, targets, loss_fn, placements, steps):
    """``model`` (with dropout, train mode) compiled, data parallel over 2 processes: loss and every
    gradient equal one device's for ``steps`` steps with SGD between them, the masks drawn from
    one device's stream (the default generator, seeded alike on both sides). The losses."""
    ref = copy.deepcopy(model).train()
    pm = sw.parallelize(model.train(), sw.Mesh((2,), ("dp",)), inputs, loss_fn=loss_fn, example_targets=targets,
                        input_placements=placements, backend="torch", compile=True, debug=False)
    opt, ref_opt = pm.optimizer(torch.optim.SGD, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1234)
    got = []
    for _ in range(steps):
        loss = pm.step(*inputs, *targets)
        got.append((loss, pm.gradients()))
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1234)
    for i, (loss, grads) in enumerate(got):
        ref_loss, ref_grads = single_step(ref, inputs, targets, loss_fn)
        assert_close(loss, ref_loss, f"rank {rank} step {i} loss")
        for n, g in ref_grads.items():
            assert_close(grads[n], g, f"rank {rank} step {i} grad of {n}")
        ref_opt.step()
    assert pm._executable(pm.plan)._compiled[rank].first_call_s > 0
    return [float(loss) for loss, _ in got]


def _mlp_dropout_body(rank, tmp):
    _inductor_cache(tmp)
    mlp = zoo.seeded_mlp(hidden=16)
    model = torch.nn.Sequential(mlp[0], mlp[1], torch.nn.Dropout(0.5), mlp[2])
    torch.manual_seed(0)
    x, y = torch.randn(5, 6), torch.randn(5, 3)  # 5 rows: 3 + 2, each rank's slice of one device's mask
    return _dropout_steps(rank, model, (x,), (y,), mse, {0: [S(0)]}, 3)


def test_compiled_mlp_with_dropout_matches_one_device_on_gloo(tmp_path):
    """One small program compiled per rank; three steps, new masks each step (the losses differ)."""
    losses = spawn(_mlp_dropout_body, 2, str(tmp_path), timeout=500)
    assert losses[0] == losses[1] and len(set(losses[0])) == 3, losses


def _gpt2_dropout_body(rank, tmp, steps):
    """GPT-2 with dropout 0.1 (embeddings, attention, residuals)."""
    _inductor_cache(tmp)
    c = zoo.gpt2(batch=4, dropout=True)
    return _dropout_steps(rank, c.model, c.example_inputs, c.example_targets, c.loss_fn,
                          {"input_ids": [S(0)], "labels": [S(0)]}, steps)


@pytest.mark.slow
def test_compiled_gpt2_with_dropout_matches_one_device_on_gloo(tmp_path):
    """Three steps; the losses differ from step to step (new masks each step, as on one device)."""
    losses = spawn(_gpt2_dropout_body, 2, str(tmp_path), 3, timeout=590)
    assert losses[0] == losses[1] and len(set(losses[0])) == 3, losses


def _local_forward_bn_body(rank, tmp):
    """inputs="local" (each rank passes its own rows), a forward-only plan (pm(x) under no_grad),
    and BatchNorm in train mode data parallel (its statistics all-reduced inside the local call),
    each compiled, against one device."""
    _inductor_cache(tmp)
    mesh, out = sw.Mesh((2,), ("dp",)), {}
    torch.manual_seed(0)
    X, Y = torch.randn(7, 6), torch.randn(7, 3)
    x, y = (X[:4], Y[:4]) if rank == 0 else (X[4:], Y[4:])  # torch.chunk: 4 + 3
    model = zoo.seeded_mlp()
    pm = sw.parallelize(copy.deepcopy(model), mesh, (x,), loss_fn=mse, example_targets=(y,), backend="torch",
                        inputs="local", input_placements={0: [S(0)]}, target_placements={0: [S(0)]}, compile=True)
    for step in range(3):  # the first eager with guards, then compiled; the third the local steady step's
        out.setdefault("steady", []).append(type(pm._steady).__name__)
        Xs, Ys = X + step, Y - step
        x, y = (Xs[:4], Ys[:4]) if rank == 0 else (Xs[4:], Ys[4:])
        loss = pm.step(x, y)
        ref_loss, ref_grads = single_step(model, (Xs,), (Ys,), mse)
        assert_close(loss, ref_loss, f"rank {rank} local loss, step {step}")
        for n, g in ref_grads.items():
            assert_close(pm.gradients()[n], g, f"rank {rank} local grad of {n}, step {step}")
        pm.zero_grad()
    with torch.no_grad():
        fwd = sw.parallelize(copy.deepcopy(model), mesh, (X,), backend="torch", input_placements={0: [S(0)]},
                             compile=True, debug=False)  # debug: a plan's first run is eager, with guards
        before = _graphs()
        assert_close(fwd(X), model(X), f"rank {rank} forward-only")
        out["forward_compiled"] = _graphs() > before
    torch.manual_seed(1)
    bn = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(bn)
    pm = sw.parallelize(bn, mesh, (X,), loss_fn=mse, example_targets=(Y,), backend="torch",
                        input_placements={0: [S(0)]}, target_placements={0: [S(0)]}, compile=True, debug=False)
    loss = pm.step(X, Y)
    ref_loss, ref_grads = single_step(ref, (X,), (Y,), mse)
    assert_close(loss, ref_loss, f"rank {rank} batchnorm loss")
    for n, g in ref_grads.items():
        assert_close(pm.gradients()[n], g, f"rank {rank} batchnorm grad of {n}")
    state = pm.state_dict()
    for n in ("1.running_mean", "1.running_var"):
        assert_close(state[n], ref.state_dict()[n], f"rank {rank} {n}")
    out["bn_calls"] = pm.plan.stats()["collective_calls"]
    return out


@pytest.mark.slow
def test_compiled_local_inputs_forward_only_and_batchnorm_match_one_device_on_gloo(tmp_path):
    for out in spawn(_local_forward_bn_body, 2, str(tmp_path), timeout=590):
        assert out["steady"][2] == "LocalSteadyStep", out
        assert out["forward_compiled"], out
        assert out["bn_calls"].get("all_reduce"), out  # the statistics, inside batch norm's local call


def test_ring_attention_is_refused_naming_the_op():
    pm = _ring()
    with pytest.raises(ConfigError, match=r"send_recv.*\n  fix: pass compile=False") as e:
        check_compilable(pm.plan)
    assert "attention" in str(e.value)
