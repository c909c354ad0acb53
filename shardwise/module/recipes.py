"""Placement recipes as data: Megatron tensor parallelism, sequence parallelism and FSDP for
common model families, each returning a ``param_placements`` dict for ``sw.parallelize``.

    import shardwise as sw
    mesh = sw.Mesh((2, 2), ("dp", "tp"))
    tp = sw.recipes.megatron(model, "tp")
    params = sw.recipes.merge(tp, sw.recipes.fsdp(model, "dp", beside=tp))
    pm = sw.parallelize(model, mesh, (idx,), input_placements={0: {"dp": sw.Shard(0)}},
                        param_placements=params, loss_fn=loss_fn, example_targets=(y,))

A Megatron plan is written like torchtitan's: module paths (regular expressions matched on
whole path components) mapped to a style, ``"colwise"`` (the output features are split: every
rank computes some of them) or ``"rowwise"`` (the input features are split: every rank
computes a partial sum, reduced once after it). The style becomes placements from the
module's own weight layout: ``nn.Linear`` stores ``[out, in]`` (colwise ``Shard(0)``,
rowwise ``Shard(1)``), Hugging Face's ``Conv1D`` (GPT-2) stores ``[in, out]`` (the other way
round); a colwise bias is ``Shard(0)``, a rowwise bias stays whole. A fused ``[q|k|v]``
projection is colwise in 3 groups (``Shard(d, groups=3)``), so every rank holds whole heads
of q, k and v. Everything a recipe does not name stays ``Replicate`` (or is the planner's to
choose under ``param_placements="auto"``-style merging by the caller).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from ..core.errors import ShardingError
from ..core.layout import Replicate, Shard


@dataclass(frozen=True)
class Style:
    """How a module is split on the tensor-parallel mesh dim: "colwise" or "rowwise" (groups: fused
    parts laid end to end). ``fused_qkv``: the output features hold q, k and v of every head (as
    [q|k|v] in 3 groups, or interleaved head by head with groups 1), so a rank holds whole heads only
    where the model has as many key/value heads as query heads (checked against its config)."""

    kind: str
    groups: int = 1
    fused_qkv: bool = False
    heads: bool = False  # separate q, k, v (colwise) or attention output (rowwise) projection: features by head


COL, ROW = Style("colwise"), Style("rowwise")
HEADS_COL, HEADS_ROW = Style("colwise", heads=True), Style("rowwise", heads=True)  # q/k/v, attention output
QKV = Style("colwise", groups=3, fused_qkv=True)  # [q|k|v]
QKV_BY_HEAD = Style("colwise", fused_qkv=True)  # [head 0: q k v | head 1: q k v | ...] (GPT-NeoX, Bloom)
GATE_UP = Style("colwise", groups=2)  # [gate|up] (Phi-3)

# Family -> {module path pattern: style}. Patterns match whole dotted components at the end of
# the module path (``blocks.0.attn.qkv`` matches ``qkv`` and ``attn\.qkv``).
MEGATRON_PLANS: dict[str, dict[str, Style]] = {
    # Hugging Face GPT-2 (Conv1D): c_attn is [q|k|v]
    "gpt2": {r"attn\.c_attn": QKV, r"attn\.c_proj": ROW, r"mlp\.c_fc": COL, r"mlp\.c_proj": ROW},
    # Hugging Face Llama / Mistral / Qwen style (nn.Linear, separate q/k/v, gated MLP)
    "llama": {r"self_attn\.(q|k|v)_proj": HEADS_COL, r"self_attn\.o_proj": HEADS_ROW,
              r"mlp\.(gate|up)_proj": COL, r"mlp\.down_proj": ROW},
    # Hugging Face BERT / RoBERTa style encoders
    "bert": {r"attention\.self\.(query|key|value)": HEADS_COL, r"attention\.output\.dense": HEADS_ROW,
             r"intermediate\.dense": COL, r"layer\.\d+\.output\.dense": ROW},
    # nn.Linear GPTs with a fused qkv (shardwise.tools.demo.model.GPT, the tests' TinyLM)
    "gpt": {r"qkv": QKV, r"proj": ROW, r"up": COL, r"down": ROW},
    # Hugging Face OPT
    "opt": {r"self_attn\.(q|k|v)_proj": HEADS_COL, r"self_attn\.out_proj": HEADS_ROW, r"fc1": COL, r"fc2": ROW},
    # Hugging Face Phi (phi-1, phi-2)
    "phi": {r"self_attn\.(q|k|v)_proj": HEADS_COL, r"self_attn\.dense": HEADS_ROW, r"mlp\.fc1": COL, r"mlp\.fc2": ROW},
    # Hugging Face Phi-3: fused [q|k|v] and [gate|up]
    "phi3": {r"self_attn\.qkv_proj": QKV, r"self_attn\.o_proj": ROW, r"mlp\.gate_up_proj": GATE_UP,
             r"mlp\.down_proj": ROW},
    # Hugging Face GPT-J
    "gptj": {r"attn\.(q|k|v)_proj": HEADS_COL, r"attn\.out_proj": HEADS_ROW, r"mlp\.fc_in": COL, r"mlp\.fc_out": ROW},
    # Hugging Face GPT-NeoX (Pythia) and Bloom: q, k, v interleaved head by head in one projection
    "gpt_neox": {r"attention\.query_key_value": QKV_BY_HEAD, r"attention\.dense": ROW,
                 r"mlp\.dense_h_to_4h": COL, r"mlp\.dense_4h_to_h": ROW},
    "bloom": {r"self_attention\.query_key_value": QKV_BY_HEAD, r"self_attention\.dense": ROW,
              r"mlp\.dense_h_to_4h": COL, r"mlp\.dense_4h_to_h": ROW},
    # Hugging Face Starcoder2: Llama's attention, GPT-2's MLP names (nn.Linear)
    "starcoder2": {r"self_attn\.(q|k|v)_proj": HEADS_COL, r"self_attn\.o_proj": HEADS_ROW, r"mlp\.c_fc": COL,
                   r"mlp\.c_proj": ROW},
}


def _match(plan: dict[str, Style], path: str) -> Style | None:
    for pattern, style in plan.items():
        if re.search(r"(^|\.)(" + pattern + r")$", path):
            return style
    return None


def detect_family(model: nn.Module) -> str:
    """The family of MEGATRON_PLANS whose patterns name the most modules of ``model`` (the first
    among equals): OPT's q/k/v projections are named as Llama's, but only OPT's plan names its
    out_proj, fc1 and fc2 as well."""
    paths = [name for name, _ in model.named_modules()]
    named = {family: sum(1 for p in paths if _match(plan, p)) for family, plan in MEGATRON_PLANS.items()}
    best = max(named, key=named.get)
    if named[best]:
        return best
    raise ShardingError(
        f"no Megatron plan matches the modules of {type(model).__name__} "
        f"(known families: {', '.join(MEGATRON_PLANS)})",
        fix="pass family=... or your own plan: sw.recipes.megatron(model, 'tp', plan={'attn.qkv': "
            "sw.recipes.QKV, 'attn.out': sw.recipes.ROW, ...})")


def _weight_dims(module: nn.Module) -> tuple[int, int]:
    """(output-feature dim, input-feature dim) of the module's weight: Hugging Face's Conv1D keeps it
    as [in, out] (recognised by name: no import)."""
    return (1, 0) if type(module).__name__ == "Conv1D" else (0, 1)


def _placements_for(module: nn.Module, style: Style, unit: int = 1) -> dict[str, object]:
    """``unit``: the features are split in whole blocks of that many (a head's, _head_unit)."""
    out_dim, in_dim = _weight_dims(module)
    got = {}
    for pname, _ in module.named_parameters(recurse=False):
        if style.kind == "colwise":
            got[pname] = Shard(out_dim if pname == "weight" else 0, unit, style.groups)
        elif pname == "weight":
            got[pname] = Shard(in_dim, unit)
    return got


def megatron(model: nn.Module, mesh_dim: str | None = None, *, family: str | None = None,
             plan: dict[str, Style] | None = None, size: int | None = None) -> dict:
    """Megatron tensor-parallel placements: ``{param name: {mesh_dim: placement}}``, or bare
    placements ``{param name: placement}`` when ``mesh_dim`` is None (a 1-d mesh).

    ``family`` picks a plan of MEGATRON_PLANS (detected from module names if None); ``plan``
    gives your own ``{module path pattern: Style}``. Every attention block then needs one
    all-reduce forward and one backward per column/row pair (or a reduce-scatter plus an
    all-gather where the planner finds that cheaper).

    ``size``: the mesh dim's size, where known. If it does not divide the attention heads of a
    model with as many key/value heads as query heads (6 heads on 4 ranks), the q, k, v and
    attention output projections are split in whole heads (``Shard(d, unit=head_dim)``: 2, 2, 1
    and 1 heads) instead of cutting heads apart, which sends fewer bytes (a 1-layer Qwen2 of 6
    heads on 4 ranks: 45.1 vs 62.0 KB a step). Where it divides them, or without ``size``, the
    plain shards are the same split. With fewer key/value heads than ranks (grouped-query
    attention, which Megatron-LM cannot split at all) the plain shards stay: whole heads measured
    costlier there (each rank's query heads then need another rank's key/value head)."""
    if plan is None:
        family = family or detect_family(model)
        if family not in MEGATRON_PLANS:
            raise ShardingError(f"unknown recipe family {family!r}", fix=f"use one of {sorted(MEGATRON_PLANS)}")
        plan = MEGATRON_PLANS[family]
    spec, unit = {}, _head_unit(model, plan, size)
    for path, module in model.named_modules():
        style = _match(plan, path)
        if style is None:
            continue
        if style.fused_qkv:
            _check_whole_heads(model, path)
        for pname, placement in _placements_for(module, style, unit if style.heads else 1).items():
            spec[f"{path}.{pname}" if path else pname] = placement
    if not spec:
        raise ShardingError(f"the Megatron plan names no parameter of {type(model).__name__}",
                            fix="check the plan's module patterns against model.named_modules()")
    return _on(mesh_dim, spec)


def _heads(model: nn.Module) -> tuple[int, int] | None:
    """(query heads, key/value heads) from a Hugging Face config on ``model``, or None."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if not isinstance(heads, int):
        return None
    if getattr(cfg, "multi_query", False):  # Falcon, GPTBigCode: one key/value head
        return heads, 1
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None)
    return heads, kv if isinstance(kv, int) else heads


def _head_unit(model: nn.Module, plan: dict[str, Style], size: int | None) -> int:
    """The head dim where ``size`` ranks cannot split the heads of a model with as many key/value
    heads as query heads evenly, so that heads are split whole (``megatron``); else 1. Also 1
    where a heads-split projection's features are no whole number of heads (not the config's
    attention), keeping the plain split, which is exact either way."""
    heads = _heads(model)
    if size is None or heads is None or heads[0] != heads[1] or heads[0] % size == 0:
        return 1
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // heads[0]
    for path, module in model.named_modules():
        style = _match(plan, path)
        if style is None or not style.heads:
            continue
        weight = getattr(module, "weight", None)
        dim = _weight_dims(module)[0 if style.kind == "colwise" else 1]
        if not head_dim or weight is None or weight.dim() != 2 or weight.shape[dim] != heads[0] * head_dim:
            return 1
    return head_dim


def _check_whole_heads(model: nn.Module, path: str) -> None:
    """A fused q/k/v projection splits into whole heads of q, k and v only if there are as many
    key/value heads as query heads: with fewer, q's part is wider than k's and v's, and no one
    placement gives a rank matching heads of each."""
    heads = _heads(model)
    if heads is not None and heads[0] != heads[1]:
        raise ShardingError(
            f"{path} fuses q, k and v, with {heads[1]} key/value head(s) for {heads[0]} query heads: "
            "a colwise split cannot give every rank whole heads of each",
            fix="leave that projection out of the plan (plan={...} with the MLP's patterns and the output "
                "projection left whole), or split it into separate q, k and v Linears")


def fsdp(model: nn.Module, mesh_dim: str | tuple[str, ...] = "dp", *, dim: int = 0, beside: dict | None = None) -> dict:
    """Fully-sharded (ZeRO-3) placements: every parameter ``Shard(dim)`` on ``mesh_dim`` (a name
    or several: nested in order). Each rank stores 1/n of every parameter, its gradient and
    optimizer state; the planner gathers a parameter where it is used and reduce-scatters its
    gradient. Uneven sizes are fine (trailing ranks hold less); 0-d parameters stay whole.

    ``beside``: the placements of a recipe this one is merged with (``megatron(model, "tp")``). A
    dim that recipe splits in groups (a fused [q|k|v] or [gate|up]) or in whole heads cannot have
    another shard nested in it (or only where every chunk is whole heads), so such a parameter is
    sharded here on another of its dims (a 1-d one stays whole on ``mesh_dim``). A plain shard of
    ``dim`` there is nested under as before: moving those too (a column-parallel weight on its
    dim 1) gave plans without the all_to_all that re-orders a gathered weight for "tp", but with
    full activation checkpointing a modelled Llama 3.1 8B step on (2, 4) slower and 17 GiB
    heavier, so it is not done (docs/guide.md)."""
    dims = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
    out = {}
    for name, p in model.named_parameters():
        if p.dim() <= dim or not p.requires_grad:
            continue
        grouped = {pl.dim for pl in _placements_of((beside or {}).get(name))
                   if isinstance(pl, Shard) and pl.block != (1, 1)}
        d = next((k for k in [dim, *range(p.dim())] if k not in grouped), None)
        if d is not None:
            out[name] = {m: Shard(d) for m in dims}
    return out


def _placements_of(spec) -> list:
    """The placements of one parameter's entry in a recipe: {mesh dim: placement}, a bare placement or None."""
    if spec is None:
        return []
    return list(spec.values()) if isinstance(spec, dict) else [spec]


