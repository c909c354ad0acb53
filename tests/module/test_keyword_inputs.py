"""Keyword example inputs (``model(**batch)``, the Hugging Face habit) and targets that follow the
batch under ``inputs="local"`` (the DDP habit): exact against one device on threads and gloo.

    python -m pytest tests/module/test_keyword_inputs.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.run.launch import spawn
from tests.models import zoo
from tests.parallel.harness import assert_close

DP = sw.Mesh((2,), ("dp",))


def gpt2_batch(batch: int = 3, seq: int = 8):
    """A tiny Hugging Face GPT-2 and a keyword batch {"input_ids", "labels"} (3 rows: uneven on 2 ranks)."""
    model = zoo.gpt2(batch=batch, seq=seq).model
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(5))
    return model, {"input_ids": ids, "labels": ids.clone()}


def check_keyword_training(model, batch: dict, pm_batches: list, mesh=DP, steps: int = 2, **kw):
    """pm.step(**b) for each b of ``pm_batches`` (each rank's pieces or the full batch) equals
    ``model(**batch).loss`` on one device: the loss, every gradient, and the parameters after
    AdamW steps."""
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, mesh, pm_batches[0], **kw)
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for i in range(steps):
        loss = pm.step(**pm_batches[i % len(pm_batches)])
        ref.zero_grad()
        want = ref(**batch).loss
        want.backward()
        assert_close(loss, want.detach(), f"step {i} loss")
        grads = pm.gradients()
        for n, p in ref.named_parameters():
            assert_close(grads[n], p.grad, f"step {i} grad of {n}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    state = pm.state_dict()
    for n, p in ref.state_dict().items():
        assert_close(state[n], p, f"{n} after {steps} steps")
    return pm, ref


def test_hugging_face_keyword_batch_trains_exactly(tmp_path):
    """sw.parallelize(model, mesh, {"input_ids": ids, "labels": ids}, input_placements by keyword)
    and pm.step(**batch): loss, gradients and AdamW steps equal one device; pm(input_ids=ids)
    gives the logits; the checkpoint of a keyword-planned module loads into another."""
    model, batch = gpt2_batch()
    placements = {"input_ids": [S(0)], "labels": [S(0)]}
    pm, ref = check_keyword_training(model, batch, [batch], input_placements=placements)
    logits = pm(input_ids=batch["input_ids"]).logits
    assert_close(logits, ref(input_ids=batch["input_ids"]).logits.detach(), "forward logits")
    assert "step" in pm.plan.summary() and pm.plan.stats()["comm_bytes"] > 0
    pm.save(tmp_path / "ck")
    other, _ = gpt2_batch()
    again = sw.parallelize(other, DP, batch, input_placements=placements)
    again.load(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), pm.state_dict().values()))


def test_keyword_inputs_local_pieces_on_threads():
    """inputs="local" with keyword inputs: each keyword's value is the list of the ranks' pieces."""
    model, batch = gpt2_batch()
    pieces = {k: [v[:2], v[2:]] for k, v in batch.items()}  # torch.chunk: 2 + 1 rows
    check_keyword_training(model, batch, [pieces], inputs="local",
                           input_placements={"input_ids": [S(0)], "labels": [S(0)]})


def test_positional_and_keyword_inputs_together():
    """example_inputs a tuple and example_kwargs a dict: model(x, mask=m); targets positional."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, x, mask=None):
            return self.fc(x) * mask

    torch.manual_seed(0)
    model, x, m, y = Masked(), torch.randn(5, 6), (torch.rand(5, 3) > 0.3).float(), torch.randn(5, 3)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, DP, (x,), example_kwargs={"mask": m}, loss_fn=torch.nn.functional.mse_loss,
                        example_targets=(y,), input_placements={"x": [S(0)], "mask": [S(0)]})
    loss = pm.step(x, y, mask=m)
    want = torch.nn.functional.mse_loss(ref(x, mask=m), y)
    want.backward()
    assert_close(loss, want.detach(), "loss")
    for n, g in pm.gradients().items():
        assert_close(g, dict(ref.named_parameters())[n].grad, f"grad of {n}")
    assert_close(pm(x, mask=m), ref(x, mask=m).detach(), "forward")


def test_keyword_input_errors_are_named():
    model, batch = gpt2_batch()
    with pytest.raises(sw.ShardingError, match="did you mean 'input_ids'"):
        sw.parallelize(model, DP, batch, input_placements={"input_idz": [S(0)]})
    with pytest.raises(sw.ShardingError, match="example_kwargs is given too"):
        sw.parallelize(model, DP, batch, example_kwargs={"labels": batch["labels"]})
    with pytest.raises(sw.ShardingError, match="keyword input 'labels' must be a list of 2"):
        sw.parallelize(model, DP, {"input_ids": [batch["input_ids"][:2], batch["input_ids"][2:]],
                                   "labels": batch["labels"]}, inputs="local", input_placements={"input_ids": [S(0)]})


