"""Checkpoint hygiene on the threads backend: single-process saves and loads (pm.save, pm.load,
the Checkpointer's background writer) show no torch.distributed.checkpoint warning; ck.step(s)
counts from 1 and refuses a step at or below the one saved or resumed (CheckpointError).

    python -m pytest tests/checkpoint/test_hygiene.py -q
"""
from __future__ import annotations

import warnings

import pytest

import shardwise as sw

from .resilient_train import Batches
from .test_checkpointer import make, train


def _torch_warnings(caught) -> list[str]:
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "torch" in w.filename.replace("\\", "/")
            or "torch.distributed" in str(w.message)]


def test_single_process_saves_and_loads_warn_nothing(tmp_path):
    """DCP warns 'torch.distributed is disabled ... assuming the intent is to save in a single
    process' on every single-process save and load, even told no_dist=True; the background writer
    showed it (no filter could be swapped there)."""
    pm, opt = make()
    loader = Batches(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(pm, opt, loader, [1])
        pm.save(tmp_path / "one", optimizer=opt)
        assert pm.load(tmp_path / "one", optimizer=opt)["step"] is None
        ck = sw.Checkpointer(tmp_path / "run", every=1, async_save=True)
        assert ck.resume(pm, opt) == 0
        train(pm, opt, loader, [1, 2], ck)  # saved on the writer thread
        ck.close()
        assert sw.Checkpointer(tmp_path / "run").resume(pm, opt) == 2
    assert len(ck.checkpoints) == 2
    assert _torch_warnings(caught) == []


def test_step_counts_from_one_and_never_repeats(tmp_path):
    """A loop written from 0 (``for step in range(start, n): ...; ck.step(step)``) fails at its
    first ck.step instead of repeating one step of data after every resume."""
    pm, opt = make()
    loader = Batches(1)
    ck = sw.Checkpointer(tmp_path, every=2, async_save=False)
    start = ck.resume(pm, opt)
    with pytest.raises(sw.CheckpointError, match=r"ck.step\(0\): no step is done yet .* count from 1") as e:
        ck.step(start)
    assert "range(start + 1, total + 1)" in e.value.fix
    train(pm, opt, loader, range(start + 1, 3), ck)  # steps 1 and 2: saved at 2
    with pytest.raises(sw.CheckpointError, match=r"step 2 was saved already"):
        ck.step(2)
    ck.close()
    again = sw.Checkpointer(tmp_path, every=2, async_save=False)
    start = again.resume(pm, opt)
    assert start == 2
    with pytest.raises(sw.CheckpointError, match=r"ck.step\(2\): step 2 was resumed from already.*continues with "
                                                 r"step 3"):
        again.step(start)
    with pytest.raises(sw.CheckpointError):
        again.step(1)
    assert again.step(3) is False and again.step(4) is True  # counted from start + 1: saved at 4
    again.close()
    assert [c[-8:] for c in again.checkpoints] == ["00000002", "00000004"]
