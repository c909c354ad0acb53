"""Mixed precision as FSDP2's MixedPrecisionPolicy means it: fp32 masters, low-precision compute.

    mp = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = sw.parallelize(model, mesh, inputs, mixed_precision=mp)

- the parameters (and the optimizer state over them) stay in their own dtype: the masters, the
  local shards ``pm.parameters()`` holds and the optimizer updates;
- each rank's program starts by casting its local shard of every floating parameter to
  ``param_dtype`` (one cast per parameter, before any gather: FSDP's gathers send
  ``param_dtype``), and the step computes with those copies; floating inputs are cast too
  (FSDP2's ``cast_forward_inputs``);
- gradients are cast to ``reduce_dtype`` where they are made and reduced in it (never before:
  search/propagate.py and search/ilp.py forbid reducing into the cast), then land in ``.grad``
  in the master's dtype;
- ``output_dtype``: floating outputs of the model are cast to it (before ``loss_fn``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError, ConfigTypeError


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype compute reads parameters in (None: their own); ``reduce_dtype``:
    the dtype gradients are reduced in (None: ``param_dtype``'s, as FSDP2); ``output_dtype``: the
    dtype of the model's floating outputs (None: as computed)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = getattr(self, field)
            if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
                raise ConfigTypeError(f"MixedPrecision.{field} must be a floating torch.dtype or None, got {dt!r}",
                                      fix=f"e.g. MixedPrecision({field}=torch.bfloat16)")

    @property
    def reduce(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce_dtype or self.param_dtype

    def describe(self) -> str:
        def name(dt):
            return "as is" if dt is None else str(dt).replace("torch.", "")

        return (f"parameters computed in {name(self.param_dtype)}, gradients reduced in {name(self.reduce)}, "
                f"outputs {name(self.output_dtype)}")


def check_precision(mixed_precision) -> MixedPrecision | None:
    """``parallelize(mixed_precision=...)``: None or a MixedPrecision (one that changes nothing is None)."""
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, MixedPrecision):
        raise ConfigError(f"mixed_precision must be a shardwise.MixedPrecision or None, got "
                          f"{type(mixed_precision).__name__}",
                          fix="e.g. mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16, "
                              "reduce_dtype=torch.float32)")
    if mixed_precision == MixedPrecision():
        return None
    return mixed_precision
