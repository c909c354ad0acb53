"""Runtime: the collectives interface and the backends that implement it."""
from .collectives import Collectives, current, using
from .threads import run_threads

__all__ = ["Collectives", "current", "using", "run_threads"]
