"""The precision policy as a parameter of the estimate (until parallelize's mixed_precision= lands).

    p = Precision.of("bf16")      # or "fp32"
    p.compute_dtype               # the dtype the step is traced (and its activations held) in
    p.memory(params, grads)       # {"parameters", "gradients", "optimizer_state"} per rank, from the traced bytes
    p.grad_scale                  # gradients are reduced in reduce_dtype: bytes x this over the traced ones

"bf16" is FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) as torchtitan runs it:
the step computes in bf16 (parameters gathered in bf16, bf16 activations, with the float32
upcasts the model's own code makes: norms, the loss), each rank keeps its parameter shard as
float32 (the master), its gradient shard in float32 (reduced in float32), and AdamW's two float32
moments. "fp32": everything float32. The plan is traced in ``compute_dtype``, so its parameters and
gradients are counted in that dtype; ``memory`` rescales them to what the policy stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.errors import CliError

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_bytes_per_param: int = 8  # AdamW: two float32 moments

    @classmethod
    def of(cls, name: str | None) -> "Precision":
        key = (name or "fp32").lower()
        if key in ("bf16", "bfloat16"):
            return cls("bf16", torch.bfloat16, torch.float32, torch.float32)
        if key in ("fp32", "float32", "none"):
            return cls("fp32", torch.float32, torch.float32, torch.float32)
        raise CliError(f"unknown --mixed-precision {name!r}", fix="use bf16 or fp32")

    @property
    def traced_bytes(self) -> int:
        return _BYTES[self.compute_dtype]

    @property
    def grad_scale(self) -> float:
        """Bytes of a gradient reduction over the traced (compute dtype) bytes."""
        return _BYTES[self.reduce_dtype] / self.traced_bytes

    def memory(self, params: float, grads: float) -> dict:
        """Per rank, from the traced parameter and gradient bytes (compute dtype): the float32
        masters, the gradients in reduce dtype, the optimizer's moments."""
        per = params / self.traced_bytes  # parameters (elements) this rank holds
        return {"parameters": per * _BYTES[self.master_dtype],
                "gradients": grads / self.traced_bytes * _BYTES[self.reduce_dtype],
                "optimizer_state": per * self.optimizer_bytes_per_param}
