"""The CUDA attention path's kernel choice (ops/attention/cuda.py), checked without a GPU: the
choice for each (dtype, mask, causal, head dim) case on a mocked device, the aten op each
choice calls and the log-sum-exp it hands back (on meta tensors, whose shapes the kernels'
meta functions give), and the math path of one call against aten's SDPA on CPU.

    python -m pytest tests/attention/test_cuda_select.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.ops.attention import cuda
from shardwise.ops.attention.paths import describe_call
from shardwise.ops.attention.settings import AttentionSettings

H100, A100, RTX3090, V100, T4 = (cuda.Device((9, 0), 91500), cuda.Device((8, 0), 90100), cuda.Device((8, 6), 90100),
                                 cuda.Device((7, 0), 90100), cuda.Device((7, 5), None))
ALL = {"flash": True, "efficient": True, "cudnn": True, "math": True}
DEFAULT_ORDER = ["flash", "efficient", "math", "cudnn"]
CUDNN_FIRST = ["cudnn", "flash", "efficient", "math"]
H100_CUDNN923 = cuda.Device((9, 0), 92300)


def _qkv(dtype, d=64, L=128, S=128, b=2, h=4, device="meta", dv=None, bshd=True):
    """q, k, v as a model's projections give them: [b, seq, h, d] in memory, viewed [b, h, seq, d]."""
    def make(n, dd):
        t = torch.empty(b, n, h, dd, dtype=dtype, device=device)
        return t.transpose(1, 2) if bshd else t.transpose(1, 2).contiguous()
    return make(L, d), make(S, d), make(S, dv or d)


def _mask(dtype, L=128, S=128, device="meta"):
    return torch.empty(1, 1, L, S, dtype=dtype, device=device)


CASES = [  # (device, dtype, mask, causal, head dim, order, expected kernel)
    (H100, torch.float16, False, False, 64, DEFAULT_ORDER, "flash"),
    (H100, torch.bfloat16, False, True, 128, DEFAULT_ORDER, "flash"),
    (H100, torch.bfloat16, True, False, 64, DEFAULT_ORDER, "efficient"),  # flash takes no mask
    (H100, torch.float16, True, True, 64, DEFAULT_ORDER, "efficient"),
    (H100, torch.float32, False, False, 64, DEFAULT_ORDER, "efficient"),  # flash is half precision only
    (H100, torch.float32, True, True, 64, DEFAULT_ORDER, "efficient"),
    (H100, torch.float64, False, False, 64, DEFAULT_ORDER, "math"),
    (H100, torch.float16, False, False, 512, DEFAULT_ORDER, "efficient"),  # flash: head dim <= 256
    (H100, torch.float16, False, False, 12, DEFAULT_ORDER, "flash"),  # flash pads the head dim itself
    (H100, torch.float32, False, False, 6, DEFAULT_ORDER, "math"),  # efficient: multiple of 4 (fp32)
    (H100, torch.float16, False, False, 12, ["efficient", "math"], "math"),  # efficient: multiple of 8 (half)
    (H100, torch.float16, False, False, 64, CUDNN_FIRST, "cudnn"),
    (H100, torch.bfloat16, True, True, 128, CUDNN_FIRST, "cudnn"),
    (H100_CUDNN923, torch.bfloat16, False, False, 256, CUDNN_FIRST, "cudnn"),  # sm90, cuDNN > 9.22: d 256
    (H100, torch.bfloat16, False, False, 256, CUDNN_FIRST, "flash"),
    (A100, torch.bfloat16, False, False, 256, CUDNN_FIRST, "flash"),  # cuDNN: d <= 128 elsewhere
    (H100, torch.float32, False, False, 64, CUDNN_FIRST, "efficient"),  # cuDNN: half precision only
    (A100, torch.bfloat16, False, True, 64, DEFAULT_ORDER, "flash"),
    (RTX3090, torch.float16, False, False, 208, DEFAULT_ORDER, "efficient"),  # no flash backward, d in (192, 224]
    (RTX3090, torch.float16, False, False, 192, DEFAULT_ORDER, "flash"),
    (V100, torch.float16, False, False, 64, DEFAULT_ORDER, "efficient"),  # flash needs sm80
    (V100, torch.bfloat16, False, False, 64, DEFAULT_ORDER, "math"),  # efficient: no bf16 before sm80
    (T4, torch.float16, False, False, 64, CUDNN_FIRST, "efficient"),  # no cuDNN
]


