"""bench/gpu_check.py's CPU mode (``--cpu --quick``: one case of each check, gloo, CUDA-only rows
skipped with their reason) exits 0 with every row ok against one device, and exits 1 when a row
does not match. On a GPU the script runs whole (docs/gpu.md).

    python -m pytest tests/test_gpu_check.py -q
"""
from __future__ import annotations

import torch

from bench import gpu_check


def test_cpu_mode_matches_one_device(capsys):
    assert gpu_check.main(["--cpu", "--quick", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    for check in ("threads", "bf16", "attention", "memory", "group", "compile"):
        assert check in out, out
    assert "0 failed" in out and "skipped" in out, out


def test_a_mismatch_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "local_rows", lambda *a, **k: [
        gpu_check.row("threads", "fake", lambda: ("grad of w: max error 1", "")),
        gpu_check.row("threads", "raises", lambda: 1 / 0)])
    assert gpu_check.main(["--cpu"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "ERROR" in out and "ZeroDivisionError" in out, out


def test_compare_tells_fp32_and_bf16_apart():
    want = torch.tensor([1.0, -2.0])
    assert gpu_check.compare(want, {"w": want * (1 + 1e-6)}, want, {"w": want}) is None
    assert "grad of w" in gpu_check.compare(want, {"w": want * 1.01}, want, {"w": want})
    assert gpu_check.compare(want, {"w": want * 1.01}, want, {"w": want}, bf16=True) is None  # 16 ulps: 6%
    assert "no gradient" in gpu_check.compare(want, {}, want, {"w": want})
