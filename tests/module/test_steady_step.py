"""The steady step (module/steady.py): after a step, the next ones on arguments of the same
signature with the model's flags unchanged skip the plan lookup (from the third: the first
runs with the debug shape guards); anything that would pick
another plan (shape, dtype, a submodule's training flag, a parameter frozen, the planner's
placements, keyword or non-plain inputs) takes the full path. Exact against one device on the
threads backend and on two gloo processes (uneven batch, a sequence split at dim 1).

    python -m pytest tests/module/test_steady_step.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn
from tests.models import zoo
from tests.parallel.harness import assert_close, single_step


def mse(out, y):
    return ((out - y) ** 2).mean()


def _batch(seed: int, n: int = 5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def _count_lookups(pm, monkeypatch) -> list:
    """Every full-path plan lookup of ``pm`` (Planning.planned_step) appends to the list returned."""
    calls = []
    lookup = pm.planning.planned_step
    monkeypatch.setattr(pm.planning, "planned_step", lambda batch: calls.append(1) or lookup(batch))
    return calls


def _check_step(pm, ref, x, y, what: str, seed: int = 0, given=None) -> None:
    """One step of ``pm`` and of the one-device ``ref`` from the same generator state (dropout
    draws one device's masks), compared. ``given``: ``pm.step``'s arguments where they are not
    the whole batch (inputs="local": this rank's pieces)."""
    torch.manual_seed(seed)
    loss = pm.step(*(given or (x, y)))
    torch.manual_seed(seed)
    want, grads = single_step(ref, (x,), (y,), mse)
    assert_close(loss, want, f"{what}: loss")
    got = pm.gradients()
    for n, g in grads.items():
        assert_close(got[n], g, f"{what}: grad of {n}")
    pm.zero_grad()


def test_steps_after_the_first_skip_the_lookup_and_stay_exact(monkeypatch):
    model = zoo.seeded_mlp()
    ref = copy.deepcopy(model)
    x, y = _batch(0)
    pm = sw.parallelize(model, sw.Mesh((3,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    _check_step(pm, ref, x, y, "first step")  # (with the debug shape guards)
    assert pm._steady is None
    _check_step(pm, ref, *_batch(1), "second step")  # (the plain program, looked up)
    assert pm._steady is not None and pm._steady.plan is pm.plan
    lookups = _count_lookups(pm, monkeypatch)
    for i in range(2, 5):  # new values each step, same signature
        _check_step(pm, ref, *_batch(i), f"step {i}")
    assert lookups == []


def test_gradients_accumulate_across_steady_steps():
    """Without zero_grad each step adds into .grad, as loss.backward() again does."""
    model = zoo.seeded_mlp()
    ref = copy.deepcopy(model)
    (x0, y0), (x1, y1) = _batch(0), _batch(1)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x0,), loss_fn=mse, input_placements={0: [S(0)]})
    pm.step(x0, y0)
    pm.step(x1, y1)
    pm.step(x0, y0)
    assert pm._steady is not None
    for x, y in ((x0, y0), (x1, y1), (x0, y0)):
        mse(ref(x), y).backward()
    got = pm.gradients()
    for n, p in ref.named_parameters():
        assert_close(got[n], p.grad, f"accumulated grad of {n}")


def _freeze_first(pm, ref):
    pm.model[0][0].weight.requires_grad_(False)
    ref[0][0].weight.requires_grad_(False)


def _bump_changes(pm, ref):
    pm.planning.changes += 1  # as Planning._adopt does when the planner moves a placement


CHANGES = {  # name: (what changes in both models, the next step's arguments from the first's)
    "batch size": (lambda pm, ref: None, lambda x, y: (x[:4], y[:4])),
    "eval": (lambda pm, ref: (pm.eval(), ref.eval()), None),
    "one submodule's eval": (lambda pm, ref: (pm.model[1].eval(), ref[1].eval()), None),
    "a parameter frozen": (_freeze_first, None),
    "placements changed": (_bump_changes, None),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_that_picks_another_plan_takes_the_full_path(change, monkeypatch):
    """Dropout 0.5: a plan traced in training mode draws masks, one in eval mode does not, so
    the wrong plan after eval() would give another loss."""
    model = torch.nn.Sequential(zoo.seeded_mlp(), torch.nn.Dropout(0.5))
    ref = copy.deepcopy(model)
    x, y = _batch(0, n=6)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    _check_step(pm, ref, x, y, "first step", seed=1)
    _check_step(pm, ref, x, y, "second step", seed=3)
    steady = pm._steady
    alter, args = CHANGES[change]
    alter(pm, ref)
    x2, y2 = (x, y) if args is None else args(x, y)
    assert steady((x2, y2), {}) is None, f"{change}: the steady step took arguments of another plan"
    lookups = _count_lookups(pm, monkeypatch)
    _check_step(pm, ref, x2, y2, f"after {change}", seed=2)
    assert lookups, f"{change}: the step did not look its plan up"


def test_other_arguments_take_the_full_path():
    x, y = _batch(0, n=4)
    pm = sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, input_placements={0: [S(0)]})
    pm.step(x, y)
    pm.step(x, y)
    steady = pm._steady
    assert steady((x, y), {}) is not None  # (this runs a step: the arguments are taken)
    assert steady((torch.nn.Parameter(x), y), {}) is None  # a tensor subclass: the pytree path
    assert steady((x,), {}) is None
    assert steady((x, y, y), {}) is None
    assert steady((x, y), {"extra": x}) is None
    assert steady((x.double(), y), {}) is None


def _gloo_body(rank: int) -> dict:
    """Two gloo ranks: an uneven batch split (7 rows) and a sequence split at dim 1 (5 tokens),
    four steps of new values each, against one device."""
    out = {}
    cases = {"uneven batch": ((7, 6), 0), "sequence dim 1": ((2, 5, 6), 1)}
    for name, (shape, dim) in cases.items():
        model = zoo.seeded_mlp()
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(shape, generator=g), torch.randn(*shape[:-1], 3, generator=g)) for _ in range(4)]
        pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (batches[0][0],), loss_fn=mse, backend="torch",
                            input_placements={0: [S(dim)]}, target_placements={0: [S(dim)]})
        steady_runs = 0
        for i, (x, y) in enumerate(batches):
            steady_runs += pm._steady is not None
            _check_step(pm, ref, x, y, f"{name} step {i}")
        out[name] = steady_runs
    return out


