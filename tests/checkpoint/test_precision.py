"""Checkpoints of a mixed-precision run hold its fp32 masters and optimizer state; a run without the
policy, or with another, or a model cast to bf16, loads them and says what it did.

    python -m pytest tests/checkpoint/test_precision.py -q -p no:logging
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise.module.checkpoint.precision import PrecisionWarning

from .helpers import ADAMW, batch, fsdp, mlp, mse

MESH = sw.Mesh((2,), ("dp",))
BF16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def trained(model, policy, steps=2):
    dtype = next(model.parameters()).dtype
    x, y = (t.to(dtype) for t in batch())
    pm = sw.parallelize(model, MESH, (x,), loss_fn=mse, example_targets=(y,), input_placements={0: [sw.Shard(0)]},
                        param_placements=fsdp(model), mixed_precision=policy)
    opt = pm.optimizer(torch.optim.AdamW, **ADAMW)
    for _ in range(steps):
        pm.step(x, y)
        opt.step()
        opt.zero_grad()
    return pm, opt


def optim_state(pm, opt) -> dict:
    return {(n, k): v for n, s in pm.optimizer_state_dict(opt)["state"].items() for k, v in s.items()}


def test_masters_and_optimizer_state_saved_in_fp32_and_loaded_anywhere(tmp_path):
    pm, opt = trained(mlp(), BF16)
    pm.save(tmp_path / "ck", optimizer=opt)
    md = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    params = [k for k in md if k.startswith("model.")]
    moments = [k for k in md if k.startswith("optim.state.") and "exp_avg" in k]
    assert params and moments
    assert all(md[k].properties.dtype == torch.float32 for k in params + moments)
    saved = json.loads((tmp_path / "ck" / "manifest.json").read_text())["precision"]  # what a load compares
    assert saved == {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None},
                     "masters": {"float32": 4}}
    masters, state = pm.state_dict(), optim_state(pm, opt)

    for policy in (None, sw.MixedPrecision(param_dtype=torch.float16)):  # no policy, another policy
        other, other_opt = trained(mlp(seed=5), policy, steps=1)
        with pytest.warns(PrecisionWarning, match="masters and optimizer state were loaded as saved") as w:
            other.load(tmp_path / "ck", optimizer=other_opt)
        assert "MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)" in str(w[0].message)
        for k, v in other.state_dict().items():
            assert torch.equal(v, masters[k]), k  # the fp32 masters, bit for bit
        for k, v in optim_state(other, other_opt).items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[k])), k

    bf16 = mlp(seed=5).to(torch.bfloat16)  # a model cast to bf16: its parameters are its masters
    other, other_opt = trained(bf16, None, steps=1)
    with pytest.warns(PrecisionWarning, match="cast from float32 to bfloat16"):
        other.load(tmp_path / "ck", optimizer=other_opt)
    for k, v in other.state_dict().items():
        assert torch.equal(v, masters[k].to(torch.bfloat16)), k

    same, same_opt = trained(mlp(seed=5), BF16, steps=1)  # the same policy: nothing to say
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        same.load(tmp_path / "ck", optimizer=same_opt)


def test_checkpointer_records_the_precision_and_resume_says_what_it_loaded(tmp_path):
    """sw.Checkpointer's saves carry the run's precision in their manifest like pm.save's: resuming
    a run without the policy warns, and loads the fp32 masters."""
    pm, opt = trained(mlp(), BF16, steps=1)
    ck = sw.Checkpointer(tmp_path / "run", every=1, async_save=False)
    assert ck.resume(pm, opt) == 0
    ck.step(1)
    other, other_opt = trained(mlp(seed=5), None, steps=1)
    with pytest.warns(PrecisionWarning, match="no mixed precision"):
        assert sw.Checkpointer(tmp_path / "run", every=1, async_save=False).resume(other, other_opt) == 1
    for k, v in other.state_dict().items():
        assert torch.equal(v, pm.state_dict()[k]), k
