"""The per-rank memory estimate against the measured peak, with bf16 mixed precision and activation
checkpointing: the table in bench/RESULTS.md ("memory estimate vs measured peak: precision and
checkpointing").

    python bench/bench_precision_memory.py [--quick | --auto]

Estimate: lower/memory.py's liveness analysis of one rank's program (masters, compute copies,
gradients, activations saved for backward, collective buffers), plus nothing else (optimizer state
is outside the program). Measured: that rank's program run alone on real tensors under
torch.profiler's memory events (tests/search/test_memory.measured_peak): the program's arguments
plus the largest running sum of its allocations. Target: within +-10%.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import shardwise as sw  # noqa: E402
from shardwise import Shard as S  # noqa: E402
from shardwise.core.cost import CostModel  # noqa: E402

BF16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def tiny_lm():
    """TinyLM, 4 blocks, whose saved activations outweigh its parameters (the peak in backward)."""
    from tests.models import zoo

    torch.manual_seed(0)
    model = zoo.TinyLM(layers=4, dim=32, max_len=64)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (8, 64), generator=g) for _ in range(2))
    return model, (x,), (y,), zoo.ce_loss


def llama():
    from tests.models import zoo

    c = zoo.llama(batch=8, seq=16)
    return c.model, c.example_inputs, (), None


LAYOUTS = {  # model -> name -> (mesh, parallelize keywords)
    "tiny_lm": {
        "dp": lambda m: (sw.Mesh((2,), ("dp",)), dict(input_placements={0: [S(0)]})),
        "fsdp": lambda m: (sw.Mesh((2,), ("dp",)), dict(input_placements={0: [S(0)]},
                                                         param_placements=sw.recipes.fsdp(m, "dp"))),
        "dp_replicated": lambda m: (sw.Mesh((2,), ("dp",)), dict(
            input_placements={0: [S(0)]}, param_placements={n: [sw.Replicate()] for n, _ in m.named_parameters()})),
    },
    "llama": {
        "dp": lambda m: (sw.Mesh((2,), ("dp",)), dict(input_placements={"input_ids": [S(0)], "labels": [S(0)]})),
        "fsdp": lambda m: (sw.Mesh((2,), ("dp",)), dict(input_placements={"input_ids": [S(0)], "labels": [S(0)]},
                                                         param_placements=sw.recipes.fsdp(m, "dp"))),
        "megatron": lambda m: (sw.Mesh((2,), ("tp",)), dict(param_placements=sw.recipes.megatron(m, "tp"))),
        # latency 0: at these toy sizes propagation would otherwise compute on the weight shards
        # rather than gather them (tests/precision/test_mixed_precision.layouts)
        "fsdp_megatron": lambda m: (sw.Mesh((2, 2), ("dp", "tp")), dict(
            input_placements={"input_ids": {"dp": S(0)}, "labels": {"dp": S(0)}}, cost_model=CostModel(latency=0),
            param_placements=sw.recipes.merge(sw.recipes.megatron(m, "tp"), sw.recipes.fsdp(m, "dp")))),
        "ulysses": lambda m: (sw.Mesh((2,), ("sp",)), dict(input_placements={"input_ids": [S(1)], "labels": [S(1)]},
                                                            attention="ulysses")),
    },
}
MODELS = {"tiny_lm": tiny_lm, "llama": llama}


def measure(model_name: str, layout: str, precision, checkpointing: str, rank: int = 0) -> dict:
    """One row: the estimate and the measured peak of ``rank``'s program, and the plan's parts."""
    from tests.search.test_memory import measured_peak

    model, inputs, targets, loss_fn = MODELS[model_name]()
    mesh, kw = LAYOUTS[model_name][layout](model)

    def plan(checkpointing, **more):
        pm = sw.parallelize(copy.deepcopy(model), mesh, inputs, loss_fn=loss_fn, example_targets=targets or None,
                            mixed_precision=precision, activation_checkpointing=checkpointing, **kw, **more)
        pm.step(*inputs, *targets)
        return pm

    label = checkpointing
    if checkpointing == "auto":  # a budget halfway between the "blocks" and the plain plan's peaks
        peaks = [plan(ck).plan.stats()["peak_memory_bytes"] for ck in ("none", "blocks")]
        budget = sum(peaks) / 2
        pm = plan("auto", memory_budget=budget)
        label = f"auto, budget {budget / 1e6:.2f} MB: {len(pm.plan.prop.recomputed)} of 4 blocks recomputed"
    else:
        pm = plan(checkpointing)
    est = pm.plan.memory_estimate(rank)
    got = measured_peak(pm, rank, inputs, targets)
    return {"model": model_name, "layout": layout, "precision": "bf16 (fp32 masters)" if precision else "fp32",
            "checkpointing": label, "rank": rank, "estimate": est.peak, "measured": got,
            "ratio": est.peak / got, "memory": pm.plan.stats()["memory"]}


CASES = [(m, lay, p, ck) for m, lays in (("tiny_lm", ("dp", "fsdp")), ("llama", ("dp", "fsdp", "megatron")))
         for lay in lays for p in (None, BF16) for ck in ("none", "blocks", "selective")]
CASES += [("llama", lay, BF16, ck) for lay in ("fsdp_megatron", "ulysses") for ck in ("none", "blocks")]
# "auto": data parallel with every parameter replicated, so recomputing blocks is the planner's only lever
AUTO = [("tiny_lm", "dp_replicated", p, "auto") for p in (None, BF16)]
CASES += AUTO
QUICK = [("tiny_lm", "dp", p, ck) for p in (None, BF16) for ck in ("none", "blocks")]


def table(rows: list) -> str:
    head = ["| model / layout | precision | checkpointing | estimate B | measured B | estimate / measured |"
            " masters | parameters | gradients | peak activations |", "|---|---|---|---|---|---|---|---|---|---|"]
    body = [f"| {r['model']} / {r['layout']} | {r['precision']} | {r['checkpointing']} | {r['estimate']} | "
            f"{r['measured']} | {r['ratio']:.3f} | {r['memory']['masters']} | {r['memory']['parameters']} | "
            f"{r['memory']['gradients']} | {r['memory']['peak_activations']} |" for r in rows]
    return "\n".join(head + body)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model's data-parallel rows only")
    ap.add_argument("--auto", action="store_true", help="the activation_checkpointing='auto' rows only")
    args = ap.parse_args(argv)
    rows = [measure(*case) for case in (QUICK if args.quick else AUTO if args.auto else CASES)]
    print(table(rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"\nworst: {worst * 100:.1f}% off (target: within 10%)")


if __name__ == "__main__":
    main()
