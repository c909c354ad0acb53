"""python -m shardwise.tools.calibrate [--nproc N] [--out profile.json] [--quick] (as shardwise calibrate)."""
import sys

from ...cli import main

sys.exit(main(["calibrate", *sys.argv[1:]]))
