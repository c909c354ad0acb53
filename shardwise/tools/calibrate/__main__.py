"""python -m shardwise.tools.calibrate [--nproc N] [--out profile.json] [--quick] [--mesh 2x2 --names dp,tp]:
``shardwise calibrate`` where the ``shardwise`` command is not installed, and under torchrun (every rank runs it)."""
import argparse
import sys

from . import run_cli

ap = argparse.ArgumentParser(prog="python -m shardwise.tools.calibrate", description=__doc__)
ap.add_argument("--nproc", type=int, default=None, help="default 2; under torchrun, the ranks it started")
ap.add_argument("--out", default="profile.json")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--mesh", default=None, help="e.g. 2x2")
ap.add_argument("--names", default=None, help="e.g. dp,tp")
args = ap.parse_args()
mesh = tuple(int(s) for s in args.mesh.lower().split("x")) if args.mesh else None
names = tuple(args.names.split(",")) if args.names else (("dp", "tp")[: len(mesh)] if mesh else None)
sys.exit(run_cli(args.nproc, args.out, args.quick, mesh, names))
