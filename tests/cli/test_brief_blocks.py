"""``shardwise plan``'s screenful folds the parameters of repeated layers into one row per
pattern, and where the layers are placed differently each row names its layers (issue 51: two
``blocks.*.attn.qkv.weight`` rows with different placements did not say which block was which).

    python -m pytest tests/cli/test_brief_blocks.py -q -p no:cacheprovider
"""
from shardwise.tools.report.text import _ranges, param_groups


def _param(name, placements, why="chosen by the planner", shape=(96, 32)):
    return {"name": name, "placements": placements, "shape": list(shape), "why": why}


def test_blocks_placed_alike_fold_into_one_row():
    data = {"params": [_param(f"blocks.{i}.mlp.weight", "[S(0),R]") for i in range(4)]}
    assert param_groups(data) == [("blocks.*.mlp.weight", "[S(0),R]", [96, 32], 4, "chosen")]


def test_blocks_placed_differently_name_their_blocks():
    pls = ["[S(0),R]", "[R,S(1)]", "[S(0),R]", "[S(0),R]", "[R,S(1)]"]
    data = {"params": [_param(f"blocks.{i}.attn.qkv.weight", pl) for i, pl in enumerate(pls)]
            + [_param("blocks.0.ln.weight", "[R,R]", "default", (32,)), _param("blocks.1.ln.weight", "[R,R]", "default",
                                                                            (32,))]}
    rows = param_groups(data)
    assert rows == [("blocks.{0,2-3}.attn.qkv.weight", "[S(0),R]", [96, 32], 3, "chosen"),
                    ("blocks.{1,4}.attn.qkv.weight", "[R,S(1)]", [96, 32], 2, "chosen"),
                    ("blocks.*.ln.weight", "[R,R]", [32], 2, "default")]
    assert sum(n for *_, n, _ in rows) == len(data["params"])  # every parameter on exactly one row


def test_nested_layers_and_ranges():
    data = {"params": [_param("layers.0.experts.1.w", "[S(0)]"), _param("layers.0.experts.2.w", "[R]"),
                       _param("layers.1.experts.1.w", "[S(0)]")]}
    assert [r[0] for r in param_groups(data)] == ["layers.{0-1}.experts.1.w", "layers.0.experts.2.w"]
    assert _ranges([0, 1, 2, 5, 7, 8]) == "{0-2,5,7-8}" and _ranges([4]) == "4"
