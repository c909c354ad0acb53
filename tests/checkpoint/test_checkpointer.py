"""sw.Checkpointer and the training state on the threads backend: a resumed run equals an
uninterrupted one bit for bit, dropout stream included; an asynchronous save lets steps run while
it writes and holds the state of the step that asked; checkpoints are verified on load, a damaged
newest one is passed over with a warning naming both; old ones are pruned, leftovers removed; a
failed background save is raised, never lost.

    python -m pytest tests/checkpoint/test_checkpointer.py -q
    python -m pytest tests/checkpoint/test_checkpointer.py -q -m slow   # the step-time measurement
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
from shardwise import Shard as S
from shardwise.module.checkpoint import training

from .helpers import assert_bitwise, snapshot
from .resilient_train import Batches, mse


def dropout_mlp(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make(seed: int = 0, width: int = 2):
    model = dropout_mlp(seed)
    pm = sw.parallelize(model, sw.Mesh((width,), ("dp",)), (torch.zeros(8, 8),), input_placements={0: [S(0)]},
                        param_placements={n: [S(0)] for n, _ in model.named_parameters()}, loss_fn=mse)
    return pm, pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def train(pm, opt, loader, steps, ck=None) -> list:
    losses = []
    for step in steps:
        losses.append(pm.step(*loader.next()))
        opt.step()
        pm.zero_grad()
        if ck is not None:
            ck.step(step, extra=lambda: {"data": loader.state_dict()})
    return losses


def reference(steps=6):
    torch.manual_seed(0)
    pm, opt = make()
    losses = train(pm, opt, Batches(1), range(1, steps + 1))
    return losses, snapshot(pm, opt)


def shard_file(path) -> str:
    return os.path.join(path, "__0_0.distcp")


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_resume_is_bitwise_equal_including_the_dropout_stream(tmp_path, async_save):
    want_losses, want = reference()
    torch.manual_seed(0)
    pm, opt = make()
    with sw.Checkpointer(tmp_path, every=3, async_save=async_save) as ck:
        assert ck.resume(pm, opt) == 0 and ck.extra == {} and ck.resumed_from is None
        train(pm, opt, Batches(1), range(1, 5), ck)  # step 4 is lost, as if the job died there
    torch.manual_seed(1234)  # a fresh process: other generators, other weights
    pm2, opt2 = make(seed=5)
    with sw.Checkpointer(tmp_path, every=3, async_save=async_save) as ck2:
        start = ck2.resume(pm2, opt2)
        assert start == 3 and ck2.resumed_from == str(tmp_path / "step_00000003")
        loader = Batches(7)
        loader.load_state_dict(ck2.extra["data"])
        losses = train(pm2, opt2, loader, range(start + 1, 7), ck2)
    assert_bitwise(losses, want_losses[3:])
    assert_bitwise(snapshot(pm2, opt2), want)
    assert [os.path.basename(p) for p in ck2.checkpoints] == ["step_00000003", "step_00000006"]


def test_without_the_generators_the_dropout_stream_differs(tmp_path):
    """What the test above guards against: loading weights and optimizer only (rng=False) does
    not give step 4's loss, since its dropout mask comes from the restored generator."""
    want_losses, _ = reference(4)
    torch.manual_seed(0)
    pm, opt = make()
    loader = Batches(1)
    train(pm, opt, loader, range(1, 4))
    pm.save(tmp_path / "ck", optimizer=opt, extra={"data": loader.state_dict()}, step=3)
    torch.manual_seed(1234)
    pm2, opt2 = make(seed=5)
    info = pm2.load(tmp_path / "ck", optimizer=opt2, rng=False)
    assert info["step"] == 3
    loader.load_state_dict(info["data"])
    assert not torch.equal(train(pm2, opt2, loader, [4])[0], want_losses[3])
    pm2.load(tmp_path / "ck", optimizer=opt2)  # with them: step 4 as uninterrupted
    loader.load_state_dict(info["data"])
    assert torch.equal(train(pm2, opt2, loader, [4])[0], want_losses[3])


