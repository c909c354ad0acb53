"""torch's fused CUDA attention kernels (flash, memory-efficient, cuDNN) for fused.py's blocks.

``choose`` picks, for one kernel call, the kernel ``F.scaled_dot_product_attention`` would pick
for the same dtype, shapes, mask and causal flag: the backends in torch's priority order
(``torch._C._get_sdp_priority_order()``: flash, memory-efficient, math, cuDNN unless changed,
e.g. by ``torch.nn.attention.sdpa_kernel(..., set_priority=True)``), each if enabled
(``torch.backends.cuda.*_sdp_enabled()``, which ``sdpa_kernel`` sets) and if its constraints hold.
The constraints are torch's (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), restated
here from the tensors' metadata and a ``Device`` (compute capability, cuDNN version), so the
choice can be worked out, and tested, without a GPU; on a GPU ``gpu_check`` compares it with
torch's own ``can_use_*_attention``. One rule is stricter than torch's: causal cuDNN calls must
be square (the top-left alignment of a non-square causal cuDNN call is not checked here).
Dropout is never used (shardwise's attention has none).

Each kernel returns the row log-sum-exp (natural log, float32, [B, H, L]; memory-efficient pads
it to a multiple of 32 rows and cuDNN adds a trailing 1: both are cut back), which ring and
Ulysses attention merge blocks with, and the backward kernels take the FINAL out and lse
(fused.py's convention). Head dims are padded with zero columns to the kernel's alignment where
fused.py widens them (its extra grad_lse column); zero columns change no score and no output.
What no fused kernel takes runs ``math_forward`` / ``math_backward`` (the same conventions,
scores materialised).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .softmax import compute_dtype

ATEN = torch.ops.aten
NEG_INF = float("-inf")
KERNEL_OPS = {
    "flash": (ATEN._scaled_dot_product_flash_attention.default, ATEN._scaled_dot_product_flash_attention_backward.default),
    "efficient": (ATEN._scaled_dot_product_efficient_attention.default,
                  ATEN._scaled_dot_product_efficient_attention_backward.default),
    "cudnn": (ATEN._scaled_dot_product_cudnn_attention.default, ATEN._scaled_dot_product_cudnn_attention_backward.default),
}
_BACKEND_NAMES = {1: "flash", 2: "efficient", 0: "math", 3: "cudnn"}  # torch.nn.attention.SDPBackend values
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Device:
    """What the kernel choice reads of a GPU: its compute capability and the cuDNN version
    (torch.backends.cudnn.version(), e.g. 91500; None without cuDNN)."""

    capability: tuple = (9, 0)
    cudnn_version: int | None = 91500
    deterministic: bool = False  # torch.are_deterministic_algorithms_enabled() (cuDNN SDPA is not)

    @classmethod
    def of(cls, device: torch.device) -> "Device":
        return cls(*_hardware(device.index if device.index is not None else torch.cuda.current_device()),
                   torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled())

    def sm(self, lo: tuple, hi: tuple) -> bool:
        return lo <= tuple(self.capability) <= hi


@functools.lru_cache(maxsize=None)
def _hardware(index: int) -> tuple:
    """(compute capability, cuDNN version) of a GPU: fixed for the process."""
    return tuple(torch.cuda.get_device_capability(index)), torch.backends.cudnn.version()


@dataclass(frozen=True)
class Choice:
    """The kernel of one call ("flash", "efficient", "cudnn" or "math") and why each kernel tried
    before it was passed over ({kernel: reason})."""

    kernel: str
    passed_over: tuple = ()
    note: str = ""  # where torch's own choice on the device overrode the restated rules

    @property
    def op(self):
        """The aten forward op called (None for the math path)."""
        return KERNEL_OPS[self.kernel][0] if self.kernel in KERNEL_OPS else None

    def describe(self) -> str:
        why = "; ".join(f"not {k}: {r}" for k, r in self.passed_over)
        head = f"{self.kernel} ({self.op})" if self.op is not None else "math (scores materialised)"
        return head + (f" [{why}]" if why else "") + (f" ({self.note})" if self.note else "")


def enabled_backends() -> dict:
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def priority() -> list:
    return [_BACKEND_NAMES[i] for i in torch._C._get_sdp_priority_order() if i in _BACKEND_NAMES]


# -- constraints (torch's, per kernel: a reason string when it does not apply) ---------------------

def _common(q, k, v, mask) -> str | None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-d"
    if 0 in (q.shape[-2], k.shape[-2], q.shape[0], q.shape[1]):
        return "empty sequence, batch or heads"
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        return "batch and heads of q, k, v differ"
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return "q, k, v dtypes differ"
    return None


def _stride1(t, ignore_singleton: bool) -> bool:
    return t.stride(-1) == 1 or (ignore_singleton and t.shape[-1] == 1)


def _flash(q, k, v, mask, causal: bool, dev: Device, grad: bool) -> str | None:
    d = q.shape[-1]
    if mask is not None:
        return "takes no attn_mask"
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return f"head dims must be equal and <= 256 (q {d}, k {k.shape[-1]}, v {v.shape[-1]})"
    if not dev.sm((8, 0), (12, 1)):
        return f"needs sm80..sm121, got sm{dev.capability[0]}{dev.capability[1]}"
    if grad and (dev.sm((8, 6), (8, 9)) or dev.sm((12, 0), (12, 1))) and not (d <= 192 or d > 224):
        return f"no backward for head dim {d} on sm{dev.capability[0]}{dev.capability[1]}"
    if causal and q.shape[-2] != k.shape[-2]:
        return "causal needs seqlen_q == seqlen_k"
    if q.dtype not in HALF:
        return f"dtype {q.dtype} (float16/bfloat16 only)"
    if not all(_stride1(t, True) for t in (q, k, v)):
        return "last dim not contiguous"
    return None


def _gemm_alignment(dtype, dev: Device) -> int:
    half = dtype in HALF
    tensor_cores = dev.capability[0] >= 8 or (dev.capability[0] >= 7 and half)
    align = 4 if dev.capability[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _efficient(q, k, v, mask, causal: bool, dev: Device, grad: bool) -> str | None:
    if not dev.sm((5, 0), (12, 1)):
        return f"needs sm50..sm121, got sm{dev.capability[0]}{dev.capability[1]}"
    align = _gemm_alignment(q.dtype, dev)
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align or min(q.shape[-1], v.shape[-1]) <= 0:
        return f"head dims must be multiples of {align} (q {q.shape[-1]}, v {v.shape[-1]})"
    if dev.capability[0] >= 8 and any(t.storage_offset() * t.element_size() % (align * t.element_size())
                                      for t in (q, k, v) if t.numel()):
        return "storage offsets not aligned"
    if not all(_stride1(t, False) for t in (q, k, v)):
        return "last dim not contiguous"
    allowed = (torch.float16, torch.float32, torch.bfloat16) if dev.capability[0] >= 8 else (torch.float16, torch.float32)
    if q.dtype not in allowed:
        return f"dtype {q.dtype} not in {[str(t) for t in allowed]}"
    return None


def _cudnn_layout_ok(t) -> bool:
    """cuDNN's [batch, seq, heads, dim] memory layout (a transposed view of one), or packed QKV."""
    b, h, s, d = t.shape
    if t.stride(3) != 1 or t.stride(1) != d:
        return False
    return (t.stride(2), t.stride(0)) in ((h * d, s * h * d), (3 * h * d, s * 3 * h * d))


