"""``shardwise run SCRIPT --nproc 2``: a user script on 2 local processes through torch's own
launcher; each rank trains one data-parallel step with the torch backend (gloo) and checks it
against one device, then writes its loss."""
from __future__ import annotations

import textwrap

import pytest

from shardwise.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent('''
    """Run with: shardwise run this.py --nproc 2 -- OUT_DIR"""
    import sys

    import torch
    import torch.distributed as dist

    import shardwise as sw

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(5, 4), torch.randn(5, 2)  # 5 rows on 2 ranks: uneven

    def mse(out, y):
        return torch.nn.functional.mse_loss(out, y)

    pm = sw.parallelize(model, sw.Mesh((dist.get_world_size(),), ("dp",)), (x,),
                        input_placements={0: [sw.Shard(0)]}, loss_fn=mse, backend="torch")
    loss = pm.step(x, y)
    want = mse(model(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-4, atol=1e-6)
    for name, g in pm.gradients().items():
        torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as f:
        f.write(repr(float(loss)))
    dist.destroy_process_group()
''')


def test_run_starts_a_script_on_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["run", str(script), "--nproc", "2", "--", str(out)]) == 0
    losses = [float((out / f"rank{r}.txt").read_text()) for r in range(2)]
    assert losses[0] == losses[1]


@pytest.mark.slow  # the launcher's exit codes are tested in tests/run/test_launch_script.py
def test_run_reports_a_failing_script(tmp_path, capsys):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    assert main(["run", str(script), "--nproc", "1"]) != 0  # one process is enough to see the exit status