@pytest.mark.parametrize("device,dtype,mask,causal,d,order,want", CASES,
                         ids=[f"{c[0].capability}-{str(c[1])[6:]}-{'mask' if c[2] else 'nomask'}-"
                              f"{'causal' if c[3] else 'full'}-d{c[4]}-{c[5][0]}" for c in CASES])
def test_the_kernel_torch_would_pick(device, dtype, mask, causal, d, order, want):
    q, k, v = _qkv(dtype, d)
    got = cuda.choose(q, k, v, _mask(dtype) if mask else None, causal, device=device, enabled=ALL, order=order)
    assert got.kernel == want, got.describe()


def test_non_square_causal_leaves_flash_and_cudnn():
    q, k, v = _qkv(torch.float16, 64, L=64, S=128)
    assert cuda.choose(q, k, v, None, True, device=H100, enabled=ALL, order=DEFAULT_ORDER).kernel == "efficient"
    assert cuda.choose(q, k, v, None, True, device=H100, enabled=ALL, order=CUDNN_FIRST).kernel == "efficient"
    assert cuda.choose(q, k, v, None, False, device=H100, enabled=ALL, order=CUDNN_FIRST).kernel == "cudnn"


def test_disabled_backends_and_layouts_are_honoured():
    q, k, v = _qkv(torch.float16, 64)
    off = dict(ALL, flash=False)
    got = cuda.choose(q, k, v, None, False, device=H100, enabled=off, order=DEFAULT_ORDER)
    assert got.kernel == "efficient" and ("flash", "disabled") in got.passed_over
    qc, kc, vc = _qkv(torch.float16, 64, bshd=False)  # [b, h, seq, d] in memory: not cuDNN's layout
    got = cuda.choose(qc, kc, vc, None, False, device=H100, enabled=ALL, order=CUDNN_FIRST)
    assert got.kernel == "flash" and "layout" in dict(got.passed_over)["cudnn"]
    det = cuda.Device((9, 0), 91500, deterministic=True)
    assert cuda.choose(q, k, v, None, False, device=det, enabled=ALL, order=CUDNN_FIRST).kernel == "flash"


def test_the_current_flags_are_read():
    q, k, v = _qkv(torch.float16, 64)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        assert cuda.choose(q, k, v, None, False, device=H100).kernel == "efficient"
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert cuda.choose(q, k, v, None, False, device=H100).kernel == "math"


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.args = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        self.args[func] = dict(zip((a.name for a in func._schema.arguments), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel,dtype,mask,causal,d", [
    ("flash", torch.float16, False, True, 64), ("flash", torch.bfloat16, False, False, 12),
    ("efficient", torch.float32, True, False, 64), ("efficient", torch.float16, False, True, 40),
    ("cudnn", torch.bfloat16, True, False, 64), ("cudnn", torch.float16, False, True, 128)])
