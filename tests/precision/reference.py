"""The single-device reference of a mixed-precision policy, and the tolerances a sharded run is held to.

``policy_step`` is what one device computes under ``sw.MixedPrecision(param_dtype, reduce_dtype)``:
the fp32 masters cast to ``param_dtype``, forward and backward in it (floating inputs cast too,
floating outputs to ``output_dtype``), each gradient then cast to fp32. A sharded run must equal it:

- bit for bit where every rank's op reads the same bits as the single device's op (a column-parallel
  matmul's slice, a row of a batch-sharded activation: CPU kernels compute each output element from
  its own inputs in a fixed order);
- at fp32 rounding where shards only change the order of an fp32 sum (the loss's partial sums, the
  gradients reduced in ``reduce_dtype`` float32);
- at bf16 rounding where a shard's partial sum is itself rounded to bf16 before the fp32 reduction:
  a weight gradient summed over a batch split in two is two bf16-rounded halves added in fp32, where
  the single device rounds the whole sum once (the sharded sum is the more accurate one). The run
  equals ``sharded_reference`` (one device running the policy on each shard, the halves added in
  fp32) bit for bit: that is the exact statement of what data and FSDP sharding compute. Against
  the whole batch the difference is the halves' rounding, half a bf16 ulp of each half's
  magnitude per rounding, and a half can be larger than the sum (a norm weight's gradient cancels
  across the batch; an embedding row sums many tokens, in bf16): ``assert_bf16_close`` allows a
  few ulps of each gradient's scale (16 in the tests: 6.7 the worst seen with 2 threads, 8.9 with one). Activations reduced
  across tensor parallel ranks (a row-parallel matmul's partial sums, all-reduced in bf16 as
  Megatron does) are rounded likewise, and everything after them follows at bf16 rounding: a few
  bf16 ulps of each gradient's scale (``assert_bf16_close``).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

FP32 = dict(rtol=2e-6, atol=1e-7)  # the order of an fp32 sum (relative to the value's scale)
BF16_ULP = 2.0 ** -8  # relative spacing of bf16 (8 significant bits)


def _cast(tree, dtype):
    if dtype is None:
        return tree
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def policy_step(model, policy, inputs: tuple, targets: tuple = (), loss_fn=None, scale: float = 1.0):
    """(loss, {name: fp32 gradient}) of one device under ``policy`` (module docstring); the loss
    times ``scale`` (a shard's share of a mean)."""
    params = {n: p.detach().to(policy.param_dtype).requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    out = _cast(functional_call(model, {**params, **buffers}, _cast(tuple(inputs), policy.param_dtype)),
                policy.output_dtype)
    loss = loss_fn(out, *targets) if loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
    loss = loss * scale if scale != 1.0 else loss
    wanted = [n for n, p in params.items() if p.requires_grad]
    grads = torch.autograd.grad(loss, [params[n] for n in wanted], allow_unused=True)
    reduce = policy.reduce_dtype or policy.param_dtype
    return loss.detach(), {n: None if g is None else g.to(reduce).float() for n, g in zip(wanted, grads)}


def assert_bf16_close(got, want, what: str, ulps: float = 4.0, parts=()):
    """|got - want| <= ulps * 2**-8 * scale, scale the largest |want| or of any of ``parts`` (module
    docstring: a partial sum rounded to bf16 per rank, each rounding half an ulp of that part's
    magnitude, which may exceed the sum's when the parts cancel; ``ulps`` covers the roundings the
    op's dependencies add)."""
    assert got is not None and got.dtype == want.dtype, f"{what}: {None if got is None else got.dtype}"
    scale = max([want.abs().max(), *(p.abs().max() for p in parts)]).clamp_min(torch.finfo(torch.float32).tiny)
    err = (got - want).abs().max()
    assert err <= ulps * BF16_ULP * scale, f"{what}: max error {err:.3g} > {ulps} bf16 ulps of {scale:.3g}"


def sharded_reference(model, policy, inputs: tuple, targets: tuple = (), loss_fn=None, shards: int = 2):
    """(loss, {name: gradient}, [each shard's gradients]): one device running ``policy`` on each
    batch shard (torch.chunk of dim 0, the loss a mean: each shard's weighted by its share), the
    shards' bf16 gradients cast to fp32 and added in rank order. A data- or FSDP-sharded step is
    this, bit for bit: each rank computes its rows as one device does, and the fp32 sum of two
    bf16 values is exact."""
    n = inputs[0].shape[0]
    parts = []
    for k in range(shards):
        take = lambda t: t.chunk(shards)[k] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t  # noqa
        share = take(inputs[0]).shape[0] / n
        parts.append(policy_step(model, policy, tuple(map(take, inputs)), tuple(map(take, targets)), loss_fn,
                                 share))
    loss = sum(p[0] for p in parts[1:]) + parts[0][0] if shards > 1 else parts[0][0]
    grads = {name: sum((p[1][name] for p in parts[1:]), parts[0][1][name]) for name in parts[0][1]}
    return loss, grads, [p[1] for p in parts]

