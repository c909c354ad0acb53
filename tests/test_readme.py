"""The README's examples run as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), scope)
    out = capsys.readouterr().out
    assert "# stage: plan (step)" in out and "# stage: lower (per-rank program, rank 0)" in out
    assert scope["loss"].dim() == 0
