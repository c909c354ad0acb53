"""Small deterministic test models: each builder returns a ``Case`` that unpacks as
``model, example_inputs, example_targets, loss_fn``.

    python -m tests.models.zoo          # prints each model's joint-graph size and trace time

- ``mlp``: Linear-GELU-Linear, MSE (or cross-entropy) loss.
- ``transformer``: embedding + causal pre-LN blocks (F.scaled_dot_product_attention, GELU MLP,
  residuals) + LM head, cross-entropy.
- ``gpt2`` / ``llama`` and the other Hugging Face families (``FAMILIES``, see there): tiny configs,
  random weights, no downloads; ``labels`` is passed (positionally) so the model returns its own
  loss (a ModelOutput with ``.loss``): ``loss_fn`` is None.

Every builder takes ``dtype`` (float32 or bfloat16; ``model.to(dtype)``) and ``seed``; the
global RNG is left untouched. ``cached(name, dtype)`` shares one built case per process.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)


class Case(NamedTuple):
    model: nn.Module
    example_inputs: tuple
    example_targets: tuple
    loss_fn: Callable | None


def _seeded(build):
    @functools.wraps(build)
    def wrapper(*args, seed: int = 0, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build(*args, **kwargs)
    return wrapper


# -- MLP --------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(h)


def mse_loss(out, y):
    return F.mse_loss(out, y)


def ce_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


@_seeded
def mlp(dtype=torch.float32, loss: str = "mse", batch: int = 6) -> Case:
    model = MLP().to(dtype)
    x = torch.randn(batch, 16, dtype=dtype)
    if loss == "mse":
        return Case(model, (x,), (torch.randn(batch, 8, dtype=dtype),), mse_loss)
    return Case(model, (x,), (torch.randint(0, 8, (batch,)),), ce_loss)


# -- transformer block with SDPA ---------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN causal self-attention + GELU MLP, residuals around both."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@_seeded
def transformer(dtype=torch.float32, batch: int = 2, seq: int = 8) -> Case:
    model = TinyLM().to(dtype)
    idx = torch.randint(0, 64, (batch, seq))
    return Case(model, (idx,), (torch.randint(0, 64, (batch, seq)),), ce_loss)


# -- Hugging Face -------------------------------------------------------------------------------
def positional(fn, **given) -> tuple:
    """``given`` keyword args as a positional tuple for ``fn`` (defaults fill the gaps)."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    last = max(i for i, p in enumerate(params) if p.name in given)
    missing = set(given) - {p.name for p in params}
    if missing:
        raise TypeError(f"{sorted(missing)} are not positional parameters of {fn}")
    return tuple(given[p.name] if p.name in given else p.default for p in params[:last + 1])


def _hf_case(model: nn.Module, dtype, batch: int, seq: int, vocab: int, loss_type: str | None = "ForCausalLM",
             low: int = 0) -> Case:
    model = model.to(dtype).train()
    if loss_type is not None:  # e.g. GPT2LMHeadModel's class name does not tell HF; silence its warning
        model.loss_type = loss_type
    ids = torch.randint(low, vocab, (batch, seq))
    return Case(model, positional(model.forward, input_ids=ids, labels=ids.clone()), (), None)


