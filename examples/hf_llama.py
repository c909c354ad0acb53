"""A tiny Hugging Face Llama trained sharded with shardwise, checked against one device.

    python examples/hf_llama.py                        # 2 ranks as threads in this process
    python examples/hf_llama.py --part bf16            # the same step under a bf16 policy
    python examples/hf_llama.py --part pipeline        # the same step as a 2-stage pipeline
    shardwise run examples/hf_llama.py --nproc 2       # 2 gloo processes (the torch backend)
    shardwise run examples/hf_llama.py --nproc 2 -- --part all

No downloads: a LlamaForCausalLM of a tiny LlamaConfig with random weights. Every check prints
MATCH or MISMATCH (what differed, by how much); the exit code is 1 on any mismatch.

--part train (default): a Hugging Face batch, ``pm.step(**batch)``, with activation checkpointing;
    loss and every gradient against one device for two AdamW steps; a forward call in eval mode;
    then a fresh model resumed from the ``sw.Checkpointer`` of those steps trains two more,
    still equal to the uninterrupted single-device run.
--part bf16: ``sw.MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)`` against one device
    running the same policy (see BF16_ULPS for the tolerance and why).
--part pipeline: ``sw.Pipeline("pp", microbatches=2)`` on a ("pp",) mesh: the 3 rows run as
    microbatches of 2 and 1 on two stages, loss and gradients equal one device's.
"""
import argparse
import copy
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.func import functional_call
from transformers import LlamaConfig, LlamaForCausalLM

import shardwise as sw

FP32 = dict(rtol=1e-4, atol=1e-6)
# bf16 keeps 8 significant bits. The sharded step sums each rank's bf16-rounded partial gradient
# in float32 (reduce_dtype); one device rounds the whole batch's sum once. Each rounding is at
# most half a bf16 ulp of a partial's magnitude, which can exceed the sum's (gradients cancel
# across rows), so a gradient may differ by a few ulps of its own scale: 16 allowed.
BF16_ULPS = 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=32,
                      use_cache=False,  # training keeps no KV cache (pm(...) would drop it, with a warning)
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def batch_of(step: int, rows: int = 3, seq: int = 8) -> dict:
    """A Hugging Face batch: 3 rows, uneven on 2 ranks (2 + 1). ``labels`` are the ids themselves:
    the model shifts them by one inside its loss."""
    ids = torch.randint(0, 64, (rows, seq), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids.clone()}


class Checks:
    def __init__(self, rank: int):
        self.rank, self.failed, self.reported = rank, [], 0

    def close(self, what: str, got, want, rtol: float, atol: float) -> None:
        got, want = got.detach().float(), want.detach().float()
        err = (got - want).abs().max().item()
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            self.failed.append(f"{what}: max abs error {err:.3g}")

    def report(self, what: str) -> None:
        new, self.reported = self.failed[self.reported:], len(self.failed)
        if self.rank == 0:
            print(f"{'MISMATCH' if new else 'MATCH'} {what}" + "".join(f"\n  {f}" for f in new), flush=True)


def compare_step(checks, pm, ref, batch: dict, what: str) -> torch.Tensor:
    """One step of ``pm`` and of the single-device ``ref``: loss and every gradient (fp32)."""
    loss = pm.step(**batch)
    ref.zero_grad()
    want = ref(**batch).loss
    want.backward()
    checks.close(f"{what} loss", loss, want, **FP32)
    grads = pm.gradients()
    for name, p in ref.named_parameters():
        checks.close(f"{what} grad {name}", grads[name], p.grad, **FP32)
    return loss


