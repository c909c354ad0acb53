"""Complex numbers, FFTs and linear algebra end to end on a 2-rank mesh: loss and every gradient
equal one device's (and the AdamW step after).

* complex rotary embeddings as Llama 4 and DeepSeek-V2 write them (``polar`` for the factors,
  ``view_as_complex`` of the projections' pairs, a complex ``mul``, ``view_as_real``), attention-
  free, with the sequence sharded (5 positions: uneven), the batch sharded, the heads sharded
  (column-parallel projection), and learnable frequencies (``polar``'s own backward); a complex
  sum over the sharded sequence (a complex Partial all-reduced), also on 2 gloo processes (slow);
* rfft / irfft / fft over the feature dim with the batch or the sequence sharded;
* a batch of matrices through solve, inverse, determinants, Cholesky, eigh, SVD and QR with the
  batch sharded (``_linalg_check_errors``, an op with no output, included);
* tiny Llama 4 text (one layer with rotary, random weights) under data parallelism; sequence
  parallel behind ``slow``.

    python -m pytest tests/parallel/test_complex_models.py -q -p no:cacheprovider
"""
import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Replicate as R
from shardwise import Shard as S

from .harness import check_training

aten = torch.ops.aten
COMPLEX_OPS = (aten.view_as_complex.default, aten.view_as_real.default)


class Rotary(nn.Module):
    """A projection to heads, rotated by complex rotary factors, and a head: no attention."""

    def __init__(self, heads=2, head_dim=8, learn_freqs=False):
        super().__init__()
        self.heads, dim = heads, heads * head_dim
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, 3)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        if learn_freqs:
            self.inv = nn.Parameter(inv)
        else:
            self.register_buffer("inv", inv, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv)
        cis = torch.polar(torch.ones_like(freqs), freqs)  # [t, pairs]
        q = self.q(x).view(b, t, self.heads, -1)
        qc = torch.view_as_complex(q.float().reshape(b, t, self.heads, -1, 2))
        out = torch.view_as_real(qc * cis[None, :, None, :]).flatten(3)
        return self.o(out.reshape(b, t, -1)).pow(2).mean()


def _sharded_nodes(pm, ops) -> list:
    """The plan's nodes of ``ops`` whose strategy shards some input (not all replicated)."""
    return [n for n in pm.plan.prop.nodes.values() if n.call.op in ops
            and any(isinstance(p, S) for ps in n.strategy.ins for p in ps)]


@pytest.mark.parametrize("dim", [1, 0], ids=["sequence", "batch"])
def test_complex_rotary_sequence_or_batch_sharded(dim):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    pm = check_training(Rotary(), sw.Mesh((2,)), (x,), input_placements={"x": [S(dim)]}, steps=2)
    nodes = _sharded_nodes(pm, COMPLEX_OPS + (aten.mul.Tensor,))
    assert {n.call.op for n in nodes} >= set(COMPLEX_OPS), pm.plan.summary()
    assert all(n.strategy.outs[0][0] == S(dim) for n in nodes if n.call.op in COMPLEX_OPS), pm.plan.summary()


def test_complex_rotary_heads_sharded():
    """Column-parallel projection: its output features are the heads, so the complex ops shard on
    the heads dim (2)."""
    torch.manual_seed(0)
    params = {"q.weight": [S(0)], "q.bias": [S(0)], "o.weight": [S(1)], "o.bias": [R()]}
    pm = check_training(Rotary(), sw.Mesh((2,)), (torch.randn(2, 5, 16),), input_placements={"x": [R()]},
                        param_placements=params)
    heads = [n for n in _sharded_nodes(pm, COMPLEX_OPS) if n.strategy.ins[0][0] == S(2)]
    assert heads, pm.plan.summary()


def test_complex_rotary_learnable_frequencies():
    """Gradients through polar itself (its backward: sgn, view_as_real, a complex mul)."""
    torch.manual_seed(0)
    check_training(Rotary(learn_freqs=True), sw.Mesh((2,)), (torch.randn(3, 5, 16),), input_placements={"x": [S(1)]})


class Spectral(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d // 2 + 1, 3)

    def forward(self, x):
        z = torch.fft.rfft(self.inp(x), dim=-1, norm="ortho")
        y = torch.fft.irfft(z * z, n=x.shape[-1], dim=-1, norm="forward")
        w = torch.fft.fft(torch.complex(y, y.flip(-1)), dim=-1)
        return self.out(z.abs()).pow(2).mean() + w.abs().mean() + y.pow(2).mean()


@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "sequence"])
def test_ffts_over_features_with_batch_or_sequence_sharded(dim):
    torch.manual_seed(0)
    pm = check_training(Spectral(), sw.Mesh((2,)), (torch.randn(3, 5, 6),), input_placements={"x": [S(dim)]})
    ffts = _sharded_nodes(pm, (aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default))
    assert {n.call.op for n in ffts} == {aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default}