def _cudnn(q, k, v, mask, causal: bool, dev: Device, grad: bool) -> str | None:
    ver = dev.cudnn_version
    if ver is None or ver < 90000:
        return f"needs cuDNN >= 9.0 (got {ver})"
    if dev.deterministic:
        return "not deterministic (torch.use_deterministic_algorithms is on)"
    if q.dtype not in HALF:
        return f"dtype {q.dtype} (float16/bfloat16 only)"
    if not dev.sm((8, 0), (12, 1)):
        return f"needs sm80..sm121, got sm{dev.capability[0]}{dev.capability[1]}"
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return "batch or heads > 65535"
    dqk, dv = q.shape[-1], v.shape[-1]
    sm90 = (dev.capability[0] == 9 and dev.capability[1] == 0) or dev.capability[0] == 10
    limit = 256 if sm90 and ver > 92200 else (192 if sm90 and ver >= 91100 and (dqk, dv) == (192, 128) else 128)
    if dqk > limit or dv > limit:
        return f"head dim > {limit}"
    if dqk % 8 or dv % 8:
        return "head dims not multiples of 8"
    if k.shape[-2] == 1:
        return "key sequence length 1"
    if grad and limit == 256 and not (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256))):
        return f"no backward for head dims ({dqk}, {dv})"
    if not all(_cudnn_layout_ok(t) for t in (q, k, v)):
        return "q, k, v not in [batch, seq, heads, dim] memory layout"
    if causal and q.shape[-2] != k.shape[-2]:
        return "causal needs seqlen_q == seqlen_k (shardwise's rule)"
    return None


_CHECKS = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn}


