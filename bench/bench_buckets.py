"""Data parallel GPT-2 (HF, tiny and a heavier one): DDP vs shardwise with one all_reduce per
gradient (``bucket_bytes=None``) vs bucketed, overlapped all_reduces (the default), and the
bucketed program run through torch.compile (``compile=True``: its first call's CPU seconds, the
compile, reported as ``first_call_s``; its steady step timed like the others).

    python bench/bench_buckets.py [--nproc 2] [--steps 10] [--warmup 3]

One spawn of ``nproc`` gloo processes; per config each rank times a training step (forward +
backward, no optimizer) of the three, interleaved step by step (shardwise.bench._interleaved:
a barrier before and after each step), median over ``steps``, max over ranks. Each run's loss
and gradients are checked against one device (rtol 1e-4).
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

SIZES = {"tiny": dict(n_layer=2, n_embd=32, n_head=4, batch=4, seq=8),
         "heavier": dict(n_layer=4, n_embd=256, n_head=8, batch=8, seq=64)}
VOCAB = 64


def _gpt2(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=size["n_layer"], n_embd=size["n_embd"], n_head=size["n_head"], vocab_size=VOCAB,
                     n_positions=max(32, size["seq"]), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, VOCAB, (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))
    return model, ids


class _LM(torch.nn.Module):
    """HF GPT-2 as ``forward(ids, labels) -> loss`` (both shardwise and DDP run this one)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def _close(a, b) -> bool:
    return a is not None and b is not None and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)


