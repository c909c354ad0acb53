"""as_strided and as_strided_scatter in the forms models produce."""
from __future__ import annotations

ROWS = ()
