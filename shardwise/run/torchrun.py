"""torch's elastic launcher (torch.distributed.run) with the script's arguments kept whole.

    python -m shardwise.run.torchrun [torchrun options] -- SCRIPT [script arguments]

``shardwise run`` starts this. torchrun parses the script's arguments with its own parser, so
one that is a prefix of a torchrun option (``--log`` of ``--log-dir``) is taken as that option or
rejected as ambiguous; here torchrun parses only its options and the script path, and
everything after the ``--`` goes to the script untouched.
"""
from __future__ import annotations

import sys


def split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun options, script, script arguments) of ``[options...] -- SCRIPT [args...]``."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("usage: python -m shardwise.run.torchrun [torchrun options] -- SCRIPT [script arguments]")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1], argv[cut + 2:]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    options, script, script_args = split(sys.argv[1:] if argv is None else list(argv))
    args = parse_args([*options, script])
    args.training_script_args = script_args
    record(run)(args)  # a failed worker raises ChildFailedError: exit 1 with torchrun's summary


if __name__ == "__main__":
    main()
