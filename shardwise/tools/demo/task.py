"""The demo's synthetic task: sort a short sequence of digits, made on the fly.

A sample is ``[d1 .. dn, SEP, s1 .. sn]`` with ``s`` the digits sorted; the model reads it
left to right and is scored only on predicting ``s`` (the prompt's targets are -100, which
the loss ignores). Guessing scores ln(10) = 2.30 per token; a model that has learnt to sort
drives the loss towards 0, so the task shows within a hundred steps whether training works.
"""
from __future__ import annotations

import torch

DIGITS = 10
SEP = DIGITS          # token id of the separator
VOCAB = DIGITS + 1
IGNORE = -100


def batch(size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), both [size, 2 * length]: next-token targets, the prompt's ignored."""
    digits = torch.randint(0, DIGITS, (size, length), generator=generator)
    seq = torch.cat([digits, torch.full((size, 1), SEP), digits.sort(dim=1).values], dim=1)
    idx, nxt = seq[:, :-1], seq[:, 1:].clone()
    nxt[:, :length] = IGNORE  # positions whose next token is the prompt or the separator
    return idx, nxt


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of the sorted digits predicted exactly (teacher forcing)."""
    scored = targets != IGNORE
    return float((logits.argmax(-1)[scored] == targets[scored]).float().mean())