def choose(q, k, v, mask, causal: bool, device: Device | None = None, grad: bool = True,
           enabled: dict | None = None, order: list | None = None) -> Choice:
    """The kernel for one 4-d call (q, k, v may be meta or fake tensors: only metadata is read).
    ``device``: the GPU (default: q's); ``grad``: a backward will follow; ``enabled`` / ``order``:
    torch's SDPA backend flags and priority (default: the current ones)."""
    on_device = device is None and enabled is None and order is None and _real_cuda(q, k, v, mask)
    device = device or Device.of(q.device)
    enabled = enabled_backends() if enabled is None else enabled
    order = priority() if order is None else order
    if not on_device:
        return _restated(q, k, v, mask, causal, device, grad, enabled, order)
    # an eager step asks up to six times (applies, forward, backward) for the same metadata: the
    # choice reads only metadata, flags and the device, so it is kept per such key
    key = (*(None if t is None else (t.shape, t.stride(), t.dtype, t.storage_offset() % 64, t.device)
             for t in (q, k, v, mask)), causal, grad, tuple(enabled.items()), tuple(order), device)
    hit = _ON_DEVICE.get(key)
    if hit is None:
        if len(_ON_DEVICE) >= 4096:
            _ON_DEVICE.clear()
        hit = _ON_DEVICE[key] = _on_device(q, k, v, mask, causal, device, grad, enabled, order)
    return hit


_ON_DEVICE: dict = {}


def _on_device(q, k, v, mask, causal, device, grad, enabled, order) -> Choice:
    """A call on the GPU takes the kernel torch's SDPA would take: the restated rules describe plans
    (meta and fake tensors) and can lag a torch release (gpu_check's "kernels" row compares them)."""
    restated = _restated(q, k, v, mask, causal, device, grad, enabled, order)
    picked = _torch_pick(q, k, v, mask, causal, grad)
    if picked == restated.kernel or (picked == "cudnn" and causal and q.shape[-2] != k.shape[-2]):
        return restated  # the second: shardwise's own rule (top-left causal alignment unchecked)
    before = tuple(p for p in restated.passed_over if order.index(p[0]) < order.index(picked)) if picked in order else ()
    return Choice(picked, before, f"torch {torch.__version__}'s choice on this device; the restated rules "
                                 f"pick {restated.kernel}")


def _restated(q, k, v, mask, causal, device, grad, enabled, order) -> Choice:
    common = _common(q, k, v, mask)
    passed = []
    for name in order:
        if name == "math":
            if enabled.get("math", True):
                return Choice("math", tuple(passed))
            continue
        if not enabled.get(name, False):
            passed.append((name, "disabled"))
            continue
        why = common or _CHECKS[name](q, k, v, mask, causal, device, grad)
        if why is None:
            return Choice(name, tuple(passed))
        passed.append((name, why))
    return Choice("math", tuple(passed))


def _real_cuda(*ts) -> bool:
    """Plain tensors on a CUDA device (not meta, fake or functional tensors of a trace)."""
    return all(t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda) for t in ts)


def _torch_pick(q, k, v, mask, causal: bool, grad: bool) -> str:
    """The kernel torch's SDPA takes for this call (``torch._fused_sdp_choice``): its checks read
    ``requires_grad`` (a backward must exist), so ``grad`` is given by detached aliases."""
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    return _BACKEND_NAMES.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal)), "math")


# -- calling the kernels ---------------------------------------------------------------------------

def _pad_dim(t, width: int):
    """``t`` with zero columns up to ``width`` in its head dim, laid out [batch, seq, heads, dim]
    in memory (the layout cuDNN asks for; flash and memory-efficient take it too)."""
    if t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t.transpose(1, 2), (0, width - t.shape[-1])).transpose(1, 2)


def _aligned(d: int, align: int) -> int:
    return -(-d // align) * align


def _bias(mask, q, k, align: int = 16):
    """The additive mask as the memory-efficient / cuDNN kernels read it: 4-d [B, H, L, S], its last
    dim's storage padded to a multiple of ``align`` elements (aten's SDPA does the same)."""
    if mask is None:
        return None
    full = mask.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
    s = full.shape[-1]
    if s % align == 0:
        return full
    return torch.nn.functional.pad(full, (0, _aligned(s, align) - s))[..., :s]


def _head_width(q, v) -> int:
    """The head dim a kernel is called with: q's and v's, rounded up to a multiple of 8."""
    return _aligned(max(q.shape[-1], v.shape[-1]), 8)


def _unread_seeds(kernel: str, device) -> tuple:
    """The (philox seed, offset) pair each forward returns when it draws no dropout: flash an
    unsigned [2] state and an unused scalar, memory-efficient and cuDNN two int64 scalars."""
    if kernel == "flash":
        return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)
    return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


def _lse(lse, rows: int):
    return lse.reshape(*lse.shape[:2], -1)[..., :rows].float()