def sequence(model: nn.Module, mesh_dim: str = "sp") -> dict:
    """Sequence parallelism keeps every parameter whole on ``mesh_dim`` (``Replicate``): what
    makes it is the inputs' placement (``sequence_inputs``). The gradients are all-reduced
    over ``mesh_dim`` like data parallelism's, and attention runs as the ``attention=``
    option of ``parallelize`` says (ulysses, ring, gather)."""
    return {name: {mesh_dim: Replicate()} for name, _ in model.named_parameters()}


def sequence_inputs(mesh_dim: str = "sp", seq_dim: int = 1, arg: int | str = 0, batch_dim: str | None = None) -> dict:
    """``input_placements`` that shard input ``arg``'s sequence dim on ``mesh_dim`` (and its batch,
    dim 0, on ``batch_dim`` if given): ``[batch, seq]`` token ids take ``seq_dim=1``."""
    spec = {mesh_dim: Shard(seq_dim)}
    if batch_dim is not None:
        spec[batch_dim] = Shard(0)
    return {arg: spec}


def merge(*specs: dict) -> dict:
    """Merge per-mesh-dim recipes ``{name: {mesh_dim: placement}}`` (e.g. Megatron on "tp" and
    FSDP on "dp"); two recipes placing one parameter on the same mesh dim differently is an error."""
    out: dict = {}
    for spec in specs:
        for name, per_dim in spec.items():
            if not isinstance(per_dim, dict):
                raise ShardingError(f"merge takes per-mesh-dim recipes; {name!r} maps to {per_dim!r}",
                                    fix="build each recipe with a mesh_dim, e.g. megatron(model, 'tp')")
            have = out.setdefault(name, {})
            for dim, pl in per_dim.items():
                if dim in have and have[dim] != pl:
                    raise ShardingError(f"recipes disagree on {name!r} on mesh dim {dim!r}: {have[dim]} vs {pl}",
                                        fix="give that parameter one placement per mesh dim")
                have[dim] = pl
    for name, have in out.items():
        shards = [(m, pl) for m, pl in have.items() if isinstance(pl, Shard)]
        for m, pl in shards:
            other = next((n for n, q in shards if n != m and q.dim == pl.dim), None)
            if other is not None and pl.groups > 1:
                raise ShardingError(
                    f"{name!r} is split in {pl.groups} groups on mesh dim {m!r} and sharded on the same tensor dim on "
                    f"{other!r}: a dim split in groups cannot be nested",
                    fix="build the FSDP recipe beside the other: tp = sw.recipes.megatron(model, 'tp'); "
                        "sw.recipes.merge(tp, sw.recipes.fsdp(model, 'dp', beside=tp))")
    return out


