"""A ``shardwise run`` worker: the user's script run as ``__main__``, under torch's ``record``.

    python -m shardwise.run.script_entry SCRIPT [script arguments]   # torchrun -m starts it

``record`` (torch.distributed.elastic.multiprocessing.errors) writes an exception that ends the
script into the error file torchrun names for this worker ($TORCHELASTIC_ERROR_FILE), then
raises it as before (its traceback goes to the worker's stderr). ``shardwise run`` reads those
files to print the first failure in one line (run/script_logs.py). The script sees what
``python SCRIPT args`` shows it: ``sys.argv``, its folder first on ``sys.path``, ``__name__ ==
"__main__"``.
"""
from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m shardwise.run.script_entry SCRIPT [script arguments]")
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
