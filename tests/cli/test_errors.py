"""Command-line manners: --help lists what exists, errors are one line with the fix and a
non-zero exit, --debug shows the traceback."""
from __future__ import annotations

import pathlib

import pytest

import shardwise as sw
from shardwise.cli import main, one_line


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for cmd in ("demo", "plan", "run", "verify-rules", "bench"):
        assert cmd in out
    assert "not there yet" not in out


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    """The relative paths below are the repository's."""
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("argv, words", [
    (["plan", "no/such/file.py:build"], "no file 'no/such/file.py'"),
    (["plan", "tests/models/zoo.py:nothing"], "has no callable 'nothing'"),
    (["plan", "tests.models.zoo"], "is not module:factory"),
    (["plan", "tests/models/zoo.py:mlp", "--placements", "zero3"], "is neither a file nor a recipe"),
    (["plan", "tests/models/zoo.py:mlp", "--mesh", "2x2", "--names", "dp"], "has 2 dims but --names gives 1"),
    (["demo", "--backend", "torch", "--nproc", "3"], "--nproc 3 does not match the mesh's 4 ranks"),
    (["demo", "--nproc", "4"], "only the torch backend uses"),
    (["run", "no_such_script.py", "--nproc", "2"], "no script 'no_such_script.py'"),
    # each mode of `shardwise plan` refuses the options only the other reads (never dropped in silence)
    (["plan", "tests/models/zoo.py:mlp", "--gpus", "8", "--allocator", "segments"],
     "--gpus, --allocator: for the cluster calculator"),
    (["plan", "llama3-8b", "--gpus", "8", "--placements", "megatron", "--bandwidth", "1e9"],
     "--placements, --bandwidth: for planning a model file"),
])
def test_errors_are_one_line_with_the_fix(capsys, argv, words):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert words in err and "(fix: " in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_debug_shows_the_traceback():
    with pytest.raises(sw.ShardingError, match="no file"):
        main(["plan", "no/such/file.py:build", "--debug"])


def test_one_line_joins_a_multiline_error():
    e = sw.UnsupportedOpError("aten.foo.default", node="foo", source="model.py:3 in forward: x.foo()")
    line = one_line(e)
    assert "\n" not in line and "aten.foo.default" in line and "model.py:3" in line and "(fix: register" in line


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--mesh", "2y"])
    assert e.value.code == 2 and "write it as 2x2" in capsys.readouterr().err
