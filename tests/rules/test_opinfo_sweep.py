"""PyTorch's OpInfo database through shardwise against one device (tools/verify/opinfo.py), and the
crashes it found, each pinned by a test of its own.

The fast subset: one sample per OpInfo, the primary input sharded on dim 0 (and on its first
odd-sized dim when dim 0 divides by 2), in CHUNKS parametrised pieces so ``pytest -n 2`` spreads
them; it fails on any case that is wrong or crashes (plain or under the replicate fallback),
listing them, random ops included (seeded inside the call by OpInfo: refused). The whole sweep
(2 samples, three dims) is behind ``slow``.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import shardwise as sw
from shardwise.trace.errors import TraceError
from shardwise.tools.verify import opinfo

CHUNKS = 8


def _eager(model):
    loss = model()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _sharded(model, placements):
    pm = sw.parallelize(model, sw.Mesh((2,)), (), param_placements=placements)
    return pm.step().detach(), pm.gradients(), pm


class _Sgn(torch.nn.Module):
    def __init__(self, x, w):
        super().__init__()
        self.x = torch.nn.Parameter(x.clone())
        self.w = torch.nn.Parameter(w.clone())

    def forward(self):
        return (self.x.sgn() * self.w).sum()


def test_sgn_zero_gradient_is_exact_and_writable():
    """sgn's gradient is aten._efficientzerotensor (no storage): .grad gets real zeros."""
    torch.manual_seed(0)
    x, w = torch.randn(20, 20), torch.randn(20, 20)
    want_loss, want = _eager(_Sgn(x, w))
    got_loss, got, pm = _sharded(_Sgn(x, w), {"x": [sw.Shard(0)]})
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-5)
    for p in pm.parameters():
        assert not p.grad._is_zerotensor()
        p.grad.add_(1.0)  # in place, as clipping does


class _TensorSplit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(5, 5, 5))
        self.register_buffer("idx", torch.tensor([1, 3]))

    def forward(self):
        return sum(t.sum() for t in torch.tensor_split(self.x, self.idx, 1))  # the line the error names


def test_tensor_split_with_tensor_indices_is_a_trace_error_naming_the_line():
    with pytest.raises(TraceError) as e:
        sw.parallelize(_TensorSplit(), sw.Mesh((2,)), (), param_placements={"x": [sw.Shard(0)]})
    assert "torch.tensor_split" in e.value.message
    assert e.value.source and "test_opinfo_sweep.py" in e.value.source and "tensor_split" in e.value.source
    assert "Python numbers" in e.value.fix


def test_node_call_of_an_op_that_returns_nothing():
    """aten._linalg_check_errors returns nothing: its node has no "val" and the call no outputs."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3, 3, dtype=torch.int32)
    n = g.call_function(torch.ops.aten._linalg_check_errors.default, (x, "linalg.cholesky"), {"is_matrix": True})
    from shardwise.trace.normalize import node_call

    call = node_call(n)
    assert call.outs == () and call.ins[0].shape == (3, 3)


class _Cholesky(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = torch.nn.Parameter(a.clone())

    def forward(self):
        spd = self.a @ self.a.mT + 5 * torch.eye(self.a.shape[-1])
        return (torch.linalg.cholesky(spd) * torch.arange(25.0).reshape(5, 5)).sum()


@pytest.mark.parametrize("fallback", [False, True])
def test_linalg_with_check_errors_is_exact(fallback):
    """cholesky traces to linalg_cholesky_ex + _linalg_check_errors (no output): planned, exact,
    with and without the replicate fallback for the ops it reaches."""
    torch.manual_seed(0)
    a = torch.randn(5, 5)
    want_loss, want = _eager(_Cholesky(a))
    ops = {"aten.linalg_cholesky_ex.default", "aten._linalg_check_errors.default"} if fallback else set()
    pm = sw.parallelize(_Cholesky(a), sw.Mesh((2,)), (), param_placements={"a": [sw.Shard(0)]},
                        replicate_fallback=ops)
    torch.testing.assert_close(pm.step(), want_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pm.gradients()["a"], want["a"], rtol=1e-4, atol=1e-4)


# -- the sweep -------------------------------------------------------------------------------------
def _chunk(i: int) -> list:
    return opinfo.op_infos()[i::CHUNKS]


def _bug_text(rows) -> str:
    return "\n".join(f"{r.case.op} sample {r.case.sample} {r.case.label}: plain {r.plain.kind} {r.plain.detail}"
                     + (f"; fallback {r.fallback.kind} {r.fallback.detail}" if r.fallback else "") for r in rows)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_opinfo_fast_subset_has_no_wrong_number_or_crash(chunk):
    report = opinfo.sweep(samples=1, dims="first", infos=_chunk(chunk))
    assert report.rows, "no OpInfo case ran"
    bugs = report.bugs()
    assert not bugs, f"{len(bugs)} cases wrong or crashing:\n{_bug_text(bugs)}"


def test_opinfo_random_ops_are_exact_or_refused():
    """OpInfo runs its random ops seeded inside the call (torch.manual_seed under freeze_rng_state):
    refused with a TraceError (trace/untouched.py), never a wrong number; plain draws and the
    replicate fallback's draw one device's numbers (rules/random.py)."""
    names = {"bernoulli", "normal", "uniform", "nn.functional.dropout", "rand_like", "randn_like", "randint_like",
             "cauchy", "exponential", "geometric", "log_normal", "multinomial", "nn.functional.rrelu",
             "nn.functional.feature_alpha_dropout", "nn.functional.multi_head_attention_forward"}
    report = opinfo.sweep(samples=1, dims="first", infos=[i for i in opinfo.op_infos() if i.name in names])
    assert report.rows and any(r.random for r in report.rows)
    bugs = report.bugs()
    assert not bugs, _bug_text(bugs)
    seeded = [r for r in report.rows if r.final.kind == "refused"]
    assert seeded and all("inside the traced step" in r.final.detail for r in seeded), _bug_text(seeded)


@pytest.mark.slow
def test_opinfo_full_sweep_has_no_wrong_number_or_crash():
    report = opinfo.sweep(samples=2, dims="all")
    bugs = report.bugs()
    assert not bugs, f"{len(bugs)} cases wrong or crashing:\n{_bug_text(bugs)}"


# -- the command and DTensor's count ---------------------------------------------------------------
def test_cli_opinfo_writes_rows(tmp_path, capsys):
    from shardwise.cli import main

    out = tmp_path / "rows.json"
    assert main(["verify-rules", "--opinfo", "--op", "sgn", "--samples", "1", "--no-dtensor", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"sgn"} and {r["dim"] for r in rows} == {0, 1}
    assert all(r["plain"]["kind"] == "exact" for r in rows), rows
    assert "exact 2" in capsys.readouterr().out


def test_cli_opinfo_options_need_opinfo():
    from shardwise.cli import main

    assert main(["verify-rules", "--samples", "3"]) == 1


def test_dtensor_count_runs_in_a_subprocess():
    """The same cases through DTensor on a fake 2-rank group, in another process: this one keeps
    no default group."""
    import torch.distributed as dist

    from shardwise.tools.verify.opinfo_dtensor import dtensor_counts

    rows = dtensor_counts(1, "first", "sgn")
    assert [(r["op"], r["dim"]) for r in rows] == [("sgn", 0)]
    assert rows[0]["kind"] in ("ok", "no_strategy", "error")
    assert not (dist.is_available() and dist.is_initialized())
