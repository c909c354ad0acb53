"""CTC loss sharded on the batch (rules/loss.py, trace/ctc.py) and Hugging Face's Wav2Vec2ForCTC trained
under data parallelism: loss and every gradient equal one device's, ragged target lengths, uneven shards.

    python -m pytest tests/parallel/test_ctc.py -q
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from tests.models.zoo import positional

from .harness import check_training

aten = torch.ops.aten
S0 = [sw.Shard(0)]


class Frames(nn.Module):
    def __init__(self, classes=6):
        super().__init__()
        self.lin = nn.Linear(4, classes)

    def forward(self, x):
        return self.lin(x)  # [N, T, C]


def _ctc(reduction="mean", zero_infinity=False, lists=False):
    def loss_fn(out, targets, input_lengths, target_lengths):
        lp = out.log_softmax(-1).transpose(0, 1)
        if lists:  # the int-list overloads (_ctc_loss.default): the lengths as Python numbers, fixed
            input_lengths, target_lengths = [9, 7, 9, 8, 9], [3, 1, 2, 0, 3]
        return F.ctc_loss(lp, targets, input_lengths, target_lengths, blank=0, reduction=reduction,
                          zero_infinity=zero_infinity)
    return loss_fn


def _batch(n=5, steps=9, longest=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, steps, 4, generator=g)
    targets = torch.randint(1, 6, (n, longest), generator=g)
    input_lengths = torch.tensor([9, 7, 9, 8, 9][:n])
    target_lengths = torch.tensor([3, 1, 2, 0, 3][:n])  # no row of the full 4: log_alpha is padded everywhere
    return x, (targets, input_lengths, target_lengths)


CASES = [("mean", False, False, (2,)), ("sum", False, False, (3,)), ("mean", True, False, (2, 2)),
         ("sum", False, True, (2,))]


@pytest.mark.parametrize("reduction, zero_infinity, lists, shape", CASES)
def test_ctc_loss_sharded_on_the_batch(reduction, zero_infinity, lists, shape):
    """5 samples on 2, 3 and 2x2 ranks (uneven), target lengths 3, 1, 2, 0, 3 of 4: the per-sample losses
    and log_alpha shard on the batch (no gather of the logits), the mean divides by the global count."""
    x, targets = _batch()
    mesh = sw.Mesh(shape, ("dp",) if len(shape) == 1 else ("a", "b"))
    place = S0 * len(shape) if len(shape) == 1 else [sw.Shard(0), sw.Replicate()]
    pm = check_training(Frames(), mesh, (x,), targets, loss_fn=_ctc(reduction, zero_infinity, lists), steps=2,
                        input_placements={"x": place}, target_placements={i: place for i in range(3)})
    ctc = [n for n in pm.plan.prop.nodes.values() if "ctc_loss" in str(n.call.op)]
    assert len(ctc) == 2 and all(any(isinstance(p, sw.Shard) for p in n.strategy.ins[0]) for n in ctc), \
        pm.plan.summary()
    forward = aten._ctc_loss.default if lists else aten._ctc_loss.Tensor
    assert forward in pm.plan.traced.ops()


def _wav2vec2(batch=3):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    cfg = Wav2Vec2Config(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                         activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                         layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean")
    model = Wav2Vec2ForCTC(cfg).train()
    x = torch.randn(batch, 400)
    labels = torch.randint(1, 12, (batch, 5))
    labels[1, 3:] = -100  # padding at the end of a row
    labels[2, 1] = -100  # and inside one: HF drops it, the labels after it close up
    return model, x, labels


def test_wav2vec2_ctc_trains_exactly_on_two_ranks():
    """Wav2Vec2ForCTC (random weights) with its own loss: labels.max() < vocab checked by a guard,
    the loss on padded targets, the positional conv's weight norm sharded as its rule allows; 3 clips
    on 2 ranks, loss, every gradient and two AdamW steps equal one device's; labels out of range
    raise the model's own ValueError."""
    model, x, labels = _wav2vec2()
    inputs = positional(model.forward, input_values=x, labels=labels)
    pm = check_training(model, sw.Mesh((2,), ("dp",)), inputs, steps=2,
                        input_placements={"input_values": S0, "labels": S0})
    assert aten.masked_select.default not in pm.plan.traced.ops()
    bad = labels.clone()
    bad[0, 0] = 12
    with pytest.raises(ValueError, match="Label values must be <= vocab_size"):
        pm.step(*positional(model.forward, input_values=x, labels=bad))


def test_concatenated_targets_are_refused_with_a_ctc_fix():
    """Targets concatenated by masked_select (a length that is the data's): a TraceError whose fix speaks
    of CTC's padded form, not of another model's."""
    from shardwise.trace.errors import TraceError

    def loss_fn(out, targets, input_lengths, target_lengths):
        flat = targets.masked_select(targets > 0)
        return F.ctc_loss(out.log_softmax(-1).transpose(0, 1), flat, input_lengths, target_lengths)

    x, targets = _batch()
    with pytest.raises(TraceError) as e:
        sw.parallelize(Frames(), sw.Mesh((2,), ("dp",)), (x,), loss_fn=loss_fn, example_targets=targets)
    assert e.value.op == aten.masked_select.default
    assert "targets padded to [N, S]" in e.value.fix and "experts" not in e.value.fix
