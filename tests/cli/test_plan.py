"""``shardwise plan`` on an example model (the tests' TinyLM, Megatron on "tp", batch on "dp"):
text with module paths and source lines, --json for tools, --html opened in headless Chromium
(no console errors, charts drawn, a screenshot under the test's tmp dir)."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

from shardwise.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = f"{ROOT}/tests/models/zoo.py:transformer"  # path.py:factory, from any working directory
ARGS = ["--mesh", "2x2", "--names", "dp,tp", "--placements", "megatron"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One plan run writing JSON (stdout) and the HTML report."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("plan")
    html = out / "report.html"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", TARGET, *ARGS, "--json", "--html", str(html)])
    assert rc == 0
    return json.loads(buf.getvalue()), html


def test_plan_text_names_modules_and_source_lines(capsys):
    assert main(["plan", "tests.models.zoo:mlp", "--mesh", "2", "--nodes"]) == 0  # module:factory
    out = capsys.readouterr().out
    assert "weights on the meta device" in out
    assert "inputs: dim 0 of input 0 sharded on 'dp'" in out
    assert "plan (step) on mesh 2 (dp): 2 ranks" in out
    assert re.search(r"^addmm\s+addmm\s+fc1\s+.*zoo\.py:\d+", out, re.M), out  # node, op, module, source
    # no parameter placements given: the ILP places them, and the first lines say so
    assert "parameters: none given, so the planner places every one (ILP" in out.splitlines()[1], out
    assert re.search(r"^grad fc1\.weight\s+<- \w+\s+fc1\s+\[P\] -> \[.*\]\s+(all_reduce|reduce_scatter)", out, re.M), out
    assert re.search(r"^fc1\.weight\s+\[.*\]\s+chosen by the planner", out, re.M), out


def test_plan_keeps_given_placements(capsys):
    """--placements: the parameters stay as given (propagation from them), and the first lines say so."""
    assert main(["plan", "tests.models.zoo:mlp", "--mesh", "2", "--names", "tp", "--placements", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "placed as given (--placements)" in out.splitlines()[1], out


def test_plan_json_is_consistent(report):
    data, html = report
    assert data["schema"] == "shardwise.search/1" and data["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"], "size": 4}
    qkv = [n for n in data["nodes"] if n["module"] == "blocks.0.qkv" and n["op"] == "addmm"]
    assert qkv and "zoo.py" in qkv[0]["source"] and qkv[0]["outs"] == ["[S(0),S(1, groups=3)]"]
    assert {p["name"]: p["placements"] for p in data["params"]}["blocks.1.proj.weight"] == "[R,S(1)]"
    # the per-kind figures add up to the plan's own stats
    stats = data["stats"]["collectives"]
    assert {k: v["count"] for k, v in data["by_kind"].items()} == stats
    assert sum(v["bytes"] for v in data["by_kind"].values()) == data["stats"]["comm_bytes"]
    assert sum(m["comm_bytes"] for m in data["by_module"]) == data["stats"]["comm_bytes"]
    mem = data["memory_per_rank"]
    assert len(mem) == 4 and max(m["parameters"] for m in mem) == data["stats"]["memory"]["parameters"]
    # each rank's gradients are those made by its peak: the busiest rank's as the plan's stats say
    assert max(m["gradients"] for m in mem) == data["stats"]["memory"]["gradients"]
    # the caching allocator holds at least the peak (optimizer state included) in whole segments
    reserved = data["reserved_memory_bytes"]
    assert set(reserved) == {"expandable", "segments"} and min(reserved.values()) >= data["stats"]["peak_memory_bytes"]
    assert all(r % (2 << 20) == 0 for r in reserved.values())
    assert "CUDA allocator reserve (expandable segments)" in html.read_text()


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium here: the HTML report is not opened (.ci/run installs Debian's chromium; "
                "locally: apt-get install chromium)")


def _browse(chromium, url, tmp_path, *extra):
    profile = tmp_path / f"profile{len(list(tmp_path.iterdir()))}"
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_html_report_renders_in_chromium(report, tmp_path):
    chromium = _chromium()
    _, html = report
    text = html.read_text()
    assert "http://" not in text and "https://" not in text  # self-contained: nothing fetched
    shot = tmp_path / "report.png"
    got = _browse(chromium, html.as_uri(), tmp_path, "--window-size=1400,2400", f"--screenshot={shot}")
    console = [line for line in got.stderr.splitlines() if ":CONSOLE" in line]
    assert got.returncode == 0 and not console, "\n".join(console) or got.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 20_000, "the screenshot is missing or blank"
    dom = _browse(chromium, html.as_uri(), tmp_path, "--dump-dom").stdout
    for chart in ("layers", "comm-layer", "comm-kind", "memory"):
        svg = re.search(rf'<svg id="{chart}".*?</svg>', dom, re.S)
        assert svg and svg.group(0).count("<rect") >= 3, f"chart {chart} not drawn"
    assert dom.count("<tr>") > 100  # the node table: every node with its module and source line


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_placements_file(tmp_path, capsys, suffix):
    """--placements FILE: inputs and parameters from JSON (or YAML), placements as text."""
    spec = {"inputs": {"0": {"dp": "S(0)"}}, "params": {"fc1.weight": {"tp": "S(0)"}, "fc1.bias": {"tp": "S(0)"},
                                                         "fc2.weight": {"tp": "Shard(1)"}}}
    path = tmp_path / f"placements{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(spec))
    else:
        yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: YAML placement files need it")
        path.write_text(yaml.safe_dump(spec))
    assert main(["plan", "tests.models.zoo:mlp", "--mesh", "2x2", "--names", "dp,tp",
                 "--placements", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = {p["name"]: p["placements"] for p in data["params"]}
    assert got == {"fc1.weight": "[R,S(0)]", "fc1.bias": "[R,S(0)]", "fc2.weight": "[R,S(1)]", "fc2.bias": "[R,R]"}
    assert data["inputs_note"] == ""  # the file's input placements were used, not the default
