"""The backends that run per-rank programs (threads, torch.distributed) and the local process launcher."""
from .collectives import Collectives, current, using
from .threads import run_threads

__all__ = ["Collectives", "current", "using", "run_threads"]

# torch.distributed backend and the local process launcher
from .distributed import TorchCollectives, activate  # noqa: E402
from .launch import spawn  # noqa: E402

__all__ += ["TorchCollectives", "activate", "spawn"]
