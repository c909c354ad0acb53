"""Forward calls on Hugging Face models return the output less the KV cache (module/kv_cache.py):
``pm(input_ids=ids)`` in eval mode under no_grad on a LlamaForCausalLM whose config has
use_cache=True (the default) gives one device's logits, the cache field None, one warning.

    python -m pytest tests/module/test_kv_cache.py -q
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import shardwise as sw
from shardwise import Shard as S
from shardwise.module.kv_cache import KVCacheWarning
from tests.models import zoo
from tests.parallel.harness import assert_close

DP = sw.Mesh((2,), ("dp",))


def _default_llama():
    """A tiny LlamaForCausalLM with Hugging Face's default use_cache=True, and 3 rows (uneven on 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    assert cfg.use_cache
    return LlamaForCausalLM(cfg).eval(), torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))


def _cache_field(out):
    """The output's cache entry (transformers 5 names it ``cache``, earlier ones ``past_key_values``)."""
    return getattr(out, "cache", None) if hasattr(out, "cache") else out.past_key_values


def test_inference_call_returns_logits_without_the_cache():
    model, ids = _default_llama()
    with torch.no_grad():
        want = copy.deepcopy(model)(input_ids=ids)
    assert _cache_field(want) is not None  # one device returns a DynamicCache: what shardwise drops
    with pytest.warns(KVCacheWarning, match="use_cache=False") as caught:
        pm = sw.parallelize(model, DP, {"input_ids": ids}, input_placements={"input_ids": [S(0)]})
        pm.eval()
        with torch.no_grad():
            out = pm(input_ids=ids)
            again = pm(input_ids=ids, use_cache=True)
    assert sum(issubclass(w.category, KVCacheWarning) for w in caught) == 1  # said once
    assert type(out) is type(want) and _cache_field(out) is None
    assert_close(out.logits, want.logits, "logits")
    assert_close(again.logits, want.logits, "logits (use_cache=True given)")


def test_explicit_use_cache_true_is_dropped_and_false_is_quiet():
    """A config with use_cache=False: no warning unless use_cache=True is passed."""
    case = zoo.llama(batch=3)
    model, ids = case.model.eval(), case.example_inputs[0]
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, DP, {"input_ids": ids, "labels": ids.clone()},
                        input_placements={"input_ids": [S(0)], "labels": [S(0)]})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KVCacheWarning)
        quiet = pm(input_ids=ids, use_cache=False)
        with pytest.warns(KVCacheWarning, match="use_cache=True was given"):
            out = pm(input_ids=ids, use_cache=True)
        want = ref(input_ids=ids).logits
    assert _cache_field(out) is None
    assert_close(out.logits, want, "logits (use_cache=True given)")
    assert_close(quiet.logits, want, "logits (use_cache=False given)")