def part_train(mesh, backend, checks, ckpt_dir: str) -> None:
    placements = {"input_ids": {"dp": sw.Shard(0)}, "labels": {"dp": sw.Shard(0)}}  # batch rows on "dp"
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    pm = sw.parallelize(model, mesh, batch_of(1), input_placements=placements, backend=backend,
                        activation_checkpointing="blocks")
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    ck = sw.Checkpointer(ckpt_dir, every=2, async_save=False)
    start = ck.resume(pm, opt)                      # 0: nothing saved yet
    for step in range(start + 1, 3):                # steps count from 1: ck.step(s) after step s
        compare_step(checks, pm, ref, batch_of(step), f"step {step}")
        opt.step(); pm.zero_grad(); ref_opt.step()  # noqa: E702 - one line per optimizer step
        ck.step(step)                               # saves step 2
    ck.close()
    checks.report("steps 1-2 (data parallel, activation checkpointing): loss and gradients vs one device")

    pm.eval(); ref.eval()                           # noqa: E702 - forward only, no dropout
    with torch.no_grad():
        ids = batch_of(9)["input_ids"]
        checks.close("eval logits", pm(input_ids=ids).logits, ref(input_ids=ids).logits, **FP32)
    pm.train(); ref.train()                         # noqa: E702
    checks.report("forward call in eval mode: logits vs one device")

    other = tiny_llama(seed=1)                      # other weights: the checkpoint must replace them
    pm2 = sw.parallelize(other, mesh, batch_of(1), input_placements=placements, backend=backend,
                         activation_checkpointing="blocks")
    opt2 = pm2.optimizer(torch.optim.AdamW, lr=1e-2)
    ck2 = sw.Checkpointer(ckpt_dir, every=2, async_save=False)
    start = ck2.resume(pm2, opt2)
    assert start == 2, start
    for step in range(start + 1, 5):
        compare_step(checks, pm2, ref, batch_of(step), f"resumed step {step}")
        opt2.step(); pm2.zero_grad(); ref_opt.step()  # noqa: E702
        ck2.step(step)
    ck2.close()
    checks.report("steps 3-4 resumed from the checkpoint of step 2: loss and gradients vs one device")


def part_bf16(mesh, backend, checks) -> None:
    model = tiny_llama()
    policy = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = sw.parallelize(copy.deepcopy(model), mesh, batch_of(1), backend=backend, mixed_precision=policy,
                        input_placements={"input_ids": {"dp": sw.Shard(0)}, "labels": {"dp": sw.Shard(0)}})
    loss = pm.step(**batch_of(1))
    grads = pm.gradients()
    # one device under the same policy: bf16 copies of the fp32 parameters (buffers as they are)
    bf16 = {n: p.detach().to(torch.bfloat16).requires_grad_() for n, p in model.named_parameters()}
    want = functional_call(model, {**bf16, **dict(model.named_buffers())}, kwargs=batch_of(1)).loss
    want.backward()
    ulp = 2.0 ** -8
    checks.close("bf16 loss", loss, want, rtol=BF16_ULPS * ulp, atol=0)
    for name, p in bf16.items():
        scale = p.grad.float().abs().max().item()
        checks.close(f"bf16 grad {name}", grads[name], p.grad, rtol=0, atol=BF16_ULPS * ulp * scale)
    assert all(p.dtype == torch.float32 for p in pm.parameters())  # fp32 masters
    checks.report(f"bf16 policy: loss and gradients vs one device under the same policy ({BF16_ULPS} bf16 ulps)")


def part_pipeline(world, backend, checks) -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    pm = sw.parallelize(model, sw.Mesh((world,), ("pp",)), batch_of(1), backend=backend,
                        pipeline=sw.Pipeline("pp", microbatches=2, schedule="1f1b"))
    compare_step(checks, pm, ref, batch_of(1), "pipeline")
    checks.report(f"pipeline ({world} stages, 1f1b, microbatches of 2 and 1 rows): loss and gradients vs one device")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("train", "bf16", "pipeline", "all"), default="train")
    ap.add_argument("--ckpt", default=None, help="the Checkpointer's directory (default: a fresh one, removed after)")
    args = ap.parse_args()
    if "RANK" in os.environ:                        # started by shardwise run / torchrun: one rank per process
        dist.init_process_group("gloo")
        backend, rank, world = "torch", dist.get_rank(), dist.get_world_size()
    else:                                           # every rank a thread of this process
        backend, rank, world = "threads", 0, 2
    mesh = sw.Mesh((world,), ("dp",))
    checks = Checks(rank)
    parts = ("train", "bf16", "pipeline") if args.part == "all" else (args.part,)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))  # the same on every rank of a run
    ckpt_dir = args.ckpt or os.path.join(tempfile.gettempdir(), f"shardwise-hf-llama-{run_id}")
    try:
        if "train" in parts:
            part_train(mesh, backend, checks, ckpt_dir)
        if "bf16" in parts:
            part_bf16(mesh, backend, checks)
        if "pipeline" in parts:
            part_pipeline(world, backend, checks)
    finally:
        if args.ckpt is None and rank == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    if rank == 0:
        print("MISMATCH" if checks.failed else "MATCH", flush=True)
    if backend == "torch":
        dist.destroy_process_group()
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
