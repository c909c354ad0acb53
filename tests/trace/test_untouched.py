"""Tracing leaves no trace (trace/untouched.py): the user's module as it was found, no FakeTensor
reachable from it afterwards, and a random-state change inside the step refused with its line."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.trace import trace_step
from shardwise.trace.errors import TraceError
from shardwise.trace.recompute import RECOMPUTE
from shardwise.trace.untouched import fake_tensors_in

from ..parallel.harness import assert_close


class Caching(nn.Module):
    """Keeps what its first forward computes on itself: an attribute, a dict entry, a list entry."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cache = None
        self.seen: list = []
        self.table: dict = {}

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.full((4,), 2.0)
        if "scale" not in self.table:
            self.table["scale"] = torch.arange(4.0) + 1
        self.seen.append(x.shape[0])
        return self.lin(x) * self.cache * self.table["scale"]


def test_a_forward_that_caches_on_itself_leaves_no_fake_tensor_and_trains_exactly():
    torch.manual_seed(0)
    model, x, y = Caching(), torch.randn(5, 4), torch.randn(5, 4)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [sw.Shard(0)]},
                        loss_fn=F.mse_loss)
    loss = pm.step(x, y)
    assert fake_tensors_in(model) == []
    assert model.cache is None and model.table == {} and model.seen == []
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    grads = pm.gradients()
    for n, p in ref.named_parameters():
        assert_close(grads[n], p.grad, f"grad of {n}")
    # the user's own call and the forward-only call: real tensors, one device's numbers
    with torch.no_grad():
        want = copy.deepcopy(ref)(x)
        mine = model(x)
        assert not isinstance(mine, torch._subclasses.FakeTensor)
        assert_close(mine, want, "model(x) after parallelize")
        got = pm(x)
    assert not isinstance(got, torch._subclasses.FakeTensor)
    assert_close(got, want, "pm(x)")
    assert fake_tensors_in(model) == []


def test_fake_tensor_walker_finds_nested_ones():
    """The check the guard runs after restoring (and tests use): it must see a fake inside containers
    and plain objects, or the guard could not fail."""
    model = nn.Linear(2, 2)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ones(2)

    class Holder:
        pass

    holder = Holder()
    holder.inner = {"a": [1, fake]}
    model.other = holder
    assert mode is not None and fake_tensors_in(model) == ["model.other.inner['a'][1]"]


class Reseeding(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.how = how

    def forward(self, x):
        if self.how == "manual_seed":
            torch.manual_seed(42)
        elif self.how == "set_rng_state":
            torch.set_rng_state(torch.get_rng_state())
        elif self.how == "generator":
            torch.default_generator.manual_seed(3)
        if self.how == "fork_rng":
            with torch.random.fork_rng():
                return (F.dropout(x, 0.5) * self.w).sum()
        return (F.dropout(x, 0.5) * self.w).sum()


@pytest.mark.parametrize("how", ["manual_seed", "set_rng_state", "fork_rng", "generator"])
def test_a_random_state_change_inside_the_step_is_refused_and_the_state_kept(how):
    torch.manual_seed(0)
    model, x = Reseeding(how), torch.randn(6, 4)
    before = torch.get_rng_state()
    with pytest.raises(TraceError) as err:
        sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [sw.Shard(0)]})
    assert torch.equal(torch.get_rng_state(), before)
    assert "before pm.step" in err.value.fix
    if how != "generator":  # the generator's own method is not patched: found by the state it left
        assert "test_untouched.py" in str(err.value)


def test_dropout_with_the_seed_outside_the_step_equals_one_device():
    torch.manual_seed(0)
    model, x = Reseeding("none"), torch.randn(6, 4)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [sw.Shard(0)]})
    _seeded_steps(pm, ref, x, seed=7)


def _seeded_steps(pm, ref, x, seed: int, steps: int = 2):
    """Each step seeded alike before ``pm.step`` and one device's: loss, every gradient, and the
    generator after the step (a draw of three numbers) equal."""
    for step in range(steps):
        torch.manual_seed(seed + step)
        loss = pm.step(x)
        after = torch.rand(3)
        torch.manual_seed(seed + step)
        ref.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), f"step {step} loss")
        grads = pm.gradients()
        for n, p in ref.named_parameters():
            assert_close(grads[n], p.grad, f"step {step} grad of {n}")
        pm.zero_grad()
        assert torch.equal(after, torch.rand(3)), "the generator after the step is not one device's"


class CheckpointedDropout(nn.Module):
    """torch.utils.checkpoint around dropout: the recompute must draw the forward's masks again."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def _block(self, i, x):
        return F.dropout(self.blocks[i](x), 0.5) + F.dropout(x, 0.3) * x

    def forward(self, x):
        for i in range(len(self.blocks)):
            x = checkpoint(self._block, i, x, use_reentrant=False)
        return x.square().sum()


def test_the_traced_recompute_draws_nothing_of_its_own():
    traced = trace_step(CheckpointedDropout(), (torch.randn(5, 4),))
    drawn = [n for n in traced.gm.graph.nodes
             if n.op == "call_function" and torch.Tag.nondeterministic_seeded in n.target.tags]
    assert drawn and not any(RECOMPUTE in n.meta for n in drawn)
    assert any("random draw(s) in them read forward's" in note for note in traced.notes), traced.notes


@pytest.mark.parametrize("mesh, placements", [((2,), [sw.Shard(0)]), ((3,), [sw.Shard(1)])])
def test_checkpointed_dropout_recomputes_the_forward_masks(mesh, placements):
    torch.manual_seed(0)
    model, x = CheckpointedDropout(), torch.randn(5, 4, requires_grad=False)
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh(mesh, ("dp",)), (x,), input_placements={0: placements})
    _seeded_steps(pm, ref, x, seed=11)  # a recompute drawing anew: other masks, a stream moved twice


def test_phi3_long_rope_leaves_no_fake_tensor_and_forward_calls_equal_one_device():
    """Phi-3 with long-rope scaling (sequence past the original context: the long factors) under data
    parallelism: trained exactly, then model(...) and pm(...) in eval return one device's logits."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
                     use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    model = Phi3ForCausalLM(cfg)
    ids = torch.randint(0, 64, (5, 24))
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (), example_kwargs={"input_ids": ids, "labels": ids},
                        input_placements={"input_ids": [sw.Shard(0)], "labels": [sw.Shard(0)]})
    loss = pm.step(input_ids=ids, labels=ids)
    assert fake_tensors_in(model) == []
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), "loss")
    grads = pm.gradients()
    for n, p in ref.named_parameters():
        assert_close(grads[n], p.grad, f"grad of {n}")
    model.eval(), pm.eval(), ref.eval()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert_close(model(input_ids=ids).logits, want, "model(...) after parallelize")
        assert_close(pm(input_ids=ids).logits, want, "pm(...)")
    assert fake_tensors_in(model) == []
