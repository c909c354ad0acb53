"""A model inside the user's own module trains under a pipeline as the bare model does: the
wrapped GPT-2 (tied and untied heads, its own loss or one computed from the logits) equals one
device (loss, every gradient, two AdamW steps) under every schedule on 2 and 4 pipeline ranks.
It failed with MicrobatchError: the position embedding's gradient ([1, s, h] partial over the
microbatches) was all-reduced over them mid-backward to avoid its growth into [positions, h].

    python -m pytest tests/pipeline/test_wrapped.py -q            # a subset
    python -m pytest tests/pipeline/test_wrapped.py -q -m slow    # every schedule, 2 and 4 ranks
"""
from __future__ import annotations

import pytest

import shardwise as sw
from tests.parallel.harness import check_training

from .models import ADAM, pipe
from .wrapped import wrapped_gpt2

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble")


def train(schedule, p, tied=True, own_loss=False, m=4):
    model, inputs = wrapped_gpt2(tied, own_loss, layers=4 if p == 2 else 6)
    pm = check_training(model, sw.Mesh((p,), ("pp",)), inputs, (), None, **ADAM, pipeline=pipe(schedule, m))
    assert pm.plan.stats()["p2p_bytes"] > 0


@pytest.mark.parametrize("schedule, tied, own_loss", [("1f1b", True, False), ("zero-bubble", False, True)])
def test_wrapped_gpt2_on_two_stages_equals_one_device(schedule, tied, own_loss):
    train(schedule, 2, tied, own_loss)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("tied, own_loss", [(True, False), (False, False), (True, True)])
def test_wrapped_gpt2_every_schedule(schedule, p, tied, own_loss):
    train(schedule, p, tied, own_loss, m=4 if p == 2 else 8)