class Matrices(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(n, n) * 0.1), nn.Parameter(torch.randn(n, 3))

    def forward(self, x):
        a = x + self.w + 4 * torch.eye(x.shape[-1])
        spd = a @ a.mT
        terms = (torch.linalg.solve(a, self.b).pow(2).mean(), torch.linalg.slogdet(a)[1].mean(),
                 torch.linalg.inv(a).sum() * 0.1, torch.linalg.det(a).mean() * 1e-3,
                 torch.linalg.eigh(spd)[0].mean(), torch.linalg.svdvals(a).sum() * 0.1,
                 torch.linalg.qr(a)[1].abs().sum() * 0.01, torch.linalg.cholesky(spd).sum() * 0.01)
        return sum(terms)


def test_batched_linalg_with_the_batch_sharded():
    torch.manual_seed(0)
    pm = check_training(Matrices(), sw.Mesh((2,)), (torch.randn(5, 4, 4) * 0.3,), input_placements={"x": [S(0)]})
    ops = {n.call.op for n in _sharded_nodes(pm, frozenset(pm.plan.traced.ops()))}
    for op in (aten._linalg_solve_ex.default, aten.linalg_inv_ex.default, aten._linalg_slogdet.default,
               aten._linalg_det.default, aten._linalg_eigh.default, aten._linalg_svd.default,
               aten.linalg_qr.default, aten.linalg_cholesky_ex.default, aten._linalg_check_errors.default):
        assert op in ops, (op, pm.plan.summary())


def llama4_text(seq: int = 5):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from tests.models.zoo import _hf_case

    cfg = Llama4TextConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, attn_implementation="sdpa", no_rope_layers=[1], attention_chunk_size=16)
    torch.manual_seed(0)
    return _hf_case(Llama4ForCausalLM(cfg), torch.float32, 2, seq, 64)


def _llama4(dim):
    case = llama4_text()
    pm = check_training(case.model, sw.Mesh((2,)), case.example_inputs,
                        input_placements={"input_ids": [S(dim)], "labels": [S(dim)]}, lr=1e-3,
                        optim_kwargs={"eps": 1e-2})
    assert aten.polar.default in pm.plan.traced.ops()
    nodes = _sharded_nodes(pm, COMPLEX_OPS)
    assert nodes and all(n.strategy.outs[0][0] == S(dim) for n in nodes), pm.plan.summary()


def test_llama4_text_data_parallel():
    _llama4(0)


@pytest.mark.slow
def test_llama4_text_sequence_parallel():
    _llama4(1)


class RotarySummed(Rotary):
    """The rotated queries summed over the (sharded) sequence while complex, then a nonlinear
    function of the sum: a complex Partial(sum) all-reduced."""

    def forward(self, x):
        b, t, _ = x.shape
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv)
        q = torch.view_as_complex(self.q(x).reshape(b, t, self.heads, -1, 2))
        z = (q * torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]).sum(1)
        return z.abs().pow(3).mean() + super().forward(x)


def test_complex_partial_sum_is_reduced():
    torch.manual_seed(0)
    pm = check_training(RotarySummed(learn_freqs=True), sw.Mesh((2,)), (torch.randn(3, 5, 16),),
                        input_placements={"x": [S(1)]})
    complex_in = {name for name, n in pm.plan.prop.nodes.items() if n.call.ins and n.call.ins[0].dtype.is_complex}
    summary = pm.plan.summary().splitlines()
    assert any(line.split()[0] in complex_in and "all_reduce" in line for line in summary if line.split()), summary


def _gloo_rotary(rank):
    """One rank of the summed rotary with learnable frequencies, sequence sharded, on the torch backend."""
    torch.manual_seed(0)
    model, x = RotarySummed(learn_freqs=True), torch.randn(3, 5, 16)
    pm = sw.parallelize(model, sw.Mesh((2,)), (x,), input_placements={"x": [S(1)]}, backend="torch")
    return pm.step(x), pm.gradients()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_complex_rotary_on_gloo_processes():
    """The same program on 2 gloo processes: complex values through the torch backend's collectives."""
    from shardwise.run.launch import spawn

    from .harness import assert_close, single_step

    torch.manual_seed(0)
    model, x = RotarySummed(learn_freqs=True), torch.randn(3, 5, 16)
    loss, grads = single_step(model, (x,), (), None)
    for rank, (got_loss, got_grads) in enumerate(spawn(_gloo_rotary, 2, timeout=240)):
        assert_close(got_loss, loss, f"rank {rank} loss")
        for n, g in grads.items():
            assert_close(got_grads[n], g, f"rank {rank} grad of {n}")
