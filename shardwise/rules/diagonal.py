"""diagonal, diagonal_scatter, diag_embed, diagonal_backward: the two diagonal dims whole, the rest sharded alike."""
from __future__ import annotations

ROWS = ()
