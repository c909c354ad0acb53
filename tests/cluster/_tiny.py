"""The tiny Llama the calculator's quick tests plan, and the planned blocks they share (calc.estimate's
``plans=``): planned once per mesh, policy and layout in a test session, stamped and played anew by each."""
from __future__ import annotations

import json
import os
import tempfile

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
PLANS: dict = {}
_DIR = tempfile.mkdtemp(prefix="shardwise-tiny-")


def config(layers: int = 6) -> str:
    """A config.json of the tiny Llama with ``layers`` blocks (every depth plans the same 3 blocks)."""
    path = os.path.join(_DIR, f"tiny-{layers}.json")
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**TINY, "num_hidden_layers": layers}, f)
    return path
