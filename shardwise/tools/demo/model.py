"""The demo's model: a small GPT (token and position embeddings, pre-LayerNorm causal
self-attention blocks with a GELU MLP, a language-model head). Plain PyTorch for one
device, nothing shardwise-specific: ``shardwise demo`` shards it as it is.

    from .model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab=16, dim=64, heads=4, layers=2, max_len=32))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 16
    dim: int = 64
    heads: int = 4
    layers: int = 2
    max_len: int = 32


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused [q|k|v] projection (as GPT-2's c_attn).

    No bias on it (as in Llama): a key bias gets an exactly-zero gradient (softmax ignores a
    constant added to every score), and Adam turns that zero's rounding noise into full-size
    steps, so two runs that differ only in summation order would drift apart on it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """idx [batch, seq] token ids -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    """Cross-entropy over every position; targets of -100 (the prompt) are ignored."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
