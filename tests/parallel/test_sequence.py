"""Sequence-sharded inputs against one device: the sequence at dim 1 ([batch, seq] tokens) and
at dim 0 ([seq, batch] tokens, through a seq-first wrapper), lengths not divisible by the mesh.

    python -m pytest tests/parallel/test_sequence.py -q --durations=0

Attention uses its batch/head strategies, so the planner gathers the sequence before attention
where it must; what is checked is exactness (loss, every gradient, three AdamW steps).
"""
import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from tests.models import zoo

from .harness import check_training
from .recipes import HFSeqFirst, SeqFirst

ADAM = dict(steps=3, lr=1e-3, optim_kwargs={"eps": 1e-6})  # see test_transformer.ADAM
SEQ = 7  # not divisible by 2


def seq_first_lm(batch=3, seq=SEQ):
    model, (idx,), (y,), loss_fn = zoo.transformer(batch=batch, seq=seq)
    return SeqFirst(model), (idx.t().contiguous(),), (y.t().contiguous(),), loss_fn


def seq_first_hf(name, batch=3, seq=SEQ):
    model, inputs, _, _ = zoo.MODELS[name](batch=batch, seq=seq)
    ids, labels = inputs[0], inputs[-1]
    return HFSeqFirst(model), (ids.t().contiguous(), labels.t().contiguous()), (), None


# -- zoo.TinyLM ------------------------------------------------------------------------------------
def test_transformer_sequence_dim1():
    model, x, y, loss_fn = zoo.transformer(batch=2, seq=SEQ)
    check_training(model, sw.Mesh((2,), ("sp",)), x, y, loss_fn, input_placements={"idx": [S(1)]}, **ADAM)


def test_transformer_sequence_dim0():
    model, x, y, loss_fn = seq_first_lm()
    pm = check_training(model, sw.Mesh((2,), ("sp",)), x, y, loss_fn, input_placements={"idx": [S(0)]}, **ADAM)
    model.load_state_dict(pm.state_dict())  # the trained weights
    torch.testing.assert_close(pm(*x), model(*x), rtol=1e-4, atol=1e-5)


def test_transformer_sequence_on_three_ranks():
    model, x, y, loss_fn = zoo.transformer(batch=2, seq=SEQ)  # 7 -> 3, 3, 1
    check_training(model, sw.Mesh((3,), ("sp",)), x, y, loss_fn, input_placements={"idx": [S(1)]}, **ADAM)


def test_transformer_data_by_sequence_2x2():
    model, x, y, loss_fn = zoo.transformer(batch=3, seq=SEQ)
    check_training(model, sw.Mesh((2, 2), ("dp", "sp")), x, y, loss_fn, input_placements={"idx": [S(0), S(1)]},
                   **ADAM)


def test_transformer_seq_first_data_by_sequence_2x2():
    model, x, y, loss_fn = seq_first_lm()
    check_training(model, sw.Mesh((2, 2), ("dp", "sp")), x, y, loss_fn,
                   input_placements={"idx": {"dp": S(1), "sp": S(0)}}, **ADAM)


# -- Hugging Face ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_sequence_dim1(name):
    model, inputs, targets, loss_fn = zoo.MODELS[name](batch=2, seq=SEQ)
    check_training(model, sw.Mesh((2,), ("sp",)), inputs, targets, loss_fn,
                   input_placements={"input_ids": [S(1)], "labels": [S(1)]}, **ADAM)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_sequence_dim0(name):
    model, inputs, targets, loss_fn = seq_first_hf(name)
    check_training(model, sw.Mesh((2,), ("sp",)), inputs, targets, loss_fn,
                   input_placements={"input_ids": [S(0)], "labels": [S(0)]}, **ADAM)
