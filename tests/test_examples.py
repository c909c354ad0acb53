"""examples/hf_llama.py runs and matches one device: the training part on threads here; its bf16
and pipeline parts, and the whole script under ``shardwise run --nproc 2``, behind slow.

    python -m pytest tests/test_examples.py -q
    python -m pytest tests/test_examples.py -q -m slow
"""
from __future__ import annotations

import pathlib
import re
import runpy
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF_LLAMA = ROOT / "examples" / "hf_llama.py"


def _run_example(monkeypatch, capsys, *argv) -> tuple[int, str]:
    module = runpy.run_path(str(HF_LLAMA), run_name="hf_llama")
    monkeypatch.setattr(sys, "argv", [str(HF_LLAMA), *argv])
    code = module["main"]()
    return code, capsys.readouterr().out


def _assert_all_match(code: int, out: str, checks: int) -> None:
    lines = [line for line in out.splitlines() if line.startswith(("MATCH", "MISMATCH"))]
    assert code == 0 and "MISMATCH" not in out, out
    assert len(lines) == checks + 1 and lines[-1] == "MATCH", out


def test_hf_llama_trains_resumes_and_matches_one_device(monkeypatch, capsys, tmp_path):
    """Two data-parallel steps with activation checkpointing, a forward call in eval mode, two more
    steps resumed from the Checkpointer: each against one device (rtol 1e-4)."""
    code, out = _run_example(monkeypatch, capsys, "--ckpt", str(tmp_path / "ck"))
    _assert_all_match(code, out, 3)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000002", "step_00000004"]


def test_hf_llama_checks_can_fail():
    module = runpy.run_path(str(HF_LLAMA), run_name="hf_llama")
    checks = module["Checks"](0)
    checks.close("same", torch.ones(3), torch.ones(3), rtol=1e-4, atol=0)
    checks.close("off", torch.ones(3), torch.ones(3) * (1 + 1e-3), rtol=1e-4, atol=0)
    assert checks.failed == ["off: max abs error 0.001"]


def test_the_guides_hugging_face_section_is_the_example():
    """docs/guide.md's Hugging Face section comes first and quotes calls the example makes."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    sections = re.findall(r"^## (.+)$", guide, re.M)
    assert sections[0].startswith("Hugging Face"), sections[:2]
    section = guide.split("\n## ")[1]
    code = "\n".join(re.findall(r"```py\n(.*?)```", section, re.S))
    example = HF_LLAMA.read_text()
    calls = [line.split("#")[0].strip() for line in code.splitlines() if line.split("#")[0].strip()]
    assert len(calls) >= 8
    for call in calls:
        assert call in example, call
    assert "shardwise run examples/hf_llama.py --nproc 2" in section and "examples/hf_llama.py" in example


@pytest.mark.slow
def test_hf_llama_bf16_and_pipeline_parts(monkeypatch, capsys):
    for part in ("bf16", "pipeline"):
        code, out = _run_example(monkeypatch, capsys, "--part", part)
        _assert_all_match(code, out, 1)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_hf_llama_under_shardwise_run(capfd):
    """The whole example on 2 gloo processes (the torch backend), every part."""
    from shardwise.cli import main

    code = main(["run", str(HF_LLAMA), "--nproc", "2", "--", "--part", "all"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    lines = [line.split("]:", 1)[-1] for line in out.splitlines() if "MATCH" in line]
    assert len(lines) == 6 and "MISMATCH" not in out and lines[-1] == "MATCH", out
