"""roll and other ops that move elements along a dim."""
from __future__ import annotations

ROWS = ()
