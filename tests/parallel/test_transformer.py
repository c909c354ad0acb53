"""Transformer LM (zoo.TinyLM: embeddings, pre-LN causal SDPA blocks, LM head, cross-entropy):
data, Megatron tensor and data x tensor parallelism against one device, even and uneven.

    python -m pytest tests/parallel/test_transformer.py -q --durations=0

Every test checks the loss and every gradient for three steps and the parameters after three
AdamW steps through ``pm.optimizer`` (tests/parallel/harness.py).
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S
from tests.models import zoo

from .harness import check_training
from .recipes import megatron_transformer, n_trainable, on, tokens

# The key bias's gradient is zero in exact arithmetic (softmax ignores a per-query shift), so
# it is float noise that differs with the summation order; Adam's m / sqrt(v) would turn that
# noise into lr-sized steps. eps well above the noise and a smaller lr keep AdamW comparable.
ADAM = dict(steps=3, lr=1e-3, optim_kwargs={"eps": 1e-6})


def lm(batch=4, seq=8, **dims):
    """zoo.transformer, or a TinyLM with other dims (seeded like the zoo)."""
    if not dims:
        return zoo.transformer(batch=batch, seq=seq)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = zoo.TinyLM(**dims)
    vocab = dims.get("vocab", 64)
    return zoo.Case(model, (tokens((batch, seq), vocab, 1),), (tokens((batch, seq), vocab, 2),), zoo.ce_loss)


def collectives(pm):
    return pm.plan.stats()["collectives"]


def test_data_parallel():
    model, x, y, loss_fn = lm(batch=4)
    pm = check_training(model, sw.Mesh((2,), ("dp",)), x, y, loss_fn, input_placements={0: [S(0)]}, **ADAM)
    # one reduction per parameter gradient, one for the loss, one of cross_entropy's total weight
    # (inside nll_loss: plan.stats()["op_collectives"]): nothing else
    assert collectives(pm) == {"all_reduce": n_trainable(model) + 2}, pm.plan.summary()


def test_data_parallel_uneven_batch():
    model, x, y, loss_fn = lm(batch=5)
    check_training(model, sw.Mesh((2,), ("dp",)), x, y, loss_fn, input_placements={0: [S(0)]}, **ADAM)


def test_uneven_batch_stays_data_parallel():
    """Batch 5 on 2 ranks needs no more communication than batch 4: the gradient reductions."""
    model, x, y, loss_fn = lm(batch=5)
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), x, loss_fn=loss_fn, input_placements={0: [S(0)]},
                        example_targets=y)
    assert set(collectives(pm)) == {"all_reduce"}, pm.plan.summary()


def test_megatron_tensor_parallel():
    model, x, y, loss_fn = lm()
    check_training(model, sw.Mesh((2,), ("tp",)), x, y, loss_fn, param_placements=megatron_transformer(), **ADAM)


def test_megatron_uneven_hidden_on_four_ranks():
    # hidden 6 (2 heads of 3) on 4 ranks: qkv rows 18 -> 5,5,5,3; heads 2 -> 1,1,0,0; MLP 24 -> 6 each
    model, x, y, loss_fn = lm(vocab=16, dim=6, heads=2, layers=1, max_len=8)
    check_training(model, sw.Mesh((4,), ("tp",)), x, y, loss_fn, param_placements=megatron_transformer(1), **ADAM)


def test_data_by_tensor_parallel_2x2():
    model, x, y, loss_fn = lm(batch=4)
    pm = check_training(model, sw.Mesh((2, 2), ("dp", "tp")), x, y, loss_fn,
                        input_placements={0: {"dp": S(0)}}, param_placements=on("tp", megatron_transformer()), **ADAM)
    model.load_state_dict(pm.state_dict())  # the trained weights
    torch.testing.assert_close(pm(*x), model(*x), rtol=1e-4, atol=1e-5)


def test_data_by_tensor_parallel_2x2_uneven_batch():
    model, x, y, loss_fn = lm(batch=3, seq=5)
    check_training(model, sw.Mesh((2, 2), ("dp", "tp")), x, y, loss_fn,
                   input_placements={0: [S(0), R()]}, param_placements=on("tp", megatron_transformer()), **ADAM)


def test_forward_matches_single_device():
    model, x, _, loss_fn = lm(batch=5, seq=7)
    pm = sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), x, loss_fn=loss_fn,
                        input_placements={0: {"dp": S(0)}}, param_placements=on("tp", megatron_transformer()))
    torch.testing.assert_close(pm(*x), model(*x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs, needles", [
    (dict(input_placements={"idx": [S(0)]}), ["input 'idx'", "expects exactly one placement per mesh dim", "fix:"]),
    (dict(input_placements={"idx": [S(2), R()]}), ["input 'idx'", "out of range", "fix:"]),
    (dict(param_placements={"blocks.0.qkv.wieght": [R(), S(0)]}), ["blocks.0.qkv.weight", "fix:"]),
    (dict(input_placements={"idx": {"sp": S(1)}}), ["'idx'", "unknown mesh dim name 'sp'", "fix:"]),
    (dict(input_placements={"ids": [S(0), R()]}), ["'ids'", "not an argument of forward", "'idx'", "fix:"]),
])
def test_bad_specs_fail_early(kwargs, needles):
    model, x, _, loss_fn = lm()
    with pytest.raises(sw.ShardingError) as err:
        sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), x, loss_fn=loss_fn, **kwargs)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"
