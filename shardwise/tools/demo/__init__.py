"""``shardwise demo``: a small GPT (model.py) learns to sort digits (task.py) on a simulated
(2, 2) mesh ("dp", "tp") with the planner's own choice, then the same steps run on one device
and the two are compared (runner.py); ``--backend torch`` uses real gloo processes
(processes.py).

    shardwise demo
    shardwise demo --parallel fsdp --steps 60
    python -c "from shardwise.tools.demo import main; main(steps=3)"
"""
from __future__ import annotations

from .runner import DEMO_FLOPS, PARALLEL, DemoOptions, accuracy, compare, train_sharded, train_single


def _console(file=None):
    from rich.console import Console

    return Console(file=file, highlight=False, soft_wrap=True)


def _progress(console, steps: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:>8,.0f} tokens/s"),
                    TimeElapsedColumn(), console=console)


def _train_threads(opts: DemoOptions, console):
    with _progress(console, opts.steps) as bar:
        task = bar.add_task("train", total=opts.steps, loss=float("nan"), tps=0.0, visible=False, start=False)

        def on_plan(res):
            bar.console.print(f"planned in {res.plan_seconds:.1f} s:\n{res.brief}")
            if res.summary:
                bar.console.print(res.summary, markup=False)
            bar.update(task, visible=True)
            bar.start_task(task)  # the clock counts training, not planning

        def progress(step, loss, tps):
            bar.update(task, completed=step + 1, loss=loss, tps=tps)

        return train_sharded(opts, progress=progress, on_plan=on_plan)


def run(opts: DemoOptions, console=None) -> int:
    """The whole demo; 0 when the sharded run matches one device, 1 otherwise.

    torch's intra-op threads are set to 1 meanwhile: the model is tiny, the simulated ranks are
    threads already, and on a busy machine OpenMP workers spinning for cores slow every op."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(opts, console or _console())
    finally:
        torch.set_num_threads(before)


def _run(opts: DemoOptions, console) -> int:
    opts.check()
    mesh = "x".join(map(str, opts.mesh))
    where = "threads in this process" if opts.backend == "threads" else "gloo processes, one per rank"
    console.print(f"[bold]shardwise demo[/bold]: a {opts.steps}-step run of a small GPT learning to sort "
                  f"{opts.length} digits, on a {mesh} mesh {tuple(opts.names)} ({where}), parallelism: {opts.parallel}")
    if opts.parallel == "auto":
        console.print(f"the ILP planner chooses every node's layout, costing compute at {DEMO_FLOPS:.0e} flop/s "
                      "per rank (a CPU thread's rate, as here)")
    if opts.backend == "torch":
        from .processes import train_processes

        console.print("starting processes (torch.distributed, gloo) ...")
        sharded = train_processes(opts)
        console.print(f"plan (rank 0, planned in {sharded.plan_seconds:.1f} s):\n{sharded.brief}")
        if sharded.summary:
            console.print(sharded.summary, markup=False)
    else:
        sharded = _train_threads(opts, console)
    tokens = opts.batch * 2 * opts.length * opts.steps
    console.print(f"sharded: loss {sharded.losses[0]:.4f} -> {sharded.losses[-1]:.4f} in {sharded.seconds:.1f} s "
                  f"({tokens / max(sharded.seconds, 1e-9):,.0f} tokens/s); sorted digits right: "
                  f"{accuracy(opts, sharded.state):.0%}")
    single = train_single(opts)
    console.print(f"one device: loss {single.losses[0]:.4f} -> {single.losses[-1]:.4f} in {single.seconds:.1f} s")
    cmp = compare(sharded, single)
    console.print(f"max |loss difference| over {opts.steps} steps: {cmp.max_loss_diff:.2e}; "
                  f"max |parameter difference|: {cmp.max_param_diff:.2e} ({cmp.worst_param}), "
                  f"relative {cmp.max_rel_param_diff:.1e}")
    if cmp.match:
        console.print("[bold green]MATCH[/bold green]: the sharded run and the single-device run agree "
                      "(every loss within rtol 1e-4, every parameter tensor within 1e-4 relative).")
        return 0
    console.print("[bold red]MISMATCH[/bold red]: the sharded run differs from one device beyond rtol 1e-4; "
                  "please report it with the command you ran.")
    return 1


def main(**options) -> int:
    return run(DemoOptions(**options))


__all__ = ["DemoOptions", "PARALLEL", "run", "main"]
