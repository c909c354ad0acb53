"""Attention as one custom op (``torch.ops.shardwise.attention``) and its sharded local compute.

op.py       the custom op, its settings dataclass, autograd, fake impl, ``attention(...)``
mods.py     score modifications as data: soft-cap, bias, ALiBi, windows, document ids
kernels.py  forward / backward / online-softmax merge on local tensors (math path + dispatch)
fused.py    the same through torch's fused SDPA kernels (no L x S scores), where they apply
benchmark.py  forward+backward time and peak memory against aten's SDPA (bench/bench_attention.py)
ring.py     per-rank ring attention and gathered-KV attention (sequence parallelism)
"""
from .mods import Mods
from .op import AttentionSettings, attention, attention_with_lse

__all__ = ["AttentionSettings", "Mods", "attention", "attention_with_lse"]
