"""shardwise: run a single-device PyTorch model sharded across a mesh of devices.

    shardwise demo                                   # a small GPT trained sharded, checked against one device
    shardwise plan mymodel.py:build --mesh 2x2 --names dp,tp --html plan.html   # build() -> model, inputs
    shardwise run train.py --nproc 4 -- --lr 1e-3    # torch.distributed.run on this machine (--max-restarts K)
    shardwise verify-rules                           # check every registered rule numerically
    shardwise verify-rules --opinfo --samples 1      # PyTorch's OpInfo ops through parallelize vs one device
    shardwise bench                                  # a training step against DTensor / DDP
    shardwise calibrate --nproc 2 --out profile.json # measure this machine: plan --profile profile.json

Errors print one line with the fix (exit 1); --debug shows the traceback.
"""
from __future__ import annotations

import argparse
import sys

from ..core.errors import CliError, ShardingError
from ..lower.allocator import ALLOCATORS


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape; write it as 2x2 (or 4, or 2x2x2)")
    return shape


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give mesh dim names separated by commas, e.g. dp,tp")
    return names


def default_names(mesh: tuple) -> tuple[str, ...]:
    """("dp",) or ("dp", "tp") for 1-d / 2-d meshes; d0, d1, ... beyond."""
    return ("dp", "tp")[: len(mesh)] if len(mesh) <= 2 else tuple(f"d{i}" for i in range(len(mesh)))


def _demo(args) -> int:
    from ..tools.demo import DemoOptions, run

    opts = DemoOptions(mesh=args.mesh, names=args.names, steps=args.steps, parallel=args.parallel,
                       backend=args.backend, nproc=args.nproc, batch=args.batch, full_plan=args.full_plan)
    return run(opts)


def _plan(args) -> int:
    from ..tools.cluster.models import is_named

    args.mesh_given, args.names_given = args.mesh is not None, args.names is not None
    calculator = bool(args.config or (args.target and is_named(args.target)))
    _refuse_the_other_modes_options(args, calculator)
    if calculator:
        from .cluster import cluster_command

        if args.mesh_given:
            args.names = args.names or _calculator_names(args.mesh)
        return cluster_command(args)
    if args.target is None:
        raise CliError("shardwise plan needs a TARGET (module:factory) or a named model / --config",
                       fix="e.g. shardwise plan mymodel.py:build --mesh 2 (see shardwise plan --help), or shardwise plan "
                           "llama3-8b --gpus 8")
    from .plan import plan_command

    args.mesh = args.mesh or (2,)
    args.names = args.names or default_names(args.mesh)
    return plan_command(args)


def _refuse_the_other_modes_options(args, calculator: bool) -> None:
    """``shardwise plan`` plans a model file or runs the cluster calculator; an option only the other
    one reads raises instead of being dropped."""
    other = args.only["model" if calculator else "calculator"]
    given = [dest for dest, default in other.items() if getattr(args, dest, default) != default]
    if not given:
        return
    names = ", ".join("--" + dest.replace("_", "-") for dest in given)
    if calculator:
        raise CliError(f"{names}: for planning a model file (module:factory), not for the cluster calculator that "
                       f"{args.target or '--config'} starts", fix="drop them: the calculator plans its own layouts "
                                                                   "(planner, fsdp, fsdp+tp; --compare for meshes)")
    raise CliError(f"{names}: for the cluster calculator (a named model or --config), not for planning {args.target}",
                   fix="drop them, or name a model: shardwise plan llama3-8b --gpu h100 --gpus 8")


def _calculator_names(mesh: tuple) -> tuple:
    from ..tools.cluster.calc import default_names as calc_names

    return calc_names(mesh)


def _run(args) -> int:
    """shardwise run SCRIPT --nproc N [--max-restarts K] [-- script args]: the script on N local processes."""
    import os

    from ..run.launch import run_script

    if not os.path.isfile(args.script):
        raise CliError(f"no script {args.script!r}", fix="give the path to a Python file, e.g. shardwise run train.py --nproc 2")
    if args.nproc < 1:
        raise CliError(f"--nproc must be at least 1, got {args.nproc}", fix="e.g. --nproc 2")
    if args.max_restarts < 0:
        raise CliError(f"--max-restarts must be at least 0, got {args.max_restarts}", fix="e.g. --max-restarts 3")
    script_args = list(args.script_args)
    if args.all_output:
        return int(run_script(args.script, args.nproc, script_args, max_restarts=args.max_restarts) or 0)
    return _run_logged(args, script_args, run_script)


