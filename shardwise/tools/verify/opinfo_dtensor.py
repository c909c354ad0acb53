"""The OpInfo sweep's cases through DTensor, for ``shardwise verify-rules --opinfo``'s side-by-side count.

Each case (tools/verify/opinfo.op_cases: the same samples and sharded dims) runs on DTensor over a
fake 2-rank process group (``dist.init_process_group("fake", store=FakeStore(), rank=0,
world_size=2)``: collectives do nothing, so values are not compared, only whether DTensor can
shard the op): the primary input ``Shard(dim)``, the other tensors ``Replicate()``, forward and
the backward of ``sum((out_i * w_i).sum())``. A case is ``ok`` (no error), ``no_strategy`` (an
op without a DTensor sharding strategy: the error names it) or ``error`` (anything else).

It runs in its own process (``dtensor_counts``), so the fake default group never meets
shardwise's runs:

    python -m shardwise.tools.verify.opinfo_dtensor --samples 2 --dims all --out rows.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.utils._pytree as pytree

NO_STRATEGY = re.compile(r"Operator (\S+) does not have a sharding strategy")


def _run(info, sample, case, mesh) -> tuple[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    leaves, spec = pytree.tree_flatten(sample)
    first = next(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))

    def dt(i, x):
        if not isinstance(x, torch.Tensor):
            return x
        place = [Shard(case.dim)] if i == first and case.dim is not None else [Replicate()]
        t = distribute_tensor(x.detach().clone(), mesh, place)
        return t.requires_grad_() if x.requires_grad and x.is_floating_point() else t

    try:
        x, args, kwargs = pytree.tree_unflatten([dt(i, v) for i, v in enumerate(leaves)], spec)
        outs = [o for o in pytree.tree_leaves(info.op(x, *args, **kwargs)) if isinstance(o, torch.Tensor)]
        loss = sum((o.float() * distribute_tensor(torch.ones(o.shape), mesh, [Replicate()])).sum() for o in outs)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        return "ok", ""
    except Exception as e:  # noqa: BLE001 - what DTensor raised is the datum
        found = NO_STRATEGY.search(str(e))
        if found:
            return "no_strategy", found.group(1).rstrip(".")
        return "error", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def dtensor_rows(samples: int, dims: str, op_filter: str | None = None) -> list:
    """Every case through DTensor, in this process (which must not be planning shardwise runs)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .opinfo import full_name, op_cases, op_infos

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        rows = []
        for info in op_infos(op_filter):
            cases, _ = op_cases(info, samples, dims)
            for sample, case, _ in cases:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    kind, detail = _run(info, sample, case, mesh)
                rows.append({"op": full_name(info), "sample": case.sample, "dim": case.dim, "kind": kind,
                             "detail": detail})
        return rows
    finally:
        dist.destroy_process_group()


def dtensor_counts(samples: int, dims: str, op_filter: str | None = None, timeout: float = 3600) -> list:
    """``dtensor_rows`` in a subprocess (the fake default group stays there)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = [sys.executable, "-W", "ignore", "-m", __name__, "--samples", str(samples), "--dims", dims, "--out", out]
        if op_filter:
            cmd += ["--op", op_filter]
        subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--dims", choices=("all", "first"), default="all")
    p.add_argument("--op", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = dtensor_rows(a.samples, a.dims, a.op)
    with open(a.out, "w") as f:
        json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