def experts(model: nn.Module, mesh_dim: str | None = "ep") -> dict:
    """Expert parallelism for Mixture-of-Experts models: every parameter of an ``experts`` module
    (Hugging Face's stacked [num_experts, ...] weights) ``Shard(0)`` on ``mesh_dim``, so each rank
    holds its own experts (uneven counts allowed, a rank may hold none). The experts run as one
    ``shardwise.moe_experts`` op (trace/moe.py, rules/moe_experts.py): with the batch sharded
    on the same mesh dim (``batch_inputs(mesh_dim, ...)``: EP = DP x EP) each rank sends its
    tokens to the ranks holding their experts and gets the results back by all_to_all (token
    dispatch, ops/moe/dispatch.py); with the tokens whole there, each rank computes its experts'
    share and the shares add up (a partial sum). The planner picks by cost. Combine with
    megatron/fsdp recipes on other mesh dims by ``merge``."""
    spec = {n: Shard(0) for n, p in model.named_parameters()
            if ".experts." in f".{n}" and p.dim() >= 3}
    if not spec:
        raise ShardingError(f"{type(model).__name__} has no stacked expert weights (an 'experts' module with "
                            "[num_experts, ...] parameters)", fix="name the expert weights in param_placements")
    return _on(mesh_dim, spec)