# -- targets follow the batch (inputs="local", the DDP habit) ---------------------------------------
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _data(batch: int = 7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


def _ddp_habit_rank(rank):
    """Rank ``rank``'s own rows (4 + 3), only the input's placement named."""
    torch.manual_seed(0)
    model = _mlp()
    X, Y = _data()
    x, y = (X[:4], Y[:4]) if rank == 0 else (X[4:], Y[4:])
    pm = sw.parallelize(model, DP, (x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,),
                        backend="torch", inputs="local", input_placements={0: [S(0)]})
    loss = pm.step(x, y)
    model, batch = gpt2_batch()  # keyword inputs on the torch backend: every rank the full batch
    hf = sw.parallelize(model, DP, batch, backend="torch", input_placements={"input_ids": [S(0)], "labels": [S(0)]})
    return {"loss": loss, "grads": pm.gradients(), "summary": pm.plan.summary(), "hf_loss": hf.step(**batch),
            "hf_grads": hf.gradients()}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_local_targets_follow_the_batch_on_gloo():
    """2 gloo processes, inputs="local", uneven local batches (4 + 3 rows), only the input's
    placement named: the target takes the batch placement (the plan says so) and the loss and
    gradients equal one device. And a Hugging Face keyword batch on the torch backend."""
    outs = spawn(_ddp_habit_rank, 2, timeout=240)
    torch.manual_seed(0)
    ref = _mlp()
    X, Y = _data()
    want = torch.nn.functional.mse_loss(ref(X), Y)
    want.backward()
    for rank, got in enumerate(outs):
        assert_close(got["loss"], want.detach(), f"rank {rank} loss")
        for n, p in ref.named_parameters():
            assert_close(got["grads"][n], p.grad, f"rank {rank} grad of {n}")
        assert "# note: target 0 follows the batch of input 0: [Shard(0)]" in got["summary"], got["summary"][:400]
    model, batch = gpt2_batch()
    want = model(**batch).loss
    want.backward()
    for rank, got in enumerate(outs):
        assert_close(got["hf_loss"], want.detach(), f"rank {rank} keyword-batch loss")
        for n, p in model.named_parameters():
            assert_close(got["hf_grads"][n], p.grad, f"rank {rank} keyword-batch grad of {n}")


def test_local_targets_follow_the_batch_on_threads_and_conflicts_raise():
    """The same on threads (lists of pieces); inputs sharded on different mesh dims whose local
    sizes both match the target's rows leave it ambiguous: a ShardingError asks to name it."""
    torch.manual_seed(0)
    model, (X, Y) = _mlp(), _data()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, DP, ([X[:4], X[4:]],), loss_fn=torch.nn.functional.mse_loss,
                        example_targets=([Y[:4], Y[4:]],), inputs="local", input_placements={0: [S(0)]})
    loss = pm.step([X[:4], X[4:]], [Y[:4], Y[4:]])
    want = torch.nn.functional.mse_loss(ref(X), Y)
    want.backward()
    assert_close(loss, want.detach(), "loss")
    assert "follows the batch of input 0" in pm.plan.summary()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, a, b):
            return self.fc(a) + self.fc(b)

    mesh = sw.Mesh((2, 2), ("dp", "sp"))
    a, b, y = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 5)
    local = [a] * 4
    with pytest.raises(sw.ShardingError, match="name its placements"):
        sw.parallelize(Two(), mesh, (local, [b] * 4), loss_fn=lambda o, t: o.sum() + t.sum(),
                       example_targets=([y] * 4,), inputs="local",
                       input_placements={"a": {"dp": S(0)}, "b": {"sp": S(0)}})


def test_plan_command_takes_a_factory_of_keyword_inputs(tmp_path, capsys):
    """shardwise plan FILE:build where build() returns keyword example inputs (a Hugging Face batch)."""
    from shardwise.cli import main

    (tmp_path / "kw.py").write_text(
        "import torch\nfrom tests.module.test_keyword_inputs import gpt2_batch\n\n"
        "def build():\n    model, batch = gpt2_batch()\n    return model, batch\n")
    assert main(["plan", f"{tmp_path}/kw.py:build", "--mesh", "2", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    data = json.loads(out[out.index("{"):])
    assert data["stats"]["comm_bytes"] > 0 and "input_ids" in json.dumps(data)
