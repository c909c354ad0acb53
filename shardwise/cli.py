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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run the demo").set_defaults(fn=_demo)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