def _run_logged(args, script_args, run_script) -> int:
    """The ranks' stdout as it comes; their stderr and the launcher's into files: a failure is one
    line (the first failing rank's error and fix) and the name of the file with everything."""
    import tempfile

    from ..run.script_logs import exit_line, gather, stderr_lines

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="shardwise-run-")
    code = int(run_script(args.script, args.nproc, script_args, max_restarts=args.max_restarts, log_dir=log_dir) or 0)
    if code:
        print(f"shardwise run: error: {exit_line(log_dir, code)}", file=sys.stderr, flush=True)
    elif stderr_lines(log_dir):
        print(f"shardwise run: the ranks wrote {stderr_lines(log_dir)} lines to stderr: {gather(log_dir)}",
              file=sys.stderr, flush=True)
    return code


def _verify_rules(args) -> int:
    """shardwise verify-rules [--op NAME] [--full] [--list-strategies] | --coverage | --opinfo [--samples N]."""
    if args.opinfo:
        if args.samples < 1:
            raise CliError(f"--samples must be at least 1, got {args.samples}", fix="e.g. --samples 2")
        from ..tools.verify.opinfo_report import run_cli as opinfo_cli

        return opinfo_cli(op=args.op, samples=args.samples, json_path=args.json, dtensor=not args.no_dtensor)
    if args.samples != 2 or args.json or args.no_dtensor:
        raise CliError("--samples, --json and --no-dtensor are options of --opinfo",
                       fix="add --opinfo (PyTorch's OpInfo database through shardwise), or drop them")
    if args.coverage:
        from ..tools.verify.coverage import run_cli as coverage_cli

        return coverage_cli(op=args.op, full=args.full)
    from ..tools.verify.sweep import run_cli

    return run_cli(op=args.op, full=args.full, list_strategies=args.list_strategies)


def _bench(args) -> int:
    """shardwise bench [--nproc N] [--steps K]: time a training step against DTensor / DDP."""
    from ..tools.bench import main as bench_main

    return bench_main(nproc=args.nproc, steps=args.steps)


def _calibrate(args) -> int:
    """shardwise calibrate [--nproc N] [--out profile.json] [--quick] [--mesh 2x2 --names dp,tp]."""
    from ..tools.calibrate import run_cli

    if args.names and not args.mesh:
        raise CliError("--names names the dims of --mesh", fix="add --mesh, e.g. --mesh 2x2 --names dp,tp")
    names = args.names or (default_names(args.mesh) if args.mesh else None)
    return run_cli(nproc=args.nproc, out=args.out, quick=args.quick, mesh_shape=args.mesh, names=names)


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", parents=[_common()], help="measure this machine into a cost profile (JSON)",
                       description="Measure matmuls by size and dtype, fused attention, memory-bound kernels, a "
                                   "kernel call's fixed cost and each collective's latency and bandwidth on N local "
                                   "gloo processes (or the ranks torchrun started), and write a cost profile: "
                                   "sw.CostModel.from_profile(path), shardwise plan ... --profile path.")
    c.add_argument("--nproc", type=int, default=None,
                   help="local processes (ranks), default 2; under torchrun, the ranks it started")
    c.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    c.add_argument("--quick", action="store_true", help="fewer sizes (about half the time)")
    c.add_argument("--mesh", type=_mesh, default=None, help="measure links per mesh dim, e.g. 2x2 (= --nproc)")
    c.add_argument("--names", type=_names, default=None, help="mesh dim names with --mesh (default dp,tp)")
    c.set_defaults(fn=_calibrate)


