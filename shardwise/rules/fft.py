"""FFTs: shard the dims they do not transform."""
from __future__ import annotations

ROWS = ()
