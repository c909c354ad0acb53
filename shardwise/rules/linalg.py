"""Linear algebra on the last two dims: the batch dims shard, the matrix dims stay whole."""
from __future__ import annotations

ROWS = ()