def _common() -> argparse.ArgumentParser:
    """--debug accepted after the command too (shardwise plan X --debug)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an error")
    return c


def _add_demo(sub) -> None:
    from ..tools.demo.runner import PARALLEL

    d = sub.add_parser("demo", parents=[_common()], help="train a small GPT sharded on a simulated mesh and check it against one device",
                       description="Train a small GPT (shipped in the package) to sort digits on a simulated mesh, "
                                   "then the same steps on one device, and say whether they match.")
    d.add_argument("--mesh", type=_mesh, default=(2, 2), help="mesh shape, e.g. 2x2 (default) or 4")
    d.add_argument("--names", type=_names, default=None, help="mesh dim names, e.g. dp,tp (default)")
    d.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    d.add_argument("--parallel", choices=PARALLEL, default="auto",
                   help="auto: the ILP planner chooses; dp: batch on every mesh dim; tp: Megatron on the last dim; "
                        "sp: sequence on the last dim; fsdp: parameters sharded on every dim")
    d.add_argument("--backend", choices=("threads", "torch"), default="threads",
                   help="threads: every rank in this process (default); torch: one gloo process per rank")
    d.add_argument("--nproc", type=int, default=None, help="with --backend torch: processes (= mesh size)")
    d.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    d.add_argument("--full-plan", action="store_true", help="also print the full per-node plan")
    d.set_defaults(fn=_demo)


def _add_plan(sub) -> None:
    from .plan import HELP_EPILOG

    p = sub.add_parser("plan", parents=[_common()], help="plan a model without running it (fake tensors): text, --json, --html",
                       description="Plan TARGET's training step on a mesh without running it (fake tensors, meta "
                                   "weights). TARGET is module:factory or path.py:factory; the factory returns the "
                                   "model and example inputs, and optionally targets, a loss function and placements "
                                   "(a tuple (model, inputs, targets, loss_fn) or a dict with those keys and "
                                   "input_placements / param_placements).",
                       epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default=None,
                   help="module:factory, path/to/file.py:factory, or a named model for the cluster calculator "
                        "(llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, qwen2.5-7b, gpt2, ...)")
    p.add_argument("--mesh", type=_mesh, default=None, help="mesh shape, e.g. 2x2 (default 2; calculator: --gpus)")
    p.add_argument("--names", type=_names, default=None, help="mesh dim names (default dp or dp,tp)")
    p.add_argument("--placements", default=None,
                   help="a JSON/YAML file {inputs: {arg: {dim: 'S(0)'}}, params: {name: {dim: 'S(1)'}}} or a recipe: "
                        "megatron, fsdp, sequence, megatron+fsdp")
    p.add_argument("--inputs", default=None,
                   help="input placements as JSON, e.g. '{\"0\": {\"dp\": \"S(0)\"}}' (default: batch of input 0 "
                        "on the first mesh dim)")
    p.add_argument("--planner", choices=("auto", "propagate", "ilp"), default=None,
                   help="default: auto (propagate from the placements this command gives)")
    p.add_argument("--bandwidth", type=float, default=None, help="cost model: bytes/s per link")
    p.add_argument("--latency", type=float, default=None, help="cost model: seconds per collective step")
    p.add_argument("--flops", type=float, default=None, help="cost model: flop/s per rank")
    p.add_argument("--cost-preset", default=None, choices=("cpu", "a100", "h100"),
                   help="cost model figures of a device (shardwise/core/cost.py); --bandwidth/--latency/--flops override them")
    p.add_argument("--profile", default=None, metavar="PROFILE.json",
                   help="cost model measured by shardwise calibrate (sw.CostModel.from_profile); "
                        "--bandwidth/--latency/--flops override it")
    p.add_argument("--real", action="store_true", help="build the model for real instead of on the meta device")
    p.add_argument("--nodes", action="store_true", help="print the full per-node table (Plan.summary())")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (for tools) instead of text")
    p.add_argument("--html", metavar="FILE", default=None, help="write a self-contained HTML report with charts")
    p.add_argument("--title", default=None, help="title of the report (default: TARGET)")
    c = p.add_argument_group("cluster calculator (a named model or --config): layout, memory per GPU, step time, "
                             "tokens/s before the job starts")
    c.add_argument("--config", default=None, help="a Hugging Face config.json instead of a named model")
    c.add_argument("--gpu", default="h100", help="GPU kind: h100 (SXM5 80GB), h100-hbm2e, h200, a100 (default h100)")
    c.add_argument("--gpus", type=int, default=None, help="GPUs in the job")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    c.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    c.add_argument("--local-batch", type=int, default=1, help="sequences per data-parallel rank per step (default 1)")
    c.add_argument("--mixed-precision", choices=("bf16", "fp32"), default=None,
                   help="bf16: bf16 compute, float32 masters, gradients reduced in float32 (default fp32)")
    c.add_argument("--activation-checkpointing", choices=("none", "selective", "full"), default=None,
                   help="recompute activations in backward: selective (torchtitan's per-op policy) or full blocks")
    c.add_argument("--allocator", default=ALLOCATORS[0], choices=ALLOCATORS,
                   help="PyTorch's CUDA caching allocator for the reserved memory: expandable segments "
                        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, torchtitan's setting) or torch's default")
    c.add_argument("--memory-budget", default=None, help="bytes per GPU, e.g. 80GiB (default: the GPU's memory)")
    c.add_argument("--layout", default=None, choices=("planner", "fsdp", "fsdp+tp", "dp+tp"),
                   help="evaluate one layout (dp+tp: Megatron on tp, parameters whole on the data dims); "
                        "default: every candidate ranked")
    c.add_argument("--compare", action="store_true", help="plan several factorisations of the GPUs, ranked")
    c.add_argument("--search-mesh", action="store_true", help="pick the factorisation (inner dims inside a node)")
    c.add_argument("--pp", type=int, default=1,
                   help="pipeline ranks, the outermost mesh dim across nodes (--mesh is then one stage's; default 1; "
                        "--compare / --search-mesh try every size whose stages fill whole nodes unless given)")
    c.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step with --pp (default: the local batch, one sequence each)")
    c.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved", "zero-bubble"),
                   help="pipeline schedule with --pp (default 1f1b)")
    c.add_argument("--stages-per-rank", type=int, default=None,
                   help="stages per pipeline rank (interleaved; default 2 there, else 1)")
    shared = {"target", "mesh", "names", "json", "html", "help", "debug"}
    calculator = {a.dest: a.default for a in c._group_actions if a.dest not in shared}
    model = {a.dest: a.default for a in p._actions if a.dest not in shared and a.dest not in calculator}
    p.set_defaults(fn=_plan, only={"calculator": calculator, "model": model})


def _add_others(sub) -> None:
    r = sub.add_parser("run", parents=[_common()], help="start a script on N local processes (torch.distributed.run)",
                       description="Start SCRIPT on N local processes through torch.distributed.run (gloo on CPU, "
                                   "NCCL with CUDA); the script's own arguments follow -- "
                                   "(shardwise run train.py --nproc 2 -- --lr 1e-3). For several nodes use torchrun "
                                   "directly (see docs/guide.md).")
    r.add_argument("script", help="the Python script to run")
    r.add_argument("--nproc", type=int, required=True, help="processes (ranks) on this machine")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank fails, stop the others and restart them all, up to this many times (the "
                        "script resumes from its checkpoint: shardwise.Checkpointer); default 0")
    r.add_argument("--log-dir", default=None,
                   help="where every rank's stdout and stderr and the launcher's output are written (default: a new "
                        "temporary directory); a failure prints one line naming the file with all of it")
    r.add_argument("--all-output", action="store_true",
                   help="show every rank's stdout and stderr and the launcher's messages as they come (no log files)")
    r.set_defaults(fn=_run)
    vr = sub.add_parser("verify-rules", parents=[_common()], help="check every registered rule numerically (coverage table)")
    vr.add_argument("--op", help="only ops whose name contains this (e.g. softmax, aten.mm.default)")
    vr.add_argument("--full", action="store_true", help="every sample (default: at most 2 per op)")
    vr.add_argument("--list-strategies", action="store_true", help="print every strategy tried, per mesh")
    vr.add_argument("--coverage", action="store_true",
                    help="torch's core ATen ops: each has a verified rule or a documented refusal")
    vr.add_argument("--opinfo", action="store_true",
                    help="PyTorch's OpInfo database through parallelize on 2 ranks (primary input sharded on dim 0, the "
                         "last dim, an uneven dim), loss and gradients against one device, DTensor's count beside it")
    vr.add_argument("--samples", type=int, default=2, help="with --opinfo: samples per OpInfo (default 2)")
    vr.add_argument("--json", metavar="FILE", default=None, help="with --opinfo: write every case as a row")
    vr.add_argument("--no-dtensor", action="store_true", help="with --opinfo: skip DTensor's side-by-side count")
    vr.set_defaults(fn=_verify_rules)
    bn = sub.add_parser("bench", parents=[_common()], help="time a training step against torch's DTensor / DDP (gloo processes)")
    bn.add_argument("--nproc", type=int, default=2, help="gloo processes (ranks), default 2")
    bn.add_argument("--steps", type=int, default=10, help="timed steps (median), default 10")
    bn.set_defaults(fn=_bench)


def parser() -> argparse.ArgumentParser:
    head, examples = __doc__.split("\n\n")[:2]
    p = argparse.ArgumentParser(prog="shardwise", description=head, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n" + examples + "\n\nErrors print one line with the fix (exit 1); "
                                       "--debug shows the traceback. Docs: README.md and docs/.")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,plan,run,verify-rules,bench,calibrate}")
    _add_demo(sub)
    _add_plan(sub)
    _add_others(sub)
    _add_calibrate(sub)
    return p


def one_line(e: BaseException) -> str:
    """An error as one line: the message's lines joined, then the fix."""
    msg = e.message if isinstance(e, ShardingError) else str(e)
    msg = "; ".join(line.strip() for line in msg.splitlines() if line.strip()) or type(e).__name__
    fix = getattr(e, "fix", None)
    return f"{msg} (fix: {fix})" if fix else msg


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = []
    if "--" in argv:  # everything after -- belongs to the script of ``shardwise run``
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    p = parser()
    args = p.parse_args(argv)
    if rest and args.cmd != "run":
        p.error(f"arguments after -- are only for shardwise run, got {' '.join(rest)}")
    args.script_args = rest
    if args.cmd == "demo":  # the mesh dims' default names (plan names its own: _plan)
        args.names = args.names or default_names(args.mesh)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for people, the traceback with --debug
        if args.debug:
            raise
        kind = "" if isinstance(e, ShardingError) else f"{type(e).__name__}: "
        print(f"shardwise {args.cmd}: error: {kind}{one_line(e)}", file=sys.stderr)
        if not isinstance(e, ShardingError):
            print("  (an unexpected error: rerun with --debug for the traceback, and report it)", file=sys.stderr)
        return 1