def batch_inputs(mesh_dim: str | tuple[str, ...], *args: int | str, dim: int = 0) -> dict:
    """``input_placements`` sharding dim ``dim`` (the batch) of each input ``args`` (names or
    indices) on ``mesh_dim`` (a name or several, nested in order): data parallel inputs, and
    with ``experts(model, mesh_dim)`` the tokens an expert-parallel layer dispatches, e.g.
    ``batch_inputs("ep", "input_ids", "labels")``."""
    if not args:
        raise ShardingError("batch_inputs names no input", fix="pass the inputs, e.g. batch_inputs('ep', 'input_ids')")
    dims = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
    return {arg: {d: Shard(dim) for d in dims} for arg in args}


def _on(mesh_dim: str | None, spec: dict) -> dict:
    return dict(spec) if mesh_dim is None else {n: {mesh_dim: p} for n, p in spec.items()}


RECIPES = ("megatron", "fsdp", "sequence")


def by_name(name: str, model: nn.Module, mesh_names: tuple[str, ...],
            mesh_shape: tuple[int, ...] | None = None) -> dict:
    """A recipe by name for the command line: ``megatron`` on the last mesh dim (its size from
    ``mesh_shape``), ``fsdp`` on the first, ``sequence`` (parameters whole), or ``megatron+fsdp``."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in RECIPES]
    if unknown:
        raise ShardingError(f"unknown recipe {unknown[0]!r}", fix=f"use one of {', '.join(RECIPES)} (or a+b)")
    size = mesh_shape[-1] if mesh_shape else None
    made = {"megatron": lambda: megatron(model, mesh_names[-1], size=size),
            "sequence": lambda: sequence(model, mesh_names[-1])}
    specs = [made[p]() for p in parts if p != "fsdp"]
    if "fsdp" in parts:  # beside the others: not nested in a dim they split in groups (fsdp's docstring)
        specs.append(fsdp(model, mesh_names[0], beside=merge(*specs) if specs else None))
    return merge(*specs)


__all__ = ["Style", "COL", "ROW", "HEADS_COL", "HEADS_ROW", "QKV", "QKV_BY_HEAD", "GATE_UP", "MEGATRON_PLANS",
           "megatron", "fsdp", "experts", "batch_inputs", "sequence", "sequence_inputs", "merge", "detect_family",
           "by_name"]
