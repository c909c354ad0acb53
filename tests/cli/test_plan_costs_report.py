"""``shardwise plan`` carries the cost model's figures: the modelled step time, flops per rank,
optimizer state, the cost per layer and why each parameter is placed; the per-layer figures
add up to the plan's totals."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from shardwise.cli import main

ARGS = ["plan", "tests.models.zoo:mlp", "--mesh", "2", "--planner", "propagate"]  # one plan under every cost model


@pytest.fixture(scope="module")
def data():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*ARGS, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_json_costs_add_up(data):
    st = data["stats"]
    assert st["est_step_time_s"] == pytest.approx(st["comm_time_s"] + st["compute_time_s"] + st["optimizer_time_s"])
    assert st["flops_per_rank"] > 0 and st["comm_bytes_by_dim"] == {"dp": st["comm_bytes"]}
    layers = data["layers"]
    assert sum(lc["comm_bytes"] for lc in layers) == st["comm_bytes"]
    assert sum(lc["comm_s"] for lc in layers) == pytest.approx(st["comm_time_s"])
    assert sum(lc["flops"] for lc in layers) == pytest.approx(st["flops_per_rank"])  # every node, even batch
    assert 0 < max(lc["peak_live_bytes"] for lc in layers) <= st["memory"]["peak"]  # the liveness curve's
    for m in data["memory_per_rank"]:
        assert m["optimizer_state"] == 2 * m["parameters"]  # AdamW's two moments
    whys = {p["name"]: p["why"] for p in data["param_reasons"]}
    assert set(whys) == {p["name"] for p in data["params"]} and all(whys.values())


def test_text_shows_the_modelled_step(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "est. step time (busiest rank):" in out and "optimizer state" in out
    assert "on CUDA, PyTorch's caching allocator would reserve" in out


def test_cost_preset_prices_the_plan():
    """--cost-preset h100: compute at 989 Tflop/s (bf16 dense) or 3.35 TB/s, whichever binds;
    links 450 GB/s and 2 us; a flag given with it overrides the preset's figure."""
    runs = {}
    for name, extra in (("h100", []), ("slow", ["--bandwidth", "1e9"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main([*ARGS, "--json", "--cost-preset", "h100", *extra]) == 0
        runs[name] = json.loads(buf.getvalue())["stats"]
    fast, slow = runs["h100"], runs["slow"]
    assert fast["comm_bytes"] == slow["comm_bytes"] > 0
    rounds = fast["comm_time_s"] - fast["comm_bytes"] / 450e9  # latency part: the same under both
    assert slow["comm_time_s"] == pytest.approx(rounds + slow["comm_bytes"] / 1e9)
    assert fast["compute_time_s"] >= fast["flops_per_rank"] / 989e12


def test_html_has_the_cost_per_layer_and_who_placed_each_parameter(data):
    from shardwise.tools.report import render_html as render

    html = render(data)
    assert "<h2>Cost per layer</h2>" in html and "<th>placed by</th>" in html
    for lc in data["layers"]:
        assert f"<tr><td>{lc['layer']}</td>" in html
    assert html.count("<td>default</td>") == len(data["params"])  # zoo.mlp: nothing given, propagate
