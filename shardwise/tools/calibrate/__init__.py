"""``shardwise calibrate``: measure this machine and write a cost profile.

    shardwise calibrate --nproc 2 --out profile.json          # ~2-4 minutes on a loaded 2-core machine
    shardwise calibrate --nproc 2 --quick                      # fewer sizes, ~1-2 minutes
    shardwise calibrate --nproc 4 --mesh 2x2 --names dp,tp     # links measured per mesh dim
    torchrun --nnodes 2 --nproc-per-node 8 ... -m shardwise.tools.calibrate --mesh 2x8 --names dp,tp
    python -m shardwise.tools.calibrate --nproc 2              # the same as the first line

then ``sw.CostModel.from_profile("profile.json")``, ``parallelize(cost_model=...)`` or
``shardwise plan ... --profile profile.json``.

``nproc`` local processes (shardwise.run.launch.spawn: gloo on 127.0.0.1, a free port, every
process joined or killed before it returns), one thread each, as parallelize's torch backend runs
them; under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set, one node or many) the processes torchrun
started. Every rank measures at once (kernels.py: matmuls by size and dtype, fused attention,
memory-bound kernels by size, a kernel call's fixed cost; links.py: all_reduce, all_gather,
reduce_scatter, all_to_all at a few sizes per mesh dim, fitted to alpha-beta); the profile takes
the median of the ranks' kernel figures and the slowest rank's collective times, and says where
its numbers came from (core/profile.py ``FORMAT``).
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

from ...core.errors import CliError
from ...core.profile import FORMAT, write


def _plan(quick: bool) -> dict:
    from . import kernels, links

    return {"matmuls": kernels.QUICK_MATMULS if quick else kernels.MATMULS,
            "attention": kernels.QUICK_ATTENTION if quick else kernels.ATTENTION,
            "memory": kernels.QUICK_MEMORY_BYTES if quick else kernels.MEMORY_BYTES,
            "numels": links.QUICK_NUMELS if quick else links.NUMELS, "reps": 7 if quick else 11,
            "low_precision": not quick}


def steps_of(plan: dict, mesh_shape) -> int:
    """Ticks one rank reports (the progress bar's total)."""
    from . import kernels, links

    low = sum(1 for s in plan["matmuls"] if max(s) <= kernels.LOW_PRECISION_MAX) if plan["low_precision"] else 0
    dims = 1 if mesh_shape is None else sum(1 for s in mesh_shape if s > 1)
    return len(plan["matmuls"]) + low + len(plan["attention"]) + len(plan["memory"]) + dims * len(links.KINDS)


def measure_rank(rank: int, plan: dict, mesh_shape, names, progress_path: str | None) -> dict:
    """Everything one rank measures (every rank of the group at once)."""
    import torch
    import torch.distributed as dist

    from . import kernels, links

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_tensor collectives: deprecated names
    log = open(progress_path, "a", buffering=1) if progress_path and rank == 0 else None

    def tick(label: str) -> None:
        if log is not None:
            log.write(label + "\n")

    try:
        fixed = kernels.overhead()
        compute = {"float32": kernels.matmul_points(torch.float32, plan["matmuls"], fixed, tick)}
        if plan["low_precision"]:
            small = [s for s in plan["matmuls"] if max(s) <= kernels.LOW_PRECISION_MAX]
            compute["bfloat16"] = kernels.matmul_points(torch.bfloat16, small, fixed, tick)
        attention = kernels.attention_points(plan["attention"], fixed, tick)
        memory = kernels.memory_points(plan["memory"], fixed, tick)
        dist.barrier()
        links_ = links.measure(dist.get_world_size(), mesh_shape, names, plan["numels"], plan["reps"], tick)
        return {"overhead": fixed, "matmul": compute, "attention": attention, "memory": memory, "links": links_}
    finally:
        if log is not None:
            log.close()


def _median_points(per_rank: list) -> list:
    """Point by point, the median rate over ranks (every rank measured the same sizes in order)."""
    return [[pts[0][0], statistics.median(p[1] for p in pts)] for pts in zip(*per_rank)]


def _machine() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_of(results: list, nproc: int, mesh_shape, names, command: str) -> dict:
    """The profile (core/profile.py FORMAT) from every rank's ``measure_rank`` result."""
    import torch

    compute = {}
    for dtype in results[0]["matmul"]:
        mm = _median_points([r["matmul"][dtype] for r in results])
        compute[dtype] = {"peak_flops": max(p[1] for p in mm), "matmul": mm, "attention": []}
    att = _median_points([r["attention"] for r in results])
    compute["float32"]["attention"] = att
    compute["float32"]["peak_flops"] = max([compute["float32"]["peak_flops"]] + [p[1] for p in att])
    mem = _median_points([r["memory"] for r in results])
    source = {"kind": "measured", "machine": platform.node(), "processor": _machine(), "cpus": os.cpu_count(),
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "nproc": nproc, "threads_per_process": 1, "backend": "gloo",
              "device": "cpu", "mesh": list(mesh_shape) if mesh_shape else None, "names": list(names or ()),
              "command": command}
    return {"format": FORMAT, "source": source, "compute": compute,
            "memory": {"peak_bandwidth": max(p[1] for p in mem), "curve": mem},
            "op_overhead_s": statistics.median(r["overhead"] for r in results),
            "links": results[0]["links"], "overlap": False, "device_memory": None}


def _check(nproc: int, mesh_shape, names) -> None:
    import math

    if nproc < 2:
        raise CliError(f"--nproc must be at least 2 to measure collectives, got {nproc}", fix="e.g. --nproc 2")
    if mesh_shape is not None:
        if math.prod(mesh_shape) != nproc:
            raise CliError(f"--mesh {'x'.join(map(str, mesh_shape))} holds {math.prod(mesh_shape)} ranks but "
                           f"--nproc is {nproc}", fix="give --nproc equal to the mesh's size")
        if len(names) != len(mesh_shape):
            raise CliError(f"--mesh has {len(mesh_shape)} dims but --names gives {len(names)}",
                           fix="one name per mesh dim, e.g. --mesh 2x2 --names dp,tp")


def calibrate(nproc: int = 2, out: str | None = "profile.json", quick: bool = False, mesh_shape=None, names=None,
              show_progress: bool = True, timeout: float = 600.0) -> dict:
    """Measure on ``nproc`` local gloo processes and write the profile to ``out`` (None: not written)."""
    from ...run.launch import spawn

    _check(nproc, mesh_shape, names)
    plan = _plan(quick)
    command = " ".join(["shardwise calibrate", f"--nproc {nproc}"] + (["--quick"] if quick else [])
                       + ([f"--mesh {'x'.join(map(str, mesh_shape))} --names {','.join(names)}"] if mesh_shape else []))
    with tempfile.TemporaryDirectory(prefix="shardwise-calibrate-") as tmp:
        progress_path = os.path.join(tmp, "progress")
        done: dict = {}

        def work():
            try:
                done["results"] = spawn(measure_rank, nproc, plan, mesh_shape, names, progress_path, timeout=timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done["error"] = e

        worker = threading.Thread(target=work, name="shardwise-calibrate")
        worker.start()
        _follow(worker, progress_path, steps_of(plan, mesh_shape), show_progress)
        if "error" in done:
            raise done["error"]
    profile = profile_of(done["results"], nproc, mesh_shape, names, command)
    if out:
        write(profile, out)
    return profile


def _follow(worker: threading.Thread, path: str, total: int, show: bool) -> None:
    """A rich bar on stderr of the ticks rank 0 writes to ``path`` until ``worker`` ends."""
    if not show:
        worker.join()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("calibrate"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(file=sys.stderr),
                   transient=True)
    task = bar.add_task("starting processes ...", total=total)
    with bar:
        while worker.is_alive():
            worker.join(0.25)
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            if lines:
                bar.update(task, completed=len(lines), description=lines[-1])


def under_torchrun() -> bool:
    """Started by torchrun (or another launcher that sets the env:// variables)?"""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def calibrate_torchrun(out: str, quick: bool = False, mesh_shape=None, names=None) -> dict | None:
    """This process is one rank of a torchrun job (one node or many): measure with the others;
    rank 0 writes the profile and returns it, the others return None."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    _check(world, mesh_shape, names)
    dist.init_process_group("gloo")
    try:
        import torch

        torch.set_num_threads(1)
        plan = _plan(quick)
        mine = measure_rank(dist.get_rank(), plan, mesh_shape, names, None)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if dist.get_rank() != 0:
            return None
        profile = profile_of(every, world, mesh_shape, names, "torchrun ... -m shardwise.tools.calibrate")
        write(profile, out)
        return profile
    finally:
        dist.destroy_process_group()


def summary(profile: dict) -> str:
    """A few lines: what was measured, in the units people read."""
    from ...core.profile import source_line

    c = profile["compute"]["float32"]
    lines = [source_line(profile),
             f"matmul float32: best {c['peak_flops'] / 1e9:.1f} GFLOP/s, smallest "
             f"{min(c['matmul'])[1] / 1e9:.2f} GFLOP/s at {min(c['matmul'])[0]:.0f} flops",
             f"memory-bound: best {profile['memory']['peak_bandwidth'] / 1e9:.2f} GB/s; "
             f"a kernel call {profile['op_overhead_s'] * 1e6:.1f} us"]
    for dim, kinds in profile["links"].items():
        figs = ", ".join(f"{k} {f['latency_s'] * 1e6:.0f} us + {f['bandwidth'] / 1e9:.2f} GB/s" for k, f in kinds.items())
        lines.append(f"links {dim if dim != '*' else '(all ranks)'}: {figs}")
    return "\n".join(lines)


def run_cli(nproc: int | None, out: str, quick: bool, mesh_shape=None, names=None) -> int:
    """``nproc``: local processes to start (default 2); under torchrun None or torchrun's world size."""
    t0 = time.perf_counter()
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc not in (None, world):
            raise CliError(f"--nproc {nproc} under torchrun, whose world is {world} processes",
                           fix="drop --nproc: under torchrun every rank it started measures")
        profile = calibrate_torchrun(out, quick, mesh_shape, names)
        if profile is None:
            return 0
    else:
        profile = calibrate(2 if nproc is None else nproc, out, quick, mesh_shape, names,
                            show_progress=sys.stderr.isatty())
    print(summary(profile))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s; use it: shardwise plan ... --profile {out}, "
          f"or sw.CostModel.from_profile({out!r})")
    return 0
