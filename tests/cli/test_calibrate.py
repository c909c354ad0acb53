"""Cost profiles (core/profile.py, ``shardwise calibrate``, ``sw.CostModel.from_profile``): the JSON round
trip, curves interpolated in log(size) into the step-time model, alpha-beta per collective kind, presets
as profiles that say where their numbers came from, typed errors, ``shardwise plan --profile``; the
measurement itself on 2 gloo processes behind ``slow``. No timing is asserted here (bench/bench_calibrated.py
and bench/CALIBRATION.md hold the timing claims); every expected figure is a formula written out."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

import shardwise as sw
from shardwise.cli import main
from shardwise.core.cost import PRESETS
from shardwise.core.profile import FORMAT, ProfileError, interpolate, preset_profile, read, write
from shardwise.rules.registry import OpCall, Strategy
from shardwise.search.flops import node_time
from shardwise.tools.calibrate.links import fit

aten = torch.ops.aten
R = sw.Replicate()


def _profile() -> dict:
    """A measured-looking profile with round figures (peak 10 GFLOP/s, 5 GB/s)."""
    return {
        "format": FORMAT,
        "source": {"kind": "measured", "machine": "box", "processor": "cpu", "torch": torch.__version__,
                   "date": "2026-12-07T00:00:00+00:00", "nproc": 2},
        "compute": {"float32": {"peak_flops": 10e9, "matmul": [[1e4, 1e9], [1e6, 4e9], [1e8, 10e9]],
                                "attention": [[1e6, 2e9], [1e8, 5e9]]},
                    "bfloat16": {"peak_flops": 2e9, "matmul": [[1e4, 1e8], [1e8, 2e9]], "attention": []}},
        "memory": {"peak_bandwidth": 5e9, "curve": [[1e3, 0.5e9], [1e6, 5e9]]},
        "op_overhead_s": 20e-6,
        "links": {"*": {"all_reduce": {"latency_s": 100e-6, "bandwidth": 1e9, "points": []},
                        "all_gather": {"latency_s": 50e-6, "bandwidth": 2e9, "points": []}},
                  "tp": {"all_gather": {"latency_s": 10e-6, "bandwidth": 8e9, "points": []}}},
        "overlap": False, "device_memory": None,
    }


def test_json_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    write(_profile(), path)
    assert read(path) == _profile()
    from_file, from_dict = sw.CostModel.from_profile(str(path)), sw.CostModel.from_profile(_profile())
    assert from_file == from_dict and hash(from_file) == hash(from_dict)  # a frozen, hashable key
    assert from_file.flops == 10e9 and from_file.memory_bandwidth == 5e9 and from_file.op_overhead == 20e-6
    assert "measured" in from_file.source and "box" in from_file.source and torch.__version__ in from_file.source
    assert sw.CostModel.from_profile(_profile(), dtype="bfloat16").flops == 2e9


def test_curves_interpolate_in_log_size_and_hold_at_the_ends():
    pts = ((1e4, 0.1), (1e6, 0.4), (1e8, 1.0))
    assert interpolate(pts, 1e5) == pytest.approx(0.25)  # halfway in log(size)
    assert interpolate(pts, 1e7) == pytest.approx(0.7)
    assert interpolate(pts, 10.0) == 0.1 and interpolate(pts, 1e12) == 1.0
    cost = sw.CostModel.from_profile(_profile())
    assert cost.efficiency("matmul", 1e5) == pytest.approx(0.25)
    assert cost.efficiency("attention", 1e7) == pytest.approx((0.2 + 0.5) / 2)
    assert cost.efficiency("memory", math.sqrt(1e3 * 1e6)) == pytest.approx((0.1 + 1.0) / 2)
    assert cost.efficiency("other", 1e5) == 1.0  # elementwise flops: the scalar share
    preset = sw.CostModel.preset("cpu", matmul_efficiency=0.5)
    assert preset.efficiency("matmul", 1e5) == 0.5 and preset.efficiency("memory", 1e5) == 1.0


def _call(op, *args):
    return OpCall.from_values(op, args, {}, op(*args))


def test_step_time_reads_the_efficiency_for_the_ops_size():
    """A small matmul runs at its small share, a large one at its large share (node_time, the step
    model's per-node figure); the kernel's fixed cost is added once."""
    cost = sw.CostModel.from_profile(_profile())
    mesh = sw.Mesh((2,), ("dp",))
    rows = Strategy(((sw.Shard(0),),), ((sw.Shard(0),), (R,)))
    small = _call(aten.mm.default, torch.randn(8, 16), torch.randn(16, 4))  # 4 x 16 x 4 per rank
    big = _call(aten.mm.default, torch.randn(512, 256), torch.randn(256, 256))
    for call, m, k, n in ((small, 4, 16, 4), (big, 256, 256, 256)):
        flops = 2.0 * m * k * n
        share = interpolate(((1e4, 0.1), (1e6, 0.4), (1e8, 1.0)), flops)
        moved = (m * k + k * n + m * n) * 4
        mem = moved / (5e9 * interpolate(((1e3, 0.1), (1e6, 1.0)), moved))
        assert node_time(cost, call, rows, mesh) == pytest.approx(max(flops / (10e9 * share), mem) + 20e-6)


def test_collectives_priced_by_their_kinds_fit_per_mesh_dim():
    cost = sw.CostModel.from_profile(_profile())
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    nbytes = 1 << 20
    assert cost.collective_time("all_reduce", nbytes, 2, 0, mesh) == pytest.approx(2 * 100e-6 + nbytes / 1e9)
    assert cost.collective_time("all_gather", nbytes, 2, 0, mesh) == pytest.approx(50e-6 + nbytes / 2e9)
    assert cost.collective_time("all_gather", nbytes, 2, 1, mesh) == pytest.approx(10e-6 + nbytes / 8e9)  # "tp"
    # a kind the profile has no fit for: the dim's scalar figures (its all_reduce fit)
    assert cost.collective_time("all_to_all", nbytes, 2, 0, mesh) == pytest.approx(100e-6 + nbytes / 1e9)
    per_dim = _profile()
    del per_dim["links"]["*"]  # measured with --mesh: dims by name only
    per_dim["links"]["dp"] = {"all_reduce": {"latency_s": 30e-6, "bandwidth": 0.5e9, "points": []}}
    slow = sw.CostModel.from_profile(per_dim)
    other = sw.Mesh((2,), ("sp",))  # a dim the profile does not name: the slowest measured link ("dp")
    assert slow.collective_time("all_reduce", nbytes, 2, 0, other) == pytest.approx(2 * 30e-6 + nbytes / 0.5e9)
    # a link figure given by hand replaces the measured fits
    hand = sw.CostModel.from_profile(_profile(), bandwidth=3e9, latency=1e-6)
    assert hand.collective_time("all_gather", nbytes, 2, 1, mesh) == pytest.approx(1e-6 + nbytes / 3e9)


def test_fit_recovers_alpha_and_beta():
    a, b, rounds = 30e-6, 2e9, 2
    pts = [[x, a * rounds + x / b] for x in (8, 4096, 1 << 20, 1 << 23)]
    got = fit(pts, rounds)
    assert got[0] == pytest.approx(a + 8 / b / rounds, rel=1e-9)  # the smallest message's time per round
    assert got[1] == pytest.approx(b, rel=1e-4)
    stalled = [[8, 5e-3]] + pts[1:]  # one stall of the smallest message on a loaded machine: no effect
    lat, bw = fit(stalled, rounds)
    assert lat == pytest.approx(pts[1][1] / rounds) and bw == pytest.approx(b, rel=1e-3)
    noisy = fit([[8, 1e-3], [1 << 20, 0.9e-3]], 1)  # the bandwidth term lost in noise: kept positive
    assert noisy[0] > 0 and noisy[1] > 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_is_a_profile_that_says_its_source(name, tmp_path):
    prof = preset_profile(name, PRESETS[name])
    assert prof["source"]["kind"] == "preset" and prof["source"]["note"]
    path = tmp_path / f"{name}.json"
    write(prof, path)
    cost, preset = sw.CostModel.from_profile(str(path)), sw.CostModel.preset(name)
    assert preset.source.startswith(f"preset {name}:") and cost.source.startswith(f"preset {name}:")
    mesh = sw.Mesh((4,), ("dp",))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert cost.collective_time(kind, 1 << 20, 4, 0, mesh) == pytest.approx(
            preset.collective_time(kind, 1 << 20, 4, 0, mesh))
    assert cost.compute_time(1e9, 1e6) == pytest.approx(preset.compute_time(1e9, 1e6))


def test_bad_profiles_raise_typed_errors_with_a_fix(tmp_path):
    with pytest.raises(ProfileError, match="no cost profile") as e:
        sw.CostModel.from_profile(str(tmp_path / "missing.json"))
    assert "calibrate" in e.value.fix
    (tmp_path / "other.json").write_text(json.dumps({"format": "something/2"}))
    with pytest.raises(ProfileError, match="not a shardwise cost profile"):
        sw.CostModel.from_profile(str(tmp_path / "other.json"))
    bad = _profile()
    bad["compute"]["float32"]["matmul"] = [[1e4, -1.0]]
    with pytest.raises(ProfileError, match="positive"):
        sw.CostModel.from_profile(bad)
    with pytest.raises(ProfileError, match="no compute figures for float16"):
        sw.CostModel.from_profile(_profile(), dtype="float16")
    assert isinstance(ProfileError("x"), sw.ShardingError)


def test_parallelize_takes_the_profiles_model():
    cost = sw.CostModel.from_profile(_profile())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(6, 16), torch.randn(6, 4)  # 6 rows on 2 ranks; uneven on 4
    ref = torch.nn.functional.mse_loss(model(x), y)
    ref.backward()
    pm = sw.parallelize(model, sw.Mesh((2,), ("dp",)), (x,), input_placements={0: [sw.Shard(0)]},
                        loss_fn=torch.nn.functional.mse_loss, example_targets=(y,), cost_model=cost)
    assert pm.plan.cost == cost
    loss = pm.step(x, y)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-4, atol=1e-6)
    grads = pm.gradients()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)
    st = pm.plan.stats()
    assert st["est_step_time_s"] > 0 and st["compute_time_s"] >= 20e-6  # at least one kernel's fixed cost


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_plan_with_a_profile(tmp_path):
    path = tmp_path / "profile.json"
    write(_profile(), path)
    rc, out, _ = _cli("plan", "tests.models.zoo:mlp", "--mesh", "2", "--profile", str(path), "--json")
    assert rc == 0
    est = json.loads(out)
    rc, base, _ = _cli("plan", "tests.models.zoo:mlp", "--mesh", "2", "--cost-preset", "cpu", "--json")
    assert rc == 0 and json.dumps(est) != json.dumps(json.loads(base))  # priced by other figures
    rc, _, err = _cli("plan", "tests.models.zoo:mlp", "--profile", str(path), "--cost-preset", "cpu")
    assert rc == 1 and "--profile and --cost-preset" in err
    rc, _, err = _cli("plan", "tests.models.zoo:mlp", "--profile", str(tmp_path / "none.json"))
    assert rc == 1 and "no cost profile" in err and "calibrate" in err
    # the cluster calculator prices GPUs by their figures (core/cost.py GPUS); calibrate measures this
    # machine's CPU kernels, so a profile there is refused, not dropped
    rc, _, err = _cli("plan", "gpt2", "--gpus", "8", "--profile", str(path))
    assert rc == 1 and "--profile" in err and "not for the cluster calculator" in err


def test_calibrate_refuses_what_it_cannot_measure():
    rc, _, err = _cli("calibrate", "--nproc", "1")
    assert rc == 1 and "--nproc must be at least 2" in err
    rc, _, err = _cli("calibrate", "--nproc", "2", "--mesh", "2x2")
    assert rc == 1 and "holds 4 ranks" in err
    rc, _, err = _cli("calibrate", "--names", "dp")
    assert rc == 1 and "--names names the dims of --mesh" in err


@pytest.mark.slow
def test_calibrate_measures_two_gloo_processes(tmp_path):
    """``shardwise calibrate --nproc 2 --quick`` end to end (about a minute on the shared 2 cores): every
    section measured, positive, said where it came from, and read back as a cost model."""
    path = tmp_path / "profile.json"
    rc, out, _ = _cli("calibrate", "--nproc", "2", "--quick", "--out", str(path))
    assert rc == 0 and "wrote" in out
    prof = read(path)
    assert prof["source"]["nproc"] == 2 and prof["source"]["torch"] == torch.__version__
    assert all(r > 0 for _, r in prof["compute"]["float32"]["matmul"] + prof["compute"]["float32"]["attention"])
    assert set(prof["links"]["*"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    cost = sw.CostModel.from_profile(str(path))
    assert cost.op_overhead > 0 and 0 < cost.efficiency("matmul", 1e5) <= 1


@pytest.mark.slow
def test_calibrate_under_torchrun(tmp_path):
    """The ranks torchrun started (as on several nodes) measure together; rank 0 writes the profile."""
    from shardwise.run.launch import run_script

    out = tmp_path / "profile.json"
    script = tmp_path / "calibrate_here.py"
    script.write_text("import sys\nfrom shardwise.tools.calibrate import run_cli\n"
                      f"sys.exit(run_cli(None, {str(out)!r}, True))\n")
    assert run_script(str(script), 2) == 0
    prof = read(out)
    assert prof["source"]["nproc"] == 2 and set(prof["links"]["*"]) >= {"all_reduce", "all_to_all"}
    assert sw.CostModel.from_profile(str(out)).collectives