def _case(name: str, size: dict, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardwise as sw
    from shardwise.tools.bench import _interleaved
    from shardwise.lower.buckets import DEFAULT_BUCKET_BYTES


    world, rank = dist.get_world_size(), dist.get_rank()
    model, ids = _gpt2(size)
    model = _LM(model)
    ref = copy.deepcopy(model)
    ref_loss = ref(ids, ids)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ddp = DDP(copy.deepcopy(model))
    mine = ids.chunk(world)[rank]
    spec = {0: [sw.Shard(0)], 1: [sw.Shard(0)]}
    pms = {(cap, comp): sw.parallelize(copy.deepcopy(model), sw.Mesh((world,), ("dp",)), (ids, ids),
                                       input_placements=spec, backend="torch", bucket_bytes=cap, compile=comp,
                                       debug=not comp)  # compiled: the first step is the compile
           for cap, comp in ((None, False), (DEFAULT_BUCKET_BYTES, False), (DEFAULT_BUCKET_BYTES, COMPILE))}
    out = {}

    def peer():
        ddp.zero_grad(set_to_none=True)
        ddp(mine, mine).backward()

    def stepper(pm):
        def run():
            pm.zero_grad()
            out["loss"] = pm.step(ids, ids)
        return run

    rows = _fsdp_rows(name, model, ids, ref_loss, ref_grads, steps, warmup) if FSDP else []
    for (cap, comp), pm in pms.items():
        peer_t, sw_t = _interleaved(peer, stepper(pm), steps, warmup)
        grads = pm.gradients()
        good = _close(out["loss"], ref_loss) and all(_close(grads.get(n), g) for n, g in ref_grads.items())
        rows.append({"config": name, "bucket_bytes": cap, "ddp_s": statistics.median(peer_t),
                     "sw_s": statistics.median(sw_t), "calls": pm.plan.stats()["collective_calls"],
                     "grads": len(ref_grads), "ok": good, "compile": comp,
                     "first_call_s": pm._executable(pm.plan).program(rank).first_call_s if comp else None})
    return rows


COMPILE = True  # also the compile=True row (bucketed); its first warmup step compiles (~10 s of CPU per layer)


FSDP = True  # also the FSDP-style rows


def _fsdp_rows(name, model, ids, ref_loss, ref_grads, steps, warmup) -> list:
    """FSDP-style: every matrix Shard(0) on "dp" (bucketed + prefetched, and not) vs FSDP2's
    ``fully_shard`` of each block and the root; and both with ``reshard_after_forward=False``
    (bucketed; the -fsdp-keep row: gathered once per step, kept for backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardwise as sw
    from shardwise.tools.bench import _interleaved
    from shardwise.lower.buckets import DEFAULT_BUCKET_BYTES

    world, rank = dist.get_world_size(), dist.get_rank()
    dmesh = init_device_mesh("cpu", (world,))
    peers = {}
    for reshard in (True, False):
        peers[reshard] = peer_model = copy.deepcopy(model)
        for block in peer_model.model.transformer.h:
            fully_shard(block, mesh=dmesh, reshard_after_forward=reshard)
        fully_shard(peer_model, mesh=dmesh, reshard_after_forward=reshard)
    mine = ids.chunk(world)[rank]
    spec = {n: [sw.Shard(0)] for n, p in model.named_parameters() if p.dim() == 2}
    out, rows = {}, []

    for cap, reshard in ((None, True), (DEFAULT_BUCKET_BYTES, True), (DEFAULT_BUCKET_BYTES, False)):
        pm = sw.parallelize(copy.deepcopy(model), sw.Mesh((world,), ("dp",)), (ids, ids),
                            input_placements={0: [sw.Shard(0)], 1: [sw.Shard(0)]}, param_placements=spec,
                            backend="torch", bucket_bytes=cap, reshard_after_forward=reshard)

        def peer(peer_model=peers[reshard]):
            peer_model.zero_grad(set_to_none=True)
            peer_model(mine, mine).backward()

        def run(pm=pm):
            pm.zero_grad()
            out["loss"] = pm.step(ids, ids)

        peer_t, sw_t = _interleaved(peer, run, steps, warmup)
        grads = pm.gradients()
        good = _close(out["loss"], ref_loss) and all(_close(grads.get(n), g) for n, g in ref_grads.items())
        rows.append({"config": f"{name}-fsdp" + ("" if reshard else "-keep"), "bucket_bytes": cap,
                     "ddp_s": statistics.median(peer_t),
                     "sw_s": statistics.median(sw_t), "calls": pm.plan.stats()["collective_calls"],
                     "grads": len(ref_grads), "ok": good})
    return rows


def _body(rank: int, steps: int, warmup: int) -> list:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as cache:  # the compile=True row's first call compiles cold, every run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        return [r for name, size in SIZES.items() for r in _case(name, size, steps, warmup)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    rows = run(a.nproc, a.steps, a.warmup)
    print(f"data parallel GPT-2, {a.nproc} gloo processes, median of {a.steps} steps, max over ranks")
    print("config             bucket_bytes  peer ms  sw ms  sw/peer  sw calls (grads)  matches one device "
          "(peer: DDP; -fsdp rows: FSDP2 fully_shard; -keep: both reshard_after_forward=False; "
          "+compile: compile=True, first call CPU s)")
    for r in rows:
        calls = sum(r["calls"].values())
        first = f"  first call {r['first_call_s']:.1f} s" if r.get("compile") else ""
        print(f"{r['config'] + ('+compile' if r.get('compile') else ''):18} {str(r['bucket_bytes']):12}  "
              f"{r['ddp_s'] * 1e3:7.2f}  {r['sw_s'] * 1e3:6.2f}  {r['sw_s'] / r['ddp_s']:6.2f}x  {calls:4} "
              f"({r['grads']})   {'yes' if r['ok'] else 'NO'}{first}")
    return 0 if all(r["ok"] for r in rows) else 1


def run(nproc: int = 2, steps: int = 10, warmup: int = 3) -> list:
    """One row per config and bucket_bytes: peer (DDP / FSDP2) and shardwise step seconds, max
    over ranks; ``ok``: both matched one device on every rank."""
    from shardwise.run.launch import spawn

    per_rank = spawn(_body, nproc, steps, warmup, timeout=900)
    rows = []
    for same in zip(*per_rank):
        r = dict(same[0])
        r["ddp_s"], r["sw_s"] = max(x["ddp_s"] for x in same), max(x["sw_s"] for x in same)
        r["ok"] = all(x["ok"] for x in same)
        if r.get("compile"):
            r["first_call_s"] = max(x["first_call_s"] for x in same)
        rows.append(r)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
