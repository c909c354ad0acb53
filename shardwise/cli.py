"""Command line: ``shardwise demo | plan | run | verify-rules | bench``.

    shardwise demo            # the main job (specified by a later issue)
    shardwise verify-rules    # check every registered rule numerically
"""
from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    print("shardwise demo: not there yet - the demo is specified by a later issue. "
          "Meanwhile `python -m pytest` shows what works.")
    return 0


def _verify_rules(args) -> int:
    """shardwise verify-rules [--op NAME] [--full] [--list-strategies]: the rule sweep."""
    from .verify_sweep import run_cli

    return run_cli(op=args.op, full=args.full, list_strategies=args.list_strategies)


def _bench(args) -> int:
    """shardwise bench [--nproc N] [--steps K]: time a training step against DTensor / DDP."""
    from .bench import main as bench_main

    return bench_main(nproc=args.nproc, steps=args.steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run the demo").set_defaults(fn=_demo)
    vr = sub.add_parser("verify-rules", help="check every registered rule numerically (coverage table)")
    vr.add_argument("--op", help="only ops whose name contains this (e.g. softmax, aten.mm.default)")
    vr.add_argument("--full", action="store_true", help="every sample (default: at most 2 per op)")
    vr.add_argument("--list-strategies", action="store_true", help="print every strategy tried, per mesh")
    vr.set_defaults(fn=_verify_rules)
    bn = sub.add_parser("bench", help="time a training step against torch's DTensor / DDP (gloo processes)")
    bn.add_argument("--nproc", type=int, default=2, help="gloo processes (ranks), default 2")
    bn.add_argument("--steps", type=int, default=10, help="timed steps (median), default 10")
    bn.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