def kernel_forward(q, k, v, mask, causal: bool, scale: float, choice: Choice | None = None):
    """(out, lse) of one 4-d call through the chosen kernel (fused.KERNELS["cuda"][0])."""
    choice = choice or choose(q, k, v, mask, causal)
    if choice.kernel == "math":
        return math_forward(q, k, v, mask, causal, scale)
    dv, width = v.shape[-1], _head_width(q, v)
    qp, kp, vp = (_pad_dim(t, width) for t in (q, k, v))
    fwd = KERNEL_OPS[choice.kernel][0]
    if choice.kernel == "flash":
        out, lse = fwd(qp, kp, vp, 0.0, causal, False, scale=scale)[:2]
    elif choice.kernel == "efficient":
        out, lse = fwd(qp, kp, vp, _bias(mask, q, k), True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = fwd(qp, kp, vp, _bias(mask, q, k), True, 0.0, causal, False, scale=scale)[:2]
    return out[..., :dv], _lse(lse, q.shape[-2])


def kernel_backward(grad_out, q, k, v, out, lse, mask, causal: bool, scale: float, choice: Choice | None = None):
    """(dq, dk, dv) of one 4-d call from the final out and lse (fused.KERNELS["cuda"][1]).

    The kernel is chosen on the head dims padded to 8: fused.py's extra grad_lse column widens
    them by one, and the padded call computes the same gradients (zero columns)."""
    L, S = q.shape[-2], k.shape[-2]
    dqk, dv, width = q.shape[-1], v.shape[-1], _head_width(q, v)
    go, qp, kp, vp, op = (_pad_dim(t, width) for t in (grad_out, q, k, v, out))
    choice = choice or choose(qp, kp, vp, mask, causal)
    if choice.kernel == "math":
        return math_backward(grad_out, q, k, v, out, lse, mask, causal, scale)
    lse = lse.float().contiguous()
    # what each forward hands its backward without dropout: no cumulative sequence lengths (None: a
    # defined tensor there, even an empty one, selects the variable-length kernels) and unread seeds
    seeds = _unread_seeds(choice.kernel, q.device)
    bwd = KERNEL_OPS[choice.kernel][1]
    if choice.kernel == "flash":
        dq, dk, dvv = bwd(go, qp, kp, vp, op, lse, None, None, L, S, 0.0, causal, *seeds, scale=scale)
    elif choice.kernel == "efficient":
        # the kernel's lse as its forward returns it: rows padded to a multiple of 32, contiguous
        lse32 = torch.nn.functional.pad(lse, (0, _aligned(L, 32) - L))
        dq, dk, dvv, _ = bwd(go, qp, kp, vp, _bias(mask, q, k), op, lse32, *seeds, 0.0,
                             [True, True, True, False], causal, scale=scale)
    else:
        dq, dk, dvv = bwd(go, qp, kp, vp, op, lse.unsqueeze(-1), *seeds, _bias(mask, q, k), None, None, L, S,
                          0.0, causal, scale=scale)
    return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]


# -- the math path of one call (what no fused kernel takes) -------------------------------------

def _scores(q, k, mask, causal: bool, scale: float):
    ct = compute_dtype(q.dtype)
    s = (q.to(ct) @ k.to(ct).transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask.to(ct)
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1), NEG_INF)
    return s


def math_forward(q, k, v, mask, causal: bool, scale: float):
    """(out in q's dtype, lse float32; rows that see no key: out 0, lse -inf)."""
    s = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return (p @ v.to(s.dtype)).to(q.dtype), lse


def math_backward(grad_out, q, k, v, out, lse, mask, causal: bool, scale: float):
    s = _scores(q, k, mask, causal, scale)
    ct = s.dtype
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse.to(ct)).unsqueeze(-1))
    go = grad_out.to(ct)
    dv = p.transpose(-2, -1) @ go
    dp = go @ v.to(ct).transpose(-2, -1)
    delta = (go * out.to(ct)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return (ds @ k.to(ct)).to(q.dtype), (ds.transpose(-2, -1) @ q.to(ct)).to(k.dtype), dv.to(v.dtype)


# -- whole calls -------------------------------------------------------------------------------------

def applies(q, k, v, mask, settings) -> bool:
    """fused.applies on a CUDA device (q, k, v, mask as fused.py's 4-d views): some fused kernel
    takes the whole call."""
    if q.numel() == 0 or k.numel() == 0 or (settings is not None and settings.is_causal
                                             and settings.resolve_scale(q.shape[-1]) <= 0):
        return False
    causal = bool(settings is not None and settings.is_causal and settings.q_offset == settings.k_offset)
    return choose(q, k, v, mask, causal).kernel != "math"
