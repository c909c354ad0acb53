"""``shardwise plan MODEL --compare``'s table says what it means (issue 51): the global batch of
each row (it differs by row), "n/a (pipeline: per-stage peaks)" where a pipeline row has no
reserved figure, and a progress bar on a terminal's stderr while the meshes are estimated.

    python -m pytest tests/cli/test_compare_table.py -q -p no:cacheprovider
"""
from __future__ import annotations

import io
from types import SimpleNamespace

from shardwise.cli.cluster import compare_progress
from shardwise.core.mesh import Mesh
from shardwise.tools.cluster.report import PIPELINE_RESERVED, compare_text


def _row(shape, names, global_batch, reserved, pipeline=None, pp=1):
    memory = {"peak": 40 * 2 ** 30, "reserved": reserved}
    return SimpleNamespace(mesh=Mesh(shape, names), job=SimpleNamespace(pp=pp), global_batch=global_batch,
                           layout=SimpleNamespace(name="fsdp", memory=memory, pipeline=pipeline),
                           step_time_s=1.5, tokens_per_s_per_gpu=1000.0, mfu=0.4, fits=True)


def test_global_batch_and_pipeline_reserved_columns():
    rows = [_row((8,), ("dp",), 8, 50 * 2 ** 30), _row((2, 4), ("dp", "tp"), 2, 48 * 2 ** 30),
            _row((2,), ("dp",), 16, None, pipeline=object(), pp=4)]
    text = compare_text(rows)
    head, *lines = text.splitlines()
    assert "global batch" in head and "peak/GPU" in head, head
    assert [line.split()[4] for line in lines[:2]] == ["8", "2"], text  # each row's own batch
    assert PIPELINE_RESERVED in lines[2], text
    assert " - " not in text


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_compare_progress_on_a_terminal_only():
    tty = _Terminal()
    with compare_progress(tty) as progress:
        progress(0, 3, "8")
        progress(1, 3, "2x4")
    assert "estimating meshes" in tty.getvalue() and "2x4" in tty.getvalue(), tty.getvalue()
    pipe = io.StringIO()
    with compare_progress(pipe) as progress:
        assert progress is None
    assert pipe.getvalue() == ""
