"""Repeated layers solved once (search/layers.py): identical layers found structurally share the
ILP's columns, so the program does not grow with depth, and the plan is the one the full
program finds, exact against one device.

    python -m pytest tests/search/test_layers.py -q -p no:cacheprovider
"""
import operator

import torch

import shardwise as sw
from shardwise.search import layers
from shardwise.search.ilp import Memo, Program
from shardwise.search.solve import plan_cost
from shardwise.trace.provenance import module_path
from tests.models import zoo
from tests.parallel.harness import check_training

ADAM = dict(steps=2, lr=1e-3, optim_kwargs={"eps": 1e-6})


def _pm(n_layers, mesh=("tp", 2), **kw):
    torch.manual_seed(0)
    model = zoo.TinyLM(layers=n_layers)
    x, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    return model, x, y, sw.Mesh((mesh[1],), (mesh[0],))


def _program_size(pm, aliases) -> int:
    plan = pm.plan
    prop = plan.prop
    ph = {n.name: prop.layouts[n.name][0].placements for n in prop.gm.graph.nodes if n.op == "placeholder"
          and prop.layouts[n.name][0] is not None}
    outs = [None if lay is None else lay.placements for lay in prop.output_layouts]
    prog = Program(pm.planner, {}, False, Memo(pm.planner), aliases=aliases).build(prop.gm, ph, outs)
    return len(prog.model.cost)


def test_layers_found_and_program_flat_in_depth():
    sizes = {}
    for n in (5, 6):
        model, x, y, mesh = _pm(n)
        pm = sw.parallelize(model, mesh, (x,), loss_fn=zoo.ce_loss, example_targets=(y,), planner="propagate")
        gm = pm.plan.prop.gm
        aliases = layers.repeated_layers(gm, pm.plan.param_placeholders, {}, {})
        nodes = {node.name: node for node in gm.graph.nodes}
        shared = set(aliases) | set(aliases.values())
        keys = [layers.layer_key(module_path(nodes[name])) for name in shared
                if nodes[name].op == "call_function" and nodes[name].target is not operator.getitem]
        in_layers = {k[1] for k in keys if k is not None}  # (gradient accumulations ran in no module)
        # every block but the first takes part, the last too (each gradient accumulation between
        # blocks joins the block running then, so the residual stream's gradient enters each alike);
        # the first differs: the position embedding's gradient, summed in no module, joins it
        assert in_layers == set(range(1, n)), in_layers
        blocks = [name for name, node in nodes.items() if node.op == "call_function"
                  and (layers.layer_key(module_path(node)) or ("", -1))[0] == "blocks"
                  and layers.layer_key(module_path(node))[1] in in_layers]
        assert set(blocks) <= shared, set(blocks) - shared  # and all of each block
        assert all(aliases[a] not in aliases for a in aliases)  # one template per class
        sizes[n] = (_program_size(pm, aliases), _program_size(pm, {}))
    shared_growth, full_growth = sizes[6][0] - sizes[5][0], sizes[6][1] - sizes[5][1]
    # unshared, the program grows by a block's columns per block; shared, hardly at all
    assert full_growth > 0.1 * sizes[5][1] and shared_growth < 0.1 * full_growth, sizes


def test_shared_plan_equals_full_and_is_exact(monkeypatch):
    """Four identical blocks on tp=2: the shared program's plan costs what the full program's
    does, and trains exactly."""
    model, x, y, mesh = _pm(4)
    pm = check_training(model, mesh, (x,), (y,), zoo.ce_loss, planner="ilp", **ADAM)
    shared = plan_cost(pm.planner, pm.plan.prop)
    monkeypatch.setattr("shardwise.search.solve.repeated_layers",
                        lambda *a, **k: layers.repeated_layers(*a, min_repeats=99))
    model, x, y, mesh = _pm(4)
    full = sw.parallelize(model, mesh, (x,), loss_fn=zoo.ce_loss, example_targets=(y,), planner="ilp")
    assert full.plan.prop.solve_report.variables > pm.plan.prop.solve_report.variables
    assert abs(shared - plan_cost(full.planner, full.plan.prop)) <= 1e-9 * shared


def test_gpt2_program_holds_one_layer():
    """GPT-2 (4 layers): the trace computes the causal mask once, in the first layer, for every
    layer (trace/normalize.merge_duplicates); it is no layer's own, so the first layer matches the
    others and the program holds one layer's nodes (plus the mask's), not two."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model, ids = GPT2LMHeadModel(cfg), torch.randint(0, 64, (2, 8))
    pm = sw.parallelize(model, sw.Mesh((2,), ("tp",)), zoo.positional(model.forward, input_ids=ids, labels=ids))
    gm = pm.plan.prop.gm
    aliases = layers.repeated_layers(gm, pm.plan.param_placeholders, {}, {})
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    key = {n.name: layers.layer_key(module_path(n)) for n in calls}
    one_layer = sum(k == ("transformer.h", 1) for k in key.values())
    own = [n.name for n in calls if key[n.name] and key[n.name][0] == "transformer.h" and n.name not in aliases]
    assert {k[1] for name, k in key.items() if k and name in aliases} == {0, 1, 2, 3}
    assert len(own) < 1.1 * one_layer, (len(own), one_layer)
