"""``shardwise plan MODEL --gpu G --gpus N ...``: the cluster calculator from the command line.

    shardwise plan llama3-8b --gpu h100 --gpus 64 --gpus-per-node 8 --seq 8192 --local-batch 2 \\
        --mixed-precision bf16 --activation-checkpointing selective --memory-budget 80GiB [--compare | --search-mesh]
    shardwise plan --config config.json --gpu a100 --gpus 16 --json
    shardwise plan llama3-405b --gpu h100-hbm2e --gpus 512 --pp 8 --mesh 8x8 --microbatches 32 --schedule interleaved

MODEL is a named shape (tools/cluster/models.py) or --config a Hugging Face config.json; the work
is tools/cluster/calc.py's, the output tools/cluster/report.py's.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import sys

from ..core.errors import CliError

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str | None) -> float | None:
    """'80GiB', '80 GB', '8.5e10' -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise CliError(f"cannot read a memory size from {text!r}", fix="write e.g. 80GiB, 80GB or 85899345920")
    try:
        return float(m.group(1)) * _UNITS[unit]
    except ValueError as e:
        raise CliError(f"cannot read a memory size from {text!r}", fix="write e.g. 80GiB") from e


def job_of(args):
    from ..tools.cluster.calc import Job

    if args.gpus is None and args.mesh_given:
        args.gpus = math.prod(args.mesh) * args.pp
    if args.gpus is None or args.gpus < 1:
        raise CliError("the calculator needs --gpus N (or --mesh)", fix="e.g. --gpus 64 --gpus-per-node 8")
    for name in ("seq", "local_batch", "gpus_per_node", "pp", "microbatches", "stages_per_rank"):
        if getattr(args, name) is None:
            continue
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    model = None if args.config else args.target
    layout = getattr(args, "layout", None)  # --layout: that one layout evaluated; else every candidate ranked
    return Job(model, gpu=args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node, seq=args.seq,
               local_batch=args.local_batch, precision=args.mixed_precision or "fp32",
               checkpoint=args.activation_checkpointing or "none", memory_budget=parse_bytes(args.memory_budget),
               config_path=args.config, pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
               stages_per_rank=args.stages_per_rank, allocator=args.allocator,
               **({"candidates": (layout,)} if layout else {}))


@contextlib.contextmanager
def compare_progress(stream=None):
    """Yields ``progress(done, total, mesh)`` for calc.compare: a rich bar on stderr while the
    meshes are estimated (a minute or more for a large model), nothing where stderr is no terminal."""
    stream = sys.stderr if stream is None else stream
    if not (getattr(stream, "isatty", None) and stream.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("estimating meshes"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(file=stream), transient=True)
    task = bar.add_task("", total=None)

    def progress(done: int, total: int, mesh: str) -> None:
        bar.update(task, completed=done, total=total, description=mesh)

    with bar:
        yield progress


def cluster_command(args) -> int:
    """Estimate, compare or search meshes; print text or JSON; write HTML."""
    from ..core.cost import GPUS
    from ..tools.cluster import calc, report

    if args.gpu not in GPUS:
        raise CliError(f"unknown --gpu {args.gpu!r}", fix=f"use one of {', '.join(sorted(GPUS))}")
    job = job_of(args)
    if args.compare or args.search_mesh:
        with compare_progress() as progress:
            rows = calc.compare(job, progress=progress)
        shown = rows[:1] if args.search_mesh else rows
    else:
        mesh = tuple(args.mesh) if args.mesh_given else None
        names = args.names if args.mesh_given and args.names_given else None
        shown = [calc.estimate(job, mesh, names)]
    if args.json:
        out = [report.data(e) for e in shown]
        print(json.dumps(out[0] if len(out) == 1 and not args.compare else out, indent=1))
    elif args.compare:
        print(report.compare_text(shown))
        print()
        print(report.text(shown[0]))
    else:
        if args.search_mesh:
            searched = [("" if pp == 1 else f"pp {pp} x ") + "x".join(map(str, s)) for pp in calc.pipeline_sizes(job)
                        for s in calc.factorisations(job.gpus // pp, job.gpus_per_node)]
            print(f"searched meshes: {', '.join(searched)}")
        print(report.text(shown[0]))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(report.html(shown))
        print(f"wrote {args.html}", file=sys.stderr if args.json else sys.stdout)
    return 0
