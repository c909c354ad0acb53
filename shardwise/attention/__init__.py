"""Attention as one custom op (``torch.ops.shardwise.attention``) and its sharded local compute.

op.py       the custom op, its settings dataclass, autograd, fake impl, ``attention(...)``
kernels.py  forward / backward / online-softmax merge on local tensors
ring.py     per-rank ring attention and gathered-KV attention (sequence parallelism)
"""
from .op import AttentionSettings, attention, attention_with_lse

__all__ = ["AttentionSettings", "attention", "attention_with_lse"]
