"""Named model shapes for the cluster calculator, built from transformers' config classes with the
published dimensions, on the meta device (nothing downloaded, nothing allocated).

    cfg = config("llama3-8b")                       # a transformers PretrainedConfig
    cfg = config(path="config.json")                # any Hugging Face config file (its model_type)
    model, inputs = build(cfg, layers=3, batch=16, seq=8192, dtype=torch.bfloat16)

Sources: each model's config.json on the Hugging Face Hub (meta-llama/Llama-3.1-8B, -70B, -405B;
mistralai/Mixtral-8x7B-v0.1; Qwen/Qwen2.5-0.5B ... -72B; openai-community/gpt2, -medium,
-large, -xl), dimensions copied here.
"""
from __future__ import annotations

import inspect
import json
import os

import torch

from ...core.errors import CliError

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               max_position_embeddings=131072)
_QWEN = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)

# name -> (model_type, dimensions)
NAMED: dict[str, tuple[str, dict]] = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, **_LLAMA3)),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, **_LLAMA3)),
    "llama3-405b": ("llama", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                  num_attention_heads=128, num_key_value_heads=8, **_LLAMA3)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                     num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                                     max_position_embeddings=32768, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, **_QWEN)),
    "qwen2.5-14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                                  num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, **_QWEN)),
    "qwen2.5-32b": ("qwen2", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                                  num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, **_QWEN)),
    "qwen2.5-72b": ("qwen2", dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                                  num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, **_QWEN)),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)),
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)),
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
}
_ALIASES = {"llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.1-405b": "llama3-405b",
            "gpt2-small": "gpt2"}


def config(name: str | None = None, path: str | None = None):
    """The transformers config of a named shape (NAMED) or of a config.json file."""
    from transformers import CONFIG_MAPPING

    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CliError(f"cannot read --config {path}: {e}", fix="give a Hugging Face config.json") from e
        kind = data.get("model_type")
        if kind not in CONFIG_MAPPING:
            raise CliError(f"{path} has model_type {kind!r}, not one transformers knows",
                           fix="give a config.json with a model_type such as llama, qwen2, mixtral, gpt2")
        return CONFIG_MAPPING[kind](**{k: v for k, v in data.items() if k != "model_type"})
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in NAMED:
        raise CliError(f"unknown model {name!r}", fix=f"use one of {', '.join(NAMED)}, a --config config.json, or "
                                                      "a module:factory target")
    kind, dims = NAMED[key]
    return CONFIG_MAPPING[kind](**dims)


def layers_of(cfg) -> int:
    return int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))


def with_layers(cfg, layers: int):
    """A copy of ``cfg`` with ``layers`` blocks (every other dimension kept)."""
    data = cfg.to_dict()
    data["num_hidden_layers" if "num_hidden_layers" in data else "n_layer"] = layers
    for k in ("layer_types", "mlp_only_layers"):  # per-layer lists some configs carry
        if isinstance(data.get(k), list):
            data[k] = data[k][:layers]
    return type(cfg)(**{k: v for k, v in data.items() if k != "model_type"})


CAUSAL = "shardwise_causal"


def _register_causal() -> None:
    """Attention as a training job runs it: torch's SDPA with ``is_causal`` and no mask tensor.
    Traced with fake tensors, transformers' "sdpa" builds the [batch, 1, seq, seq] causal mask
    (it cannot tell tracing from an export that must keep it), a tensor no fused kernel reads."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    def causal(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register(CAUSAL, causal)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAUSAL, flash_attention_mask)


def build(cfg, layers: int, batch: int, seq: int, dtype=torch.float32) -> tuple:
    """(model with ``layers`` blocks on the meta device in ``dtype``, its positional example inputs:
    token ids [batch, seq] and the same ids as labels: the model's output is its loss). Attention
    is causal SDPA without a mask tensor (``_register_causal``), dropout off."""
    from transformers import AutoModelForCausalLM

    _register_causal()
    cfg = with_layers(cfg, layers)
    for k, v in dict(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attention_dropout=0.0).items():
        if hasattr(cfg, k) or k == "use_cache":
            setattr(cfg, k, v)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=CAUSAL)
    model = model.to(dtype).train()
    model.loss_type = "ForCausalLM"
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    kw = {"input_ids": ids, "labels": ids}
    params = list(inspect.signature(model.forward).parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in kw)
    return model, tuple(kw[p.name] if p.name in kw else p.default for p in params[: last + 1])


def describe(cfg) -> str:
    """One line: family, blocks, hidden size, heads."""
    h = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    experts = getattr(cfg, "num_local_experts", None)
    return (f"{cfg.model_type}: {layers_of(cfg)} blocks, hidden {h}, {heads} heads"
            + (f" ({kv} kv)" if kv and kv != heads else "") + (f", {experts} experts" if experts else "")
            + f", vocab {cfg.vocab_size}")


def is_named(target: str) -> bool:
    return _ALIASES.get(target.lower(), target.lower()) in NAMED or (os.path.basename(target) == "config.json")