@_seeded
def gpt2(dtype=torch.float32, dropout: bool = False, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    p = 0.1 if dropout else 0.0
    cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=max(32, seq), resid_pdrop=p,
                     embd_pdrop=p, attn_pdrop=p, use_cache=False, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")
    return _hf_case(GPT2LMHeadModel(cfg), dtype, batch, seq, 64)


@_seeded
def llama(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=32, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return _hf_case(LlamaForCausalLM(cfg), dtype, batch, seq, 64)


@_seeded
def bert(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=64, max_position_embeddings=max(32, seq), hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation="sdpa")
    return _hf_case(BertForMaskedLM(cfg), dtype, batch, seq, 64, "ForMaskedLM")


@_seeded
def roberta(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import RobertaConfig, RobertaForMaskedLM

    # ids from 2: no padding token (1), so RoBERTa's position ids are 2, 3, ... on every row
    cfg = RobertaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                        vocab_size=64, max_position_embeddings=max(32, seq + 2), hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=1, attn_implementation="sdpa")
    return _hf_case(RobertaForMaskedLM(cfg), dtype, batch, seq, 64, "ForMaskedLM", low=2)


@_seeded
def t5(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                   use_cache=False, attn_implementation="sdpa")
    return _hf_case(T5ForConditionalGeneration(cfg), dtype, batch, seq, 64, None, low=2)


@_seeded
def gemma2(dtype=torch.float32, batch: int = 2, seq: int = 8, softcap: float = 0.5, window: int = 3,
           layers: int = 2) -> Case:
    """Even layers sliding-window (``window`` keys), odd ones full; soft-capping small enough to bend the
    scores of these weights (initializer_range 0.2)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=64, max_position_embeddings=max(32, seq),
                       sliding_window=window, query_pre_attn_scalar=8, attn_logit_softcapping=softcap,
                       final_logit_softcapping=30.0, initializer_range=0.2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                       attn_implementation="eager")
    return _hf_case(Gemma2ForCausalLM(cfg), dtype, batch, seq, 64)


@_seeded
def falcon(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=64, alibi=True,
                       multi_query=True, max_position_embeddings=max(32, seq), hidden_dropout=0.0,
                       attention_dropout=0.0, initializer_range=0.2, use_cache=False, bos_token_id=0, eos_token_id=0,
                       attn_implementation="eager")
    return _hf_case(FalconForCausalLM(cfg), dtype, batch, seq, 64)


@_seeded
def bloom(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(n_layer=layers, hidden_size=32, n_head=4, vocab_size=64, hidden_dropout=0.0,
                      attention_dropout=0.0, initializer_range=0.2, use_cache=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    return _hf_case(BloomForCausalLM(cfg), dtype, batch, seq, 64)


_DECODER = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "vocab_size": 64, "max_position_embeddings": 32, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0,
            "pad_token_id": 0}


def _decoder(config: str, model: str, **kw) -> Callable[..., Case]:
    """A builder of the Hugging Face causal LM ``model`` from ``config`` with the shared small sizes
    (``_DECODER``, overridden by ``kw``; ``layers`` layers, no dropout), sdpa attention."""
    @_seeded
    def build(dtype=torch.float32, batch: int = 2, seq: int = 8, layers: int = 2) -> Case:
        import transformers

        cfg = getattr(transformers, config)(**{**_DECODER, **kw, "num_hidden_layers": layers})
        cfg._attn_implementation = "sdpa"
        return _hf_case(getattr(transformers, model)(cfg), dtype, batch, seq, 64)
    build.__name__ = build.__qualname__ = model
    return build


# More decoder families, with their own layers (grouped-query attention with 2 key/value heads where the
# family has it): q/k norms (Qwen3, OLMo2, Gemma 3's sliding layers), fused [q|k|v] and [gate|up]
# (Phi-3, as many key/value heads as query heads so that Megatron can split it), q/k/v interleaved
# head by head (GPT-NeoX), partial rotary (Phi, StableLM, GPT-J), parallel attention and MLP (GPT-J,
# Cohere), LayerNorm with biases (OPT, Starcoder2), multipliers (Granite). Apart from FAMILIES: they
# run tests/parallel/test_hf_families.py's more-families tests only.
MORE_FAMILIES: dict[str, Callable[..., Case]] = {
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=4),
    "gemma3": _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=8,
                       sliding_window=4),
    "olmo2": _decoder("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2),
    "cohere": _decoder("CohereConfig", "CohereForCausalLM", num_key_value_heads=2),
    "granite": _decoder("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=2),
    "starcoder2": _decoder("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=2, residual_dropout=0.0,
                           embedding_dropout=0.0),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0),
    "phi": _decoder("PhiConfig", "PhiForCausalLM", num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0),
    "stablelm": _decoder("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=2),
    "gpt_neox": _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", attention_dropout=0.0, hidden_dropout=0.0),
    "opt": _decoder("OPTConfig", "OPTForCausalLM", ffn_dim=64, word_embed_proj_dim=32, dropout=0.0,
                    attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0),
    "gptj": _decoder("GPTJConfig", "GPTJForCausalLM", n_embd=32, n_head=4, rotary_dim=4, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}

# MODELS: the models every trace and rule-coverage test runs (both dtypes). FAMILIES: the Hugging Face
# families, 2 layers by default (``layers=``), which tests/parallel/test_hf_families.py plans and
# checks: gpt2 / llama (sdpa), bert / roberta (masked LM, sdpa), t5 (encoder-decoder, sdpa: its learned
# relative position bias goes in as a mask that requires grad), gemma2 (eager: logit soft-capping,
# sliding-window layers), falcon (ALiBi, eager, one key/value head), bloom (ALiBi through baddbmm).
# Apart, so that a family costs its own tests only.
MODELS: dict[str, Callable[..., Case]] = {"mlp": mlp, "transformer": transformer, "gpt2": gpt2, "llama": llama}
FAMILIES: dict[str, Callable[..., Case]] = {"gpt2": gpt2, "llama": llama, "bert": bert, "roberta": roberta, "t5": t5,
                                            "gemma2": gemma2, "falcon": falcon, "bloom": bloom}
HF_FAMILIES = tuple(FAMILIES)


@functools.lru_cache(maxsize=None)
def cached(name: str, dtype=torch.float32) -> Case:
    """One shared case per (name, dtype) per process; do not mutate its model's parameters."""
    return {**MODELS, **FAMILIES}[name](dtype)


@functools.lru_cache(maxsize=None)
def cached_step(name: str, dtype=torch.float32) -> Any:
    """The traced joint step of ``cached(name, dtype)``, shared across test modules."""
    from shardwise.trace import trace_step

    return trace_step(*cached(name, dtype))


def seeded_mlp(d_in=6, hidden=8, d_out=3, seed=0) -> nn.Sequential:
    """Linear-GELU-Linear with weights from their own generator (the global RNG is untouched),
    sized to split unevenly over 2, 3 and 4 ranks by default."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _main() -> None:
    import time

    from shardwise.trace import trace_step

    for name, build in {**MODELS, **FAMILIES}.items():
        for dtype in DTYPES:
            case = build(dtype)
            t = time.perf_counter()
            ts = trace_step(*case)
            print(f"{name:12s} {str(dtype):15s} {len(ts.call_nodes()):4d} ops {time.perf_counter() - t:5.2f}s")


if __name__ == "__main__":
    _main()
