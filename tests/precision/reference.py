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
  the single device rounds the whole sum once (the sharded sum is the more accurate one). Each half
  is off by at most half a bf16 ulp of its own magnitude: |error| <= 2**-8 * (|a| + |b|), and
  ``BF16`` below allows that, relative to the gradient's scale. Activations reduced across tensor
  parallel ranks (a row-parallel matmul's partial sums, all-reduced in bf16 as Megatron does) are
  rounded likewise, and everything after them follows at bf16 rounding.
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


def policy_step(model, policy, inputs: tuple, targets: tuple = (), loss_fn=None):
    """(loss, {name: fp32 gradient}) of one device under ``policy`` (module docstring)."""
    params = {n: p.detach().to(policy.param_dtype).requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    out = _cast(functional_call(model, {**params, **buffers}, _cast(tuple(inputs), policy.param_dtype)),
                policy.output_dtype)
    loss = loss_fn(out, *targets) if loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
    wanted = [n for n, p in params.items() if p.requires_grad]
    grads = torch.autograd.grad(loss, [params[n] for n in wanted], allow_unused=True)
    reduce = policy.reduce_dtype or policy.param_dtype
    return loss.detach(), {n: None if g is None else g.to(reduce).float() for n, g in zip(wanted, grads)}


def assert_bf16_close(got, want, what: str, ulps: float = 4.0):
    """|got - want| <= ulps * 2**-8 * scale, scale the largest |want| (module docstring: a partial sum
    rounded to bf16 per rank; ``ulps`` covers the roundings the op's dependencies add)."""
    assert got is not None and got.dtype == want.dtype, f"{what}: {None if got is None else got.dtype}"
    scale = want.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    err = (got - want).abs().max()
    assert err <= ulps * BF16_ULP * scale, f"{what}: max error {err:.3g} > {ulps} bf16 ulps of {scale:.3g}"