def test_steady_steps_on_two_gloo_processes_equal_one_device():
    for rank, runs in enumerate(spawn(_gloo_body, 2, timeout=300)):
        assert runs == {"uneven batch": 2, "sequence dim 1": 2}, f"rank {rank}: {runs}"


# -- inputs="local": each rank's own pieces ------------------------------------------------------
def _pieces(t, rows):
    return [t[a:b] for a, b in rows]


def test_local_pieces_take_the_steady_step_and_replicas_are_still_checked(monkeypatch):
    """dp x tp on the threads backend: tp peers hold the same piece, so each steady step still
    compares their checksums; a batch whose split moves takes the full path."""
    model = zoo.seeded_mlp()
    ref = copy.deepcopy(model)
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    rows = [(0, 3), (0, 3), (3, 5), (3, 5)]
    x, y = _batch(0)
    pm = sw.parallelize(model, mesh, (_pieces(x, rows),), loss_fn=mse, inputs="local",
                        example_targets=(_pieces(y, rows),), input_placements={0: {"dp": S(0)}},
                        target_placements={0: {"dp": S(0)}})

    def check(x, y, rows, what):
        _check_step(pm, ref, x, y, what, given=(_pieces(x, rows), _pieces(y, rows)))

    check(x, y, rows, "first step")
    check(*_batch(1), rows, "second step")
    assert type(pm._steady).__name__ == "LocalSteadyStep"
    lookups = _count_lookups(pm, monkeypatch)
    for i in range(2, 4):
        check(*_batch(i), rows, f"step {i}")
    assert lookups == []
    x4, y4 = _batch(4, n=4)
    check(x4, y4, [(0, 2), (0, 2), (2, 4), (2, 4)], "4 rows")  # rank 0's piece shrank: planned anew
    assert lookups
    check(*_batch(5), rows, "5 rows again")
    check(*_batch(6), rows, "5 rows, steady")
    x, y = _batch(7)
    xs, ys = _pieces(x, rows), _pieces(y, rows)
    xs[1] = xs[1] + 1  # rank 1 holds rank 0's chunk, with other values
    with pytest.raises(sw.ShardingError, match=r"ranks 0 and 1 hold the same chunk.*rank 1 differs"):
        pm.step(xs, ys)


def _gloo_local_body(rank: int) -> dict:
    """Two gloo ranks with their own pieces, dropout 0.5: 8 rows, then 7 (rank 0's 4 rows are as
    before, only rank 1's shrink: rank 0 must not take the steady step alone), then 8 again;
    against one device with the same masks. Then a batch every rank holds whole, other values
    on rank 1 after three steps: refused by both."""
    model = torch.nn.Sequential(zoo.seeded_mlp(), torch.nn.Dropout(0.5))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    sizes = [8, 8, 8, 7, 8, 8]
    batches = [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for n in sizes]
    mine = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches]
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (mine[0][0],), loss_fn=mse, backend="torch",
                        inputs="local", example_targets=(mine[0][1],), input_placements={0: [S(0)]},
                        target_placements={0: [S(0)]})
    lookups, kinds = [], []
    plan_of = pm.planning.planned_step
    pm.planning.planned_step = lambda batch: lookups.append(1) or plan_of(batch)
    for i, ((x, y), (xl, yl)) in enumerate(zip(batches, mine)):
        steady, before = pm._steady, len(lookups)
        _check_step(pm, ref, x, y, f"rank {rank} step {i}", seed=10 + i, given=(xl, yl))
        kinds.append(type(steady).__name__ + ("" if len(lookups) == before else " (looked up)"))

    x, y = batches[0]
    whole = sw.parallelize(zoo.seeded_mlp(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=mse, backend="torch",
                           inputs="local", example_targets=(y,))
    for _ in range(3):
        whole.step(x, y)
    try:
        whole.step(x + rank, y)
        kinds.append("other values taken")
    except sw.ShardingError as e:
        kinds.append("refused: " + ("rank 1 differs" if "rank 1 differs" in str(e) else str(e)))
    return kinds


def test_local_pieces_on_two_gloo_processes_agree_before_the_steady_step():
    for rank, kinds in enumerate(spawn(_gloo_local_body, 2, timeout=300)):
        assert kinds[2] == "LocalSteadyStep", f"rank {rank}: {kinds}"
        assert kinds[3] == "LocalSteadyStep (looked up)", f"rank {rank}: the 7-row step was not planned: {kinds}"
        assert kinds[5] == "LocalSteadyStep", f"rank {rank}: {kinds}"
        assert kinds[6] == "refused: rank 1 differs", f"rank {rank}: {kinds}"