def _gated_writer():
    """A storage writer that holds every write until ``gate`` is set (a storage slower than any step)."""
    started, gate = threading.Event(), threading.Event()

    class Gated(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            started.set()
            assert gate.wait(60), "the test never opened the gate"
            return super().write_data(plan, planner)

    return Gated, started, gate


def test_async_save_lets_steps_run_and_holds_the_state_of_its_step(tmp_path):
    writer, started, gate = _gated_writer()
    torch.manual_seed(0)
    pm, opt = make()
    loader = Batches(1)
    ck = sw.Checkpointer(tmp_path, every=3, storage_writer=writer)
    ck.resume(pm, opt)
    train(pm, opt, loader, range(1, 4), ck)  # step 3 starts a save, which the writer holds
    at_3, rng_3, data_3 = snapshot(pm, opt), torch.random.get_rng_state(), loader.state_dict()
    assert started.wait(30)
    train(pm, opt, loader, range(4, 6), ck)  # two more steps while the save is held
    assert ck.checkpoints == [], "the save completed before the steps: nothing ran during it"
    assert not gate.is_set()
    gate.set()
    ck.close()
    assert ck.checkpoints == [str(tmp_path / "step_00000003")]
    torch.manual_seed(99)
    pm2, opt2 = make(seed=5)
    info = pm2.load(ck.checkpoints[0], optimizer=opt2)
    assert info["step"] == 3 and set(info) == {"step", "data"}
    assert_bitwise(info["data"], data_3)
    assert_bitwise(snapshot(pm2, opt2), at_3)  # step 3's state, not step 5's
    assert torch.equal(torch.random.get_rng_state(), rng_3)


def test_a_damaged_checkpoint_is_named_and_resume_falls_back(tmp_path):
    torch.manual_seed(0)
    pm, opt = make()
    with sw.Checkpointer(tmp_path, every=3, keep=3, async_save=False) as ck:
        ck.resume(pm, opt)
        train(pm, opt, Batches(1), range(1, 7), ck)
    step3, step6 = ck.checkpoints
    size = os.path.getsize(shard_file(step6))
    os.truncate(shard_file(step6), size - 10)
    with pytest.raises(sw.CheckpointCorruptError) as e:
        pm.load(step6, optimizer=opt)
    assert e.value.file == "__0_0.distcp" and e.value.path == step6
    assert f"file '__0_0.distcp' has {size - 10} bytes, the manifest says {size} (truncated" in str(e.value)
    assert isinstance(e.value, sw.ShardingError) and e.value.fix
    pm2, opt2 = make(seed=5)
    ck2 = sw.Checkpointer(tmp_path, every=3)
    with pytest.warns(sw.CheckpointWarning) as w:
        assert ck2.resume(pm2, opt2) == 3
    msg = str(w[0].message)
    assert f"checkpoint '{step6}': file '__0_0.distcp'" in msg and f"resuming from the checkpoint before it, {step3}" in msg
    ck2.close()
    # the same size with one byte changed: the checksum says so
    with open(shard_file(step3), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(sw.CheckpointCorruptError, match=r"'__0_0.distcp' has CRC-32 [0-9a-f]{8}, the manifest says"):
        pm.load(step3)
    with pytest.raises(sw.CheckpointError, match="every checkpoint in .* is damaged"):
        sw.Checkpointer(tmp_path).resume(*make(seed=5))


def test_keep_prunes_and_resume_removes_leftovers(tmp_path):
    torch.manual_seed(0)
    pm, opt = make()
    ck = sw.Checkpointer(tmp_path, every=1, keep=2)
    ck.resume(pm, opt)
    train(pm, opt, Batches(1), range(1, 5), ck)
    ck.close()
    assert [os.path.basename(p) for p in ck.checkpoints] == ["step_00000003", "step_00000004"]
    os.mkdir(tmp_path / ".step_00000005.tmp-x1y2")  # a save the process died in
    (tmp_path / "step_00000009").mkdir()  # not complete: no manifest (never renamed by a save)
    with pytest.warns(sw.CheckpointWarning, match="step_00000009' has no manifest.json"):
        assert sw.Checkpointer(tmp_path).resume(pm, opt) == 4
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004", "step_00000009"]


def test_a_failed_background_save_is_raised_and_keeps_the_previous(tmp_path):
    class Failing(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError("disk full (simulated)")

    torch.manual_seed(0)
    pm, opt = make()
    loader = Batches(1)
    ck = sw.Checkpointer(tmp_path, every=2, async_save=True)
    ck.resume(pm, opt)
    train(pm, opt, loader, range(1, 3), ck)
    ck.wait()
    ck.storage_writer = Failing
    train(pm, opt, loader, [3, 4], ck)  # step 4's save fails in the background
    with pytest.raises(sw.CheckpointError, match="background checkpoint save failed: rank 0: OSError: disk full"):
        train(pm, opt, loader, [5, 6], ck)  # raised at step 5 if it has failed by then, else by step 6's save
    ck.close()
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    assert ck.checkpoints == [str(tmp_path / "step_00000002")]


EXIT_SCRIPT = """
import sys, time
import torch, torch.distributed.checkpoint as dcp
import shardwise as sw
sys.path.insert(0, {root!r})
from tests.checkpoint.test_checkpointer import Batches, make, train

class Slow(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        time.sleep(1.0)
        return super().write_data(plan, planner)

pm, opt = make()
ck = sw.Checkpointer({path!r}, every=2, storage_writer=Slow)
ck.resume(pm, opt)
train(pm, opt, Batches(1), [1, 2], ck)
print("exiting with", len(ck.checkpoints), "checkpoints", flush=True)
"""


def test_the_process_waits_for_the_last_save_before_it_exits(tmp_path):
    """A script that ends while its last save is being written (1 s of slow storage), without
    close(): the save completes before the process exits."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT.format(root=root, path=str(tmp_path / "ck")))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exiting with 0 checkpoints" in out.stdout
    assert os.listdir(tmp_path / "ck") == ["step_00000002"]
    assert os.path.isfile(tmp_path / "ck" / "step_00000002" / "manifest.json")


def test_misuse_is_named():
    with pytest.raises(sw.ConfigError, match="every must be a positive"):
        sw.Checkpointer("x", every=0)
    with pytest.raises(sw.ConfigError, match="keep must be None or at least 1"):
        sw.Checkpointer("x", keep=0)
    with pytest.raises(sw.ConfigError, match="ck.resume"):
        sw.Checkpointer("x").step(1)
    pm, opt = make()
    with pytest.raises(sw.ConfigError, match="extra must be a dict"):
        pm.save("unused", extra=[1])
    with pytest.raises(sw.ConfigError, match=r"step=3 but extra\['step'\]=4"):
        pm.save("unused", step=3, extra={"step": 4})


def test_generators_of_other_ranks_are_restored_only_when_they_fit():
    """One process holds ranks 0..2: generators saved per rank restore only if they agree."""
    a, b = {"torch": torch.zeros(3, dtype=torch.uint8), "python": (1,)}, {"torch": torch.ones(3, dtype=torch.uint8),
                                                                         "python": (1,)}
    with pytest.warns(training.CheckpointWarning, match=r"ranks \[0, 1\], which differ, and none for rank\(s\) \[2\]"):
        training._restore_rng({0: a, 1: b}, [0, 1, 2], None, "'ck'")
    with pytest.raises(sw.CheckpointError, match="different random generators for ranks"):
        training._restore_rng({0: a, 1: b}, [0, 1], True, "'ck'")


@pytest.mark.slow  # a timing measurement: robust, but not for a loaded machine's default run
def test_steps_during_a_slow_save_take_no_longer_than_normal_ones(tmp_path):
    """A storage writer that waits 20 ms per item before writing (a storage far slower than a step;
    waiting, not computing, as slow storage does): over 3 rounds of 15 steps without a save and
    the steps during one, the median step during the saves is within 1.5x of the median without."""

    class Slow(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(0.02 * len(plan.items))
            return super().write_data(plan, planner)

    torch.manual_seed(0)
    pm, opt = make(width=2)
    loader = Batches(1)
    ck = sw.Checkpointer(tmp_path, every=1000, keep=None, storage_writer=Slow)
    ck.resume(pm, opt)
    train(pm, opt, loader, range(1, 4))  # warm
    plain, during = [], []
    for k in range(3):  # alternated, so a change in the machine's load hits both
        plain += _step_times(pm, opt, loader, 15)
        ck.save(100 + k)
        steps = 0
        while len(ck.checkpoints) == k and steps < 500:
            during += _step_times(pm, opt, loader, 1)
            steps += 1
        assert steps >= 5, f"save {k} took only {steps} steps: not slower than a step"
    ck.close()
    ratio = statistics.median(during) / statistics.median(plain)
    print(f"median step {statistics.median(plain) * 1e3:.1f} ms, during the saves "
          f"{statistics.median(during) * 1e3:.1f} ms over {len(during)} steps: {ratio:.2f}x")
    assert ratio < 1.5


def _step_times(pm, opt, loader, n) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        train(pm, opt, loader, [0])
        out.append(time.perf_counter() - t0)
    return out


def test_the_guides_fault_tolerant_script_uses_this_api():
    """docs/guide.md's script parses, and the calls it makes exist with those keywords."""
    import inspect
    import pathlib
    import re

    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    section = guide.split("## Fault-tolerant training")[1]
    code = re.search(r"```py\n(.*?)```", section, re.S).group(1)
    compile(code, "guide.md", "exec")
    assert {"every", "keep", "async_save"} <= set(inspect.signature(sw.Checkpointer).parameters)
    assert {"extra", "step"} <= set(inspect.signature(sw.ParallelModule.save).parameters)
    for call in ("ck.resume(pm, opt)", "ck.extra[", "ck.step(step, extra=", "skip_nonfinite=True"):
        assert call in code
