"""Hugging Face's ``attn_implementation="flex_attention"`` traced as ``shardwise.attention``.

torch 2.13 cannot trace HF's flex path with make_fx: HF calls a ``torch.compile``d
``flex_attention`` (and builds its ``BlockMask`` through a compiled ``create_block_mask``),
and FX refuses to trace a dynamo-optimised function; on CPU FlexAttention has no backward
either. What HF's flex path computes is data, though: its ``score_mod`` soft-caps
(``softcap``), adds a float score mask and T5's ``position_bias``; its block mask is the
model's mask function (causal, sliding window, padding, packed sequences). So while tracing on
this thread (``flex_as_op``):

- HF's mask interface for "flex_attention" builds the same mask function as a boolean
  ``[batch, 1, L, S]`` tensor (its sdpa mask, never skipped);
- HF's attention interface for "flex_attention" returns ``flex_attention_as_op``: one
  ``shardwise.attention`` call with that mask, the scale, ``softcap`` and the bias.

Attention sinks (``s_aux``), dropout and a ``BlockMask`` that did not come from HF's mask
interface raise an ``AttentionError`` naming what to use instead; nothing is approximated.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..core.errors import AttentionError
from .patching import TracingPatch

_PATCH = TracingPatch()  # flex_as_op: HF's interfaces wrapped while any thread traces
FLEX = "flex_attention"


def flex_attention_as_op(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                         position_bias=None, **kwargs):
    """HF's ``flex_attention_forward`` (integrations/flex_attention.py) as ``shardwise.attention``:
    the same score_mod (soft-cap, float score mask of head 0, position bias) and mask."""
    from ..ops.attention import attention

    fix = "use attn_implementation='eager' or 'sdpa' for this model (shardwise maps both)"
    if kwargs.get("dropout", 0.0) > 0:
        raise AttentionError("flex_attention with dropout is not supported (Hugging Face refuses it too)",
                             fix="turn the attention dropout off in the config, or " + fix)
    if s_aux is not None:
        raise AttentionError("flex_attention with attention sinks (s_aux) is not supported by shardwise.attention",
                             fix=fix)
    mask, bias = None, position_bias
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:  # HF's score_mask: added to every head as head 0's row
            score = attention_mask[:, :1, :, : key.shape[-2]]
            bias = score if bias is None else bias + score
    elif attention_mask is not None:
        raise AttentionError(f"flex_attention with a {type(attention_mask).__name__} mask that shardwise did not "
                             "build: its mask_mod is code that cannot be read as data",
                             fix="let the model build its own mask (pass a 2-d attention_mask or none), or " + fix)
    out = attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                    softcap=softcap, bias=bias)
    return out.transpose(1, 2).contiguous(), None


def _routed_mask(original):
    def mask(*args, **kwargs):
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return original(*args, **kwargs)

    return mask


@contextlib.contextmanager
def flex_as_op():
    """While tracing on this thread, HF's "flex_attention" attention and mask interfaces give
    ``flex_attention_as_op`` and a boolean mask (module docstring). The interfaces are wrapped
    while any thread has this context open (a count under a lock); the wrappers substitute on
    threads that have it open only."""
    utils, masking = sys.modules.get("transformers.modeling_utils"), sys.modules.get("transformers.masking_utils")
    attn_cls = getattr(utils, "AttentionInterface", None)
    mask_cls = getattr(masking, "AttentionMaskInterface", None)
    if attn_cls is None or mask_cls is None:
        yield
        return

    def install():
        get_interface, getitem = attn_cls.get_interface, mask_cls.__getitem__

        def routed_interface(self, attn_implementation, default):
            if _PATCH.active and attn_implementation == FLEX:
                return flex_attention_as_op
            return get_interface(self, attn_implementation, default)

        def routed_mask(self, key):
            if _PATCH.active and key == FLEX:
                return _routed_mask(getitem(self, "sdpa"))
            return getitem(self, key)

        attn_cls.get_interface, mask_cls.__getitem__ = routed_interface, routed_mask

        def undo():
            attn_cls.get_interface, mask_cls.__getitem__ = get_interface, getitem
        return undo

    with _PATCH.opened(install):
        yield
