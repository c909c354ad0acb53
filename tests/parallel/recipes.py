"""Placements and helpers shared by the end-to-end tests of tests/parallel.

- Megatron tensor-parallel parameter placements for the zoo models, from ``shardwise.module.recipes``
  (one placement, for the tensor-parallel mesh dim; ``on("tp", spec)`` turns them into per-mesh-dim dicts).
- ``SeqFirst`` / ``HFSeqFirst``: wrappers that take token ids as [seq, batch], so the
  sequence sits at dim 0 of the inputs.
- ``collectives_by_phase(plan)``: the plan's collectives split into forward and backward.
- ``program_collectives(text)``: the collective calls found in a printed per-rank program.
"""
from __future__ import annotations

import re
from collections import Counter

import torch
import torch.nn as nn

from shardwise.module import recipes
from tests.models import zoo

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


# -- Megatron placements (the recipes live in the package: shardwise.module.recipes) -----------------
def megatron_transformer(n_layers: int = 2) -> dict:
    """zoo.TinyLM with ``n_layers`` blocks: qkv (3 groups) / up colwise, proj / down rowwise."""
    with torch.device("meta"):  # names and layouts only: no memory, no draw from the global RNG
        return recipes.megatron(zoo.TinyLM(layers=n_layers), family="gpt")


def _hf(name: str, n_layers: int) -> dict:
    model = zoo.cached(name).model
    got = recipes.megatron(model)
    assert {k.split(".")[2] for k in got} == {str(i) for i in range(n_layers)}, f"zoo {name} has other layers"
    return got


def megatron_gpt2(n_layers: int = 2) -> dict:
    """HF GPT-2 (Conv1D weights [in, out]; c_attn's columns are [q|k|v], in 3 groups)."""
    return _hf("gpt2", n_layers)


def megatron_llama(n_layers: int = 2) -> dict:
    """HF Llama (nn.Linear, no biases): q/k/v/gate/up colwise, o_proj/down_proj rowwise."""
    return _hf("llama", n_layers)


MEGATRON = {"transformer": megatron_transformer, "gpt2": megatron_gpt2, "llama": megatron_llama}


def on(mesh_dim: str, spec: dict) -> dict:
    """{name: placement} -> {name: {mesh_dim: placement}} (other mesh dims Replicate)."""
    return {n: {mesh_dim: p} for n, p in spec.items()}


# -- sequence-first wrappers ------------------------------------------------------------------
class SeqFirst(nn.Module):
    """A language model over [batch, seq] ids, driven with [seq, batch] ids; logits [seq, batch, vocab]."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(idx.transpose(0, 1)).transpose(0, 1)


class HFSeqFirst(nn.Module):
    """A Hugging Face causal LM driven with [seq, batch] ids and labels; returns its loss."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels):
        return self.inner(input_ids=input_ids.transpose(0, 1), labels=labels.transpose(0, 1)).loss


# -- counting collectives ---------------------------------------------------------------------
def collectives_by_phase(plan) -> dict:
    """{"forward": Counter, "backward": Counter} of the plan's collectives, by the phase of the
    node that consumes the redistributed value (graph outputs: parameter gradients and the loss,
    counted as backward)."""
    nodes = {n.name: n for n in plan.prop.gm.graph.nodes}
    out = {"forward": Counter(), "backward": Counter()}
    for consumer, _src, steps in plan.edges:
        node = nodes.get(consumer)
        backward = consumer == "output" or bool(node is not None and node.meta.get("autograd_backward"))
        for s in steps:
            if s.is_collective:
                out["backward" if backward else "forward"][s.kind] += 1
    return out


_CALL = re.compile(r"=\s*[\w.]*?(" + "|".join(COLLECTIVE_KINDS) + r")\(")
_GROUPED = re.compile(r"=\s*[\w.]*?regrouped\(.*?'(" + "|".join(COLLECTIVE_KINDS) + r")'")  # on a dim in groups


def program_collectives(program_text: str) -> Counter:
    """Collective calls in a printed per-rank program, by kind."""
    return Counter(m.group(1) for line in program_text.splitlines()
                   for m in [_CALL.search(line) or _GROUPED.search(line)] if m)


def megatron_ok(counts: Counter, n_layers: int) -> bool:
    """Exactly 2 all-reduces per layer, or reduce-scatter + all-gather pairs in their place."""
    if set(counts) - {"all_reduce", "reduce_scatter", "all_gather"}:
        return False
    pairs = counts.get("reduce_scatter", 0)
    return counts.get("all_gather", 0) == pairs and counts.get("all_reduce", 0) + pairs == 2 * n_layers


def n_trainable(model: nn.Module) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad)


def tokens(shape, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g)
