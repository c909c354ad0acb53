"""The Python examples of the docs run as written: docs/rules.md (a custom op, its rule,
verify_rule on every strategy with uneven sizes, and a sharded training step that matches one
device) and every ```python block of docs/guide.md, in order; docs/README.md lists every page."""
from __future__ import annotations

import pathlib
import re

import torch

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS / "rules.md"


def test_rules_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 4
    scope: dict = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), scope)
    report = scope["report"]
    assert report.ok and len(report.results) >= 3
    # the partial-sum strategy was among those checked
    assert any("Partial" in repr(r.strategy) for r in report.results)
    model, x = scope["pm"].model, scope["x"]
    want = model(x)
    torch.testing.assert_close(scope["loss"], want.detach(), rtol=1e-4, atol=1e-6)
    want.backward()
    for n, g in scope["pm"].gradients().items():
        torch.testing.assert_close(g, dict(model.named_parameters())[n].grad, rtol=1e-4, atol=1e-6)


def test_guide_examples_run(capsys):
    """Every ```python block of docs/guide.md, in order, in one namespace (later blocks use what
    earlier ones made), as a reader would paste them."""
    guide = DOCS / "guide.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    assert len(blocks) >= 7
    scope: dict = {}
    for code in blocks:
        exec(compile(code, str(guide), "exec"), scope)
    out = capsys.readouterr().out
    assert "[(3, 8), (3, 8), (2, 8), (2, 8)]" in out  # the local shapes the guide's comment states
    assert "nodes whose strategy differs" in out  # plan.compare's report
    # Mixed precision: FSDP's gathers in bf16, the gradients' reduce_scatters in fp32, as the comment says
    assert "'all_gather': {'bfloat16': 5}" in out and "'reduce_scatter': {'float32': 4}" in out
    assert scope["loss"].dim() == 0 and scope["out"].shape == (10, 4)


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    assert pages <= linked, pages - linked
    assert all((DOCS / p).is_file() for p in linked)
