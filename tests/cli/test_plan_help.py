"""``shardwise plan``'s help gives examples that run outside the repository, and its placement
files and --inputs take placements as Python spells them too (issue 51).

    python -m pytest tests/cli/test_plan_help.py -q -p no:cacheprovider
    python -m pytest tests/cli/test_plan_help.py -q -m slow     # the calculator's examples too
"""
from __future__ import annotations

import contextlib
import io
import json
import shlex

import pytest

from shardwise import Partial, Replicate, Shard
from shardwise.cli import main, parser
from shardwise.cli.plan import EXAMPLES, FACTORY_FILE, parse_placement
from shardwise.core.errors import CliError

SPELLINGS = {
    Shard(0): ["S(0)", "Shard(0)", "Shard(dim=0)", "sw.Shard(0)", " Shard( 0 ) "],
    Shard(1, unit=4): ["S(1, unit=4)", "Shard(1, unit=4)", "Shard(dim=1, unit=4)"],
    Replicate(): ["R", "Replicate()", "sw.Replicate()"],
    Partial(): ["P", "Partial()", 'Partial("sum")', "Partial('sum')", 'Partial(op="sum")'],
    Partial("max"): ["P(max)", "Partial('max')", 'Partial(op="max")'],
}


@pytest.mark.parametrize("want", list(SPELLINGS), ids=repr)
def test_every_spelling_reads_the_same(want):
    for text in SPELLINGS[want]:
        assert parse_placement(text) == want, text


@pytest.mark.parametrize("bad", ["Shard()", "Shard(x)", "Replicate(0)", 'Partial("avg")', "Shard(0, 1)", "Q(0)",
                                 "Partial(sum, max)"])
def test_unreadable_placements_say_how_to_write_one(bad):
    with pytest.raises(CliError) as err:
        parse_placement(bad)
    assert repr(bad) in str(err.value) and err.value.fix, err.value


def _run(argv: list) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_inputs_and_placement_files_in_python_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.py").write_text(FACTORY_FILE)
    short = json.loads(_run(["plan", "mymodel.py:build", "--mesh", "2", "--inputs", '{"0": ["S(0)"]}', "--json"]))
    spelled = json.loads(_run(["plan", "mymodel.py:build", "--mesh", "2", "--inputs", '{"0": ["Shard(0)"]}',
                               "--json"]))
    assert short["nodes"] == spelled["nodes"] and "S(0)" in json.dumps(short["nodes"])
    (tmp_path / "placements.json").write_text(json.dumps(
        {"inputs": {"0": {"dp": "Shard(0)"}}, "params": {"0.weight": {"dp": "Replicate()"}}}))
    text = _run(["plan", "mymodel.py:build", "--mesh", "2", "--placements", "placements.json", "--nodes"])
    assert "S(0)" in text, text


def test_help_names_no_file_of_the_repository():
    for argv in ([], ["plan"]):
        text = io.StringIO()
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            parser().parse_args([*argv, "--help"])
        assert "tests/" not in text.getvalue() and "zoo" not in text.getvalue(), text.getvalue()
        assert "mymodel.py:build" in text.getvalue()


@pytest.mark.parametrize("example", [pytest.param(e, marks=[pytest.mark.slow] if "mymodel" not in e else [])
                                     for e in EXAMPLES])
def test_help_examples_run_outside_the_repository(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel.py").write_text(FACTORY_FILE)
    words = shlex.split(example)
    assert words[0] == "shardwise"
    assert _run(words[1:]).strip()