def test_each_choice_calls_its_aten_op_and_returns_lse(kernel, dtype, mask, causal, d):
    """Forward and backward (as fused.py calls them, also with its extra grad_lse column) on meta
    tensors: the chosen aten ops run, lse comes back float32 [B, H, L], grads in q, k, v's shapes."""
    L = 100
    q, k, v = _qkv(dtype, d, L=L, S=L)
    m = _mask(dtype, L, L) if mask else None
    choice = cuda.choose(q, k, v, m, causal, device=H100, enabled=ALL,
                         order=[kernel, "flash", "efficient", "math"])
    assert choice.kernel == kernel
    fwd_op, bwd_op = cuda.KERNEL_OPS[kernel]
    rec = _Calls()
    with rec:
        out, lse = cuda.kernel_forward(q, k, v, m, causal, 0.125, choice=choice)
    assert fwd_op in rec.ops
    assert out.shape == v.shape and out.dtype == dtype
    assert lse.shape == (2, 4, L) and lse.dtype == torch.float32
    for extra in (0, 1):  # fused.py widens the head dim by one column to fold in grad_lse (torch.cat: contiguous)
        qw, kw, vw, ow = (t if not extra else torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=dtype, device="meta")
                          for t in (q, k, v, out))
        width = cuda._head_width(qw, vw)
        back = cuda.choose(*(cuda._pad_dim(t, width) for t in (qw, kw, vw)), m, causal, device=H100, enabled=ALL,
                           order=[kernel, "flash", "efficient"])
        assert back.kernel == kernel or (extra and width > 128), back.describe()  # cuDNN: d <= 128 here
        rec = _Calls()
        with rec:
            dq, dk, dv = cuda.kernel_backward(ow, qw, kw, vw, ow, lse, m, causal, 0.125, choice=back)
        assert cuda.KERNEL_OPS[back.kernel][1] in rec.ops
        called = rec.args[cuda.KERNEL_OPS[back.kernel][1]]
        # as the kernel's own forward hands them over (the GPU refuses anything else): no cumulative
        # sequence lengths (a defined one selects the variable-length kernel), efficient's lse rows
        # padded to 32 and contiguous, cuDNN's with a trailing 1
        assert called.get("cum_seq_q", None) is None and called.get("cum_seq_k", None) is None
        want_lse = {"flash": (2, 4, L), "efficient": (2, 4, -(-L // 32) * 32), "cudnn": (2, 4, L, 1)}[back.kernel]
        assert tuple(called["logsumexp"].shape) == want_lse and called["logsumexp"].is_contiguous()
        assert dq.shape == qw.shape and dk.shape == kw.shape and dv.shape == vw.shape


@pytest.mark.parametrize("causal,mask", [(False, False), (True, False), (False, True), (True, True)])
def test_math_path_of_one_call_equals_aten_sdpa(causal, mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    m = torch.randn(1, 1, 7, 7, generator=g, dtype=torch.float64) if mask else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=0.3)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v), go)
    with torch.no_grad():
        out, lse = cuda.math_forward(q, k, v, m, causal, 0.3)
        got = cuda.math_backward(go, q, k, v, out, lse, m, causal, 0.3)
    torch.testing.assert_close(out, ref.detach())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_plan_wording_names_the_path():
    q, k, v = (torch.empty(2, 4, 128, 64, dtype=torch.float16, device="meta") for _ in range(3))
    s = AttentionSettings(is_causal=True)
    assert describe_call(q, k, v, None, s, "cuda", H100).startswith("flash (aten._scaled_dot_product_flash")
    assert "efficient" in describe_call(q, k, v, torch.empty(1, 1, 128, 128, dtype=torch.float16, device="meta"),
                                             s, "cuda", H100)
    assert describe_call(q.double(), k.double(), v.double(), None, s, "cuda", H100).startswith("math")
    assert describe_call(q.float(), k.float(), v.float(), None, s, "cpu").startswith("fused (cpu")


def test_a_call_on_the_device_takes_torchs_own_choice(monkeypatch):
    """On real CUDA tensors torch's ``_fused_sdp_choice`` decides (the restated rules describe plans
    and can lag a torch release: torch 2.11 on an H200 takes cuDNN at head dim 256 where torch
    2.13's rules, restated, allow it only from cuDNN 9.23); shardwise's own rule (no non-square
    causal cuDNN) still holds, and plans (meta tensors, or a device given) keep the restated rules."""
    picks = []
    monkeypatch.setattr(cuda, "_ON_DEVICE", {})
    monkeypatch.setattr(cuda, "_real_cuda", lambda *ts: True)
    monkeypatch.setattr(cuda.Device, "of", classmethod(lambda cls, device: H100))
    monkeypatch.setattr(cuda, "_torch_pick", lambda q, k, v, mask, causal, grad: picks.append(grad) or "cudnn")
    order = ["cudnn", "flash", "efficient", "math"]
    monkeypatch.setattr(cuda, "priority", lambda: order)
    monkeypatch.setattr(cuda, "enabled_backends", lambda: ALL)
    q, k, v = _qkv(torch.bfloat16, 256)
    assert cuda.choose(q, k, v, None, False, device=H100).kernel == "flash"  # restated: cuDNN d <= 128 here
    got = cuda.choose(q, k, v, None, False)
    assert got.kernel == "cudnn" and "restated rules pick flash" in got.describe() and picks == [True]
    assert cuda.choose(q, k, v, None, False) is got and picks == [True]  # kept per metadata: torch asked once
    assert cuda.choose(q, k, v, None, False, grad=False) is not got and picks == [True, False]
    q2, k2, v2 = _qkv(torch.bfloat16, 64, L=64, S=128)
    restated = cuda.choose(q2, k2, v2, None, True, device=H100)
    assert restated.kernel == "efficient"  # flash: square causal only
    assert cuda.choose(q2, k2, v2, None, True) == restated  # torch's cuDNN is refused: non-square causal
