"""Hugging Face GPT-2 and Llama (tiny configs, zoo): data, Megatron tensor and data x tensor
parallelism against one device; the collectives of Megatron; early errors named by input.

    python -m pytest tests/parallel/test_hf.py -q --durations=0

The zoo passes ``labels`` positionally, so ``example_inputs`` is ``(input_ids, None, ...,
labels)``, the model returns its own loss (``loss_fn=None``) and both ``input_ids`` and
``labels`` are inputs placed by name.
"""
import pytest
import torch

import shardwise as sw
from shardwise import Replicate as R, Shard as S
from shardwise.core.cost import CostModel
from tests.models import zoo

from .harness import check_training
from .recipes import MEGATRON, collectives_by_phase, megatron_ok, n_trainable, on, program_collectives

MODELS = ["gpt2", "llama"]
N_LAYERS = 2  # zoo configs
# GPT-2's key bias has a gradient that is zero in exact arithmetic (float noise); see
# test_transformer.ADAM.
ADAM = dict(steps=3, lr=1e-3, optim_kwargs={"eps": 1e-6})


def case(name, batch=2, seq=8):
    return zoo.MODELS[name](batch=batch, seq=seq)


def data_spec(placement):
    return {"input_ids": placement, "labels": placement}


def train(name, mesh, batch=2, seq=8, **kwargs):
    model, inputs, targets, loss_fn = case(name, batch, seq)
    return check_training(model, mesh, inputs, targets, loss_fn, **ADAM, **kwargs), model


@pytest.mark.parametrize("name", MODELS)
def test_data_parallel(name):
    pm, model = train(name, sw.Mesh((2,), ("dp",)), batch=4, input_placements=data_spec([S(0)]))
    # one reduction per parameter gradient, one for the loss, one of cross_entropy's count of
    # targets (trace/microbatch.count_targets: a program call, no op collective): nothing else
    assert pm.plan.stats()["collectives"] == {"all_reduce": n_trainable(model) + 2}, pm.plan.summary()
    assert pm.plan.stats()["op_collectives"] == {}


@pytest.mark.parametrize("name", MODELS)
def test_data_parallel_uneven_batch(name):
    train(name, sw.Mesh((2,), ("dp",)), batch=5, input_placements=data_spec([S(0)]))


@pytest.mark.parametrize("name", MODELS)
def test_megatron_tensor_parallel(name):
    train(name, sw.Mesh((2,), ("tp",)), param_placements=MEGATRON[name](N_LAYERS))


@pytest.mark.parametrize("name", MODELS)
def test_data_by_tensor_parallel_2x2(name):
    train(name, sw.Mesh((2, 2), ("dp", "tp")), batch=4, input_placements=data_spec({"dp": S(0)}),
          param_placements=on("tp", MEGATRON[name](N_LAYERS)))


# The ILP planner under a cost model of the large-model regime (no latency: bytes decide). At
# these toy sizes with 5 us per message, gathering the 12 weight shards once is (correctly)
# cheaper than 8 activation all-reduces; the greedy propagation carries backward partial sums
# into the norm backward and pays an all-reduce per norm weight instead.
LARGE_MODEL = CostModel(latency=0)


@pytest.mark.parametrize("name", MODELS)
def test_megatron_collectives(name):
    """Megatron: per layer 2 all-reduces in forward (after the attention output projection and
    the MLP down projection) and 2 in backward (the input gradients of the column-parallel
    projections), or a reduce-scatter + all-gather pair in place of each; nothing else. The
    embedding and the (tied, for GPT-2) head are replicated here, so they add none. GPT-2's
    fused c_attn is Shard(1, groups=3), so every rank holds whole heads of q, k and v."""
    model, inputs, _, _ = case(name)
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), inputs, param_placements=MEGATRON[name](N_LAYERS),
                        planner="ilp", cost_model=LARGE_MODEL)
    plan = pm.plan
    phases = collectives_by_phase(plan)
    assert megatron_ok(phases["forward"], N_LAYERS), f"forward {dict(phases['forward'])}\n{plan.summary()}"
    assert megatron_ok(phases["backward"], N_LAYERS), f"backward {dict(phases['backward'])}\n{plan.summary()}"
    stats = plan.stats()["collectives"]
    assert stats == dict(phases["forward"] + phases["backward"])
    for rank in range(2):  # the per-rank programs carry exactly those collectives
        assert program_collectives(plan.program(rank)) == phases["forward"] + phases["backward"], plan.program(rank)


@pytest.mark.parametrize("name", MODELS)
def test_state_dict_round_trip(name):
    model, inputs, _, _ = case(name)
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), inputs, param_placements=MEGATRON[name](N_LAYERS))
    full = model.state_dict()
    got = pm.state_dict()
    assert set(got) == set(full)
    for k, v in full.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    pm.load_state_dict({k: v + 1 for k, v in full.items()})
    for k, v in pm.state_dict().items():
        torch.testing.assert_close(v, full[k] + 1, rtol=0, atol=0)


PARAM = {"gpt2": "transformer.h.0.attn.c_attn.weight", "llama": "model.layers.0.self_attn.q_proj.weight"}
TYPO = {"gpt2": "transformer.h.0.attn.c_atn.weight", "llama": "model.layers.0.self_attn.q_prj.weight"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("what", ["placements_count", "shard_dim", "param_shard_dim", "param_name", "mesh_dim_name",
                                  "input_name", "labels_count"])
def test_bad_specs_fail_early(name, what):
    """A wrong spec fails in parallelize with a ShardingError naming the input and a fix."""
    kwargs, needles = {
        "placements_count": (dict(input_placements={"input_ids": [S(0)]}),
                             ["'input_ids'", "expects exactly one placement per mesh dim"]),
        "shard_dim": (dict(input_placements={"input_ids": [S(2), R()]}), ["'input_ids'", "out of range"]),
        "param_shard_dim": (dict(param_placements={PARAM[name]: [R(), S(2)]}), [repr(PARAM[name]), "out of range"]),
        "param_name": (dict(param_placements={TYPO[name]: [R(), S(0)]}), [repr(TYPO[name]), repr(PARAM[name])]),
        "mesh_dim_name": (dict(input_placements={"input_ids": {"pp": S(0)}}),
                          ["'input_ids'", "unknown mesh dim name 'pp'"]),
        "input_name": (dict(input_placements={"input_id": [S(0), R()]}),
                       ["'input_id'", "not an argument of forward", "'input_ids'"]),
        "labels_count": (dict(input_placements={"labels": [S(0), R(), R()]}),
                         ["'labels'", "expects exactly one placement per mesh dim"]),
    }[what]
    model, inputs, _, _ = case(name)
    with pytest.raises(sw.ShardingError) as err:
        sw.parallelize(model, sw.Mesh((2, 2), ("dp", "tp")), inputs, **kwargs)
    msg = str(err.value)
    for needle in needles + ["fix:"]:
        assert needle in msg, f"{needle!r} not in: {msg}"
