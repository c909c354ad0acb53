"""The README's example runs as written; its set-up is the two lines the issue asks for, the
commands it shows exist, and it stays short enough to read to the end (the rest is docs/guide.md,
whose examples tests/cli/test_docs.py runs)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    quick = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(quick) <= 12, "the quick start grew past a dozen lines"
    scope: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), scope)
    out = capsys.readouterr().out
    assert "# stage: plan (step)" in out and "# stage: lower (per-rank program, rank 0)" in out
    assert scope["loss"].dim() == 0


def test_two_setup_lines_and_commands_that_exist():
    text = README.read_text()
    setup = [line.strip() for line in text.splitlines() if line.strip().startswith("python3 -m venv")]
    assert len(setup) == 2, setup
    assert setup[0].endswith("pip install -e . && shardwise demo")
    assert setup[1].endswith('pip install -e ".[test]" && python -m pytest -n 2')
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == setup[1].rsplit(" && ", 1)[1], "CI runs the README's test command"
    from shardwise.cli import parser

    commands = set(parser()._subparsers._group_actions[0].choices)
    shown = set(re.findall(r"^    shardwise ([a-z-]+)", text, re.M))  # the indented command lines
    assert shown and shown <= commands, shown - commands
    assert "not there yet" not in text


def test_readme_is_short_and_links_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, f"README.md has {len(text.splitlines())} lines (at most 150)"
    docs = README.parent / "docs"
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (README.parent / page).is_file(), page
    assert {"docs/guide.md", "docs/rules.md", "docs/architecture.md"} <= set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert docs.is_dir()
