"""Complex numbers: polar, view_as_complex, view_as_real, _conj, complex arithmetic."""
from __future__ import annotations

ROWS = ()
