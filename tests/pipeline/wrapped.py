"""A Hugging Face model inside the user's own module, as training scripts wrap it (shared by the
threads and gloo pipeline tests)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class LM(nn.Module):
    """``forward(ids, labels)``: the wrapped model's own loss (``.loss``), or, with ``own_loss``, a
    cross entropy the wrapper computes from the logits (shifted, -100 ignored)."""

    def __init__(self, hf, own_loss: bool = False):
        super().__init__()
        self.hf, self.own_loss = hf, own_loss

    def forward(self, ids, labels):
        if not self.own_loss:
            return self.hf(input_ids=ids, labels=labels).loss
        logits = self.hf(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def wrapped_gpt2(tied: bool = True, own_loss: bool = False, layers: int = 4, batch: int = 8, seq: int = 16):
    """(model, (ids, labels)): the GPT-2 the issue met (vocab 96, width 64, 4 heads), labels
    ignored unevenly over the rows."""
    from transformers import GPT2Config, GPT2LMHeadModel

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_embd=64, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=tied, attn_implementation="sdpa")
    ids = torch.randint(0, 96, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[batch - 1, seq // 2:] = -100
    return LM(GPT2LMHeadModel(cfg), own_loss), (ids, labels)
