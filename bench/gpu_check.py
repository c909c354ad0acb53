"""The GPU check: shardwise on one CUDA device against that device unsharded, in one table.

    python bench/gpu_check.py                      # one CUDA device, under 5 minutes
    python bench/gpu_check.py --cpu                # the same checks on CPU (gloo); CUDA-only rows say why skipped
    python bench/gpu_check.py --cpu --quick        # one case of each check (tests/test_gpu_check.py, CI)
    torchrun --nproc-per-node 8 bench/gpu_check.py # one node of 8 GPUs: NCCL, 8 processes (docs/gpu.md)

Rows (each compared with one device, fp32 at rtol 1e-4 / atol 1e-5):

- ``threads``: the threads backend with ``--ranks`` simulated ranks (2 by default; 2-4) on the one
  device, HF GPT-2 and Llama tiny configs, data / Megatron / Ulysses / ring / FSDP-style
  placements: loss and every gradient of one step.
- ``bf16``: the same under ``sw.MixedPrecision(bf16, fp32)`` against one device running the policy
  (within 16 bf16 ulps of each gradient's scale: tests/precision/reference.py says why).
- ``attention``: ``sw.attention`` forward+backward against ``F.scaled_dot_product_attention`` (time,
  peak memory, the path each takes: on CUDA the fused kernel ops/attention/cuda.py picks must be
  taken where torch's SDPA takes one).
- ``memory``: the plan's memory estimate (lower/memory.py) against the allocator's measured peak
  (``torch.cuda.max_memory_allocated``; on CPU the profiler's memory events) of rank 0's program
  run alone, within 15%.
- ``compile``: ``compile=True`` on a single-rank group (NCCL; gloo with ``--cpu --compile``).
- ``group``: a single-rank NCCL (gloo) process group running the torch backend.

Under torchrun (WORLD_SIZE > 1) every process takes its GPU (LOCAL_RANK) and the rows are the torch
backend's over all processes (data / Megatron / FSDP-style, GPT-2 and Llama, and compile=True);
rank 0 prints the table. Exits 1 on any mismatch or error; a skipped row states its reason.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardwise as sw  # noqa: E402
from shardwise import Shard as S  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
BF16_ULPS = 16
MEMORY_TOLERANCE = 0.15
LAYOUTS = ("data", "megatron", "ulysses", "ring", "fsdp")
TINY = dict(layers=2, width=32, heads=4, vocab=64, batch=4, seq=8)
# the memory rows on CUDA: the caching allocator rounds each block up to 512 B, so tiny tensors
# would measure the rounding; this size keeps it under 1% of the peak
SMALL = dict(layers=2, width=256, heads=4, vocab=1024, batch=8, seq=128)


# -- models -----------------------------------------------------------------------------------
def _positional(fn, **given) -> tuple:
    params = list(inspect.signature(fn).parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in given)
    return tuple(given[p.name] if p.name in given else p.default for p in params[:last + 1])


def build(name: str, device, size: dict = TINY):
    """(HF model on ``device``, its positional inputs): ``labels`` given, so ``.loss`` is the loss."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "gpt2":
            cfg = GPT2Config(n_layer=size["layers"], n_embd=size["width"], n_head=size["heads"],
                             vocab_size=size["vocab"], n_positions=max(32, size["seq"]), resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
                             attn_implementation="sdpa")
            model = GPT2LMHeadModel(cfg)
        else:
            cfg = LlamaConfig(num_hidden_layers=size["layers"], hidden_size=size["width"],
                              num_attention_heads=size["heads"], num_key_value_heads=size.get("kv_heads", size["heads"] // 2),
                              intermediate_size=2 * size["width"], vocab_size=size["vocab"],
                              max_position_embeddings=max(32, size["seq"]), use_cache=False, bos_token_id=0,
                              eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
            model = LlamaForCausalLM(cfg)
        ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]))
    model = model.to(device).train()
    model.loss_type = "ForCausalLM"
    ids = ids.to(device)
    return model, _positional(model.forward, input_ids=ids, labels=ids.clone())


def layout(name: str, model, ranks: int) -> tuple:
    """(mesh, parallelize keywords) of a layout by name."""
    data, seq = {"input_ids": [S(0)], "labels": [S(0)]}, {"input_ids": [S(1)], "labels": [S(1)]}
    return {
        "data": lambda: (sw.Mesh((ranks,), ("dp",)), dict(input_placements=data)),
        "fsdp": lambda: (sw.Mesh((ranks,), ("dp",)), dict(input_placements=data,
                                                          param_placements=sw.recipes.fsdp(model, "dp"))),
        "megatron": lambda: (sw.Mesh((ranks,), ("tp",)), dict(param_placements=sw.recipes.megatron(model, "tp"))),
        "ulysses": lambda: (sw.Mesh((ranks,), ("sp",)), dict(input_placements=seq, attention="ulysses")),
        "ring": lambda: (sw.Mesh((ranks,), ("sp",)), dict(input_placements=seq, attention="ring")),
    }[name]()


# -- comparisons ------------------------------------------------------------------------------
def one_device(model, inputs, policy=None):
    """(loss, {name: gradient}) of one step on one device, under ``policy`` if given (fp32 grads)."""
    from torch.func import functional_call

    dtype = policy.param_dtype if policy is not None else None
    params = {n: (p.detach().to(dtype) if dtype else p.detach()).requires_grad_() for n, p in model.named_parameters()}
    out = functional_call(model, {**params, **dict(model.named_buffers())}, inputs)
    grads = torch.autograd.grad(out.loss, list(params.values()))
    return out.loss.detach().float(), {n: g.float() for n, g in zip(params, grads)}


def compare(loss, grads: dict, want_loss, want: dict, bf16: bool = False) -> str | None:
    """None when equal (fp32 tolerances, or ``BF16_ULPS`` of each value's scale), else what differs."""
    def off(got, ref):
        got, ref = got.float().to(ref.device), ref.float()
        if bf16:
            bound = BF16_ULPS * 2.0 ** -8 * max(ref.abs().max().item(), 1e-30)
            err = (got - ref).abs().max().item()
            return None if err <= bound else f"max error {err:.3g} > {bound:.3g}"
        if torch.allclose(got, ref, rtol=RTOL, atol=ATOL):
            return None
        return f"max error {(got - ref).abs().max().item():.3g}"

    if (why := off(loss, want_loss)) is not None:
        return f"loss: {why}"
    for n, g in want.items():
        if n not in grads or grads[n] is None:
            return f"no gradient for {n}"
        if (why := off(grads[n], g)) is not None:
            return f"grad of {n}: {why}"
    return None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row(check: str, config: str, fn) -> dict:
    """Run ``fn() -> (mismatch or None, figures str)``, timed; an exception is an ERROR row."""
    t = time.perf_counter()
    try:
        why, figures = fn()
        result = "ok" if why is None else "MISMATCH"
    except Exception as e:  # noqa: BLE001 - reported in the table, the exit code says it
        why, figures, result = f"{type(e).__name__}: {e}".splitlines()[0][:160], "", "ERROR"
        if os.environ.get("GPU_CHECK_TRACEBACK"):
            traceback.print_exc()
    return {"check": check, "config": config, "result": result, "figures": figures,
            "note": why or "", "s": time.perf_counter() - t}


def skipped(check: str, config: str, why: str) -> dict:
    return {"check": check, "config": config, "result": "skipped", "figures": "", "note": why, "s": 0.0}


# -- rows -------------------------------------------------------------------------------------
def threads_row(name: str, lay: str, ranks: int, device, policy=None, size: dict = TINY):
    def run():
        model, inputs = build(name, device, size)
        want_loss, want = one_device(model, inputs, policy)
        mesh, kw = layout(lay, model, ranks)
        if policy is not None:
            kw["mixed_precision"] = policy
        pm = sw.parallelize(model, mesh, inputs, **kw)
        loss = pm.step(*inputs)
        why = compare(loss, pm.gradients(), want_loss, want, bf16=policy is not None)
        stats = pm.plan.stats()
        return why, f"loss {float(loss):.4f}; {sum(stats['collectives'].values())} collectives"
    return run


def attention_row(device, dtype, causal: bool, seq: int, runs: int):
    from shardwise.ops.attention import cuda, paths
    from shardwise.ops.attention.benchmark import _step as attn_step
    from shardwise.ops.attention.benchmark import peak_bytes
    from shardwise.ops.attention.settings import AttentionSettings

    def run():
        g = torch.Generator().manual_seed(seq)
        q, k, v, go = (torch.randn(2, 8, seq, 64, generator=g).to(device, dtype) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        fns = {"aten": lambda: attn_step(F.scaled_dot_product_attention, q, k, v, go, causal),
               "shardwise": lambda: attn_step(sw.attention, q, k, v, go, causal)}
        want, got = fns["aten"](), fns["shardwise"]()
        tol = dict(rtol=RTOL, atol=ATOL) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        bad = [n for n, a, b in zip(("out", "dq", "dk", "dv"), got, want) if not torch.allclose(a, b, **tol)]
        del want, got
        times = {n: _median_time(fn, device, runs) for n, fn in fns.items()}
        mem = {n: _peak(fn, device, peak_bytes) for n, fn in fns.items()}
        path = paths.describe_call(q, k, v, None, AttentionSettings(is_causal=causal), device.type,
                                   **({"device": cuda.Device.of(device)} if device.type == "cuda" else {}))
        why = f"differs from SDPA: {', '.join(bad)}" if bad else None
        if why is None and device.type == "cuda" and path.startswith("math"):
            why = f"math path on CUDA (scores materialised): {path}"
        return why, (f"time sw/aten {times['shardwise'] / times['aten']:.2f}x ({times['aten'] * 1e3:.2f} ms aten); "
                     f"peak sw/aten {mem['shardwise'] / max(mem['aten'], 1):.2f}x "
                     f"({mem['aten'] / 2**20:.1f} MiB aten); path: {path}")
    return run


KERNEL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # relative L2 error vs float64


def kernels_row(device):
    """ops/attention/cuda.py's kernel choice against torch's own (``torch._fused_sdp_choice``) for
    each (dtype, mask, causal, head dim, priority) case on this GPU, and each chosen kernel's out,
    lse and gradients (as fused.py calls it) against a float64 reference on the same device. The
    restated rules (what a plan on meta tensors describes) are compared too and their differences
    printed: they are torch 2.13's, and a call on the device takes torch's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from shardwise.ops.attention import cuda

    orders = {"default": None,
              "cudnn first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}

    def case(dtype, masked, causal, d, L, S, g):
        def make(n):  # a model's projections: [b, seq, h, d] in memory, viewed [b, h, seq, d]
            return torch.randn(2, n, 4, d, generator=g, device=device).to(dtype).transpose(1, 2).requires_grad_()
        q, k, v = make(L), make(S), make(S)
        mask = torch.randn(1, 1, L, S, generator=g, device=device).to(dtype) if masked else None
        torch_pick = cuda._BACKEND_NAMES[int(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal))]
        restated = cuda.choose(q, k, v, mask, causal, device=cuda.Device.of(q.device))  # what plans describe
        choice = cuda.choose(q, k, v, mask, causal)  # what a call on the device takes
        scale = d ** -0.5
        with torch.no_grad():
            out, lse = cuda.kernel_forward(q, k, v, mask, causal, scale, choice=choice)
            go = torch.randn(out.shape, generator=g, device=device).to(dtype)
            grads = cuda.kernel_backward(go, q, k, v, out, lse, mask, causal, scale)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        s = ref[0] @ ref[1].transpose(-2, -1) * scale + (mask.double() if masked else 0)
        if causal:
            s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=device).triu(1), float("-inf"))
        want_out = torch.softmax(s, -1) @ ref[2]
        want = (want_out, torch.logsumexp(s, -1), *torch.autograd.grad(want_out, ref, go.double()))
        errs = {n: ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
                for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want)}
        return torch_pick, restated, choice, errs

    def run():
        g = torch.Generator(device=device).manual_seed(0)
        n, disagree, wrong, kinds, lagging = 0, [], [], {}, []
        dtypes, heads = (torch.float16, torch.bfloat16, torch.float32), (12, 40, 64, 128, 256)
        for order_name, order in orders.items():
            ctx = sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext()
            with ctx:
                for dtype, masked, causal, d in itertools.product(dtypes, (False, True), (False, True), heads):
                    for L, S in ((100, 100),) if causal else ((100, 100), (64, 130)):  # causal: square only
                        pick, restated, choice, errs = case(dtype, masked, causal, d, L, S, g)
                        n += 1
                        name = (f"{order_name} {str(dtype)[6:]} {'mask' if masked else 'nomask'} "
                                f"{'causal' if causal else 'full'} d{d} {L}x{S}")
                        kinds[choice.kernel] = kinds.get(choice.kernel, 0) + 1
                        if pick != choice.kernel:
                            disagree.append(f"{name}: torch {pick}, shardwise {choice.describe()}")
                        if pick != restated.kernel:
                            lagging.append(f"{name}: torch {pick}, restated rules {restated.describe()}")
                        bad = {k: e for k, e in errs.items() if not e <= KERNEL_TOL[dtype]}
                        if bad:
                            wrong.append(f"{name} ({choice.kernel}): " + ", ".join(f"{k} {e:.2g}" for k, e in bad.items()))
        for line in disagree + wrong + lagging:
            print(f"kernels: {line}", flush=True)
        why = "; ".join(filter(None, (f"{len(disagree)} choices differ from torch's" if disagree else "",
                                      f"{len(wrong)} kernel results off" if wrong else ""))) or None
        if why:
            why += f" (first: {(disagree + wrong)[0]})"
        # the restated rules (plans' descriptions) lagging this torch release is reported, not failed:
        # calls on the device take torch's own choice
        return why, (f"{n} cases; kernels {kinds}; choice == torch's in {n - len(disagree)}; restated rules == "
                     f"torch {torch.__version__}'s in {n - len(lagging)}" + (f" (e.g. {lagging[0]})" if lagging else ""))
    return run


def _median_time(fn, device, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _peak(fn, device, cpu_peak) -> int:
    """Bytes allocated at once during ``fn()`` beyond what existed before."""
    if device.type != "cuda":
        return cpu_peak(fn)
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    del out
    return torch.cuda.max_memory_allocated(device) - base


def memory_row(lay: str, ranks: int, device, size: dict = TINY):
    """Rank 0's program run alone on ``device`` (collectives allocating as the torch backend's, no
    communication: lower/memory.py's model of them), its arguments' bytes + the peak above them."""
    from shardwise.core.scope import using, using_generator
    from shardwise.lower.memory import _ModelCollectives, program_memory
    from shardwise.ops.attention.benchmark import peak_bytes
    from shardwise.run.execute import Executable

    def run():
        model, inputs = build("gpt2", device, SMALL if device.type == "cuda" else size)
        mesh, kw = layout(lay, model, ranks)
        pm = sw.parallelize(model, mesh, inputs, **kw)
        plan = pm.plan
        program = plan.program_module(0, guards=False)
        args = [a.detach().clone() if isinstance(a, torch.Tensor) else a
                for a in Executable(plan).flat_locals(pm.shards, 0, inputs, ())]
        resident = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))

        def once():
            with using(_ModelCollectives(plan.mesh, 0)), using_generator(None), torch.no_grad():
                return program(*args)

        once()  # warm: kernels and workspaces that stay allocated are not the program's
        got = resident + _peak(once, device, peak_bytes)
        est = program_memory(plan, 0).peak
        off = (est - got) / got
        why = None if abs(off) <= MEMORY_TOLERANCE else f"estimate {off:+.1%} off the measured peak"
        return why, f"estimated {est / 2**20:.2f} MiB, measured {got / 2**20:.2f} MiB ({off:+.1%})"
    return run


@contextlib.contextmanager
def single_rank_group(backend: str, device):
    """A process group of one (this process), torn down after."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1, **kw)
        try:
            yield
        finally:
            dist.destroy_process_group()


def group_row(backend: str, device, compile: bool, mesh_size: int = 1, lay: str = "data", name: str = "gpt2",
              size: dict = TINY):
    """The torch backend on the process group (one of this process, or torchrun's): one step, and a
    second one (the first run of a plan is the guarded eager one: the second is compiled)."""
    def run():
        model, inputs = build(name, device, size)
        want_loss, want = one_device(model, inputs)
        mesh, kw = layout(lay, model, mesh_size)
        pm = sw.parallelize(model, mesh, inputs, backend="torch", compile=compile, **kw)
        for _ in range(2):
            pm.zero_grad()
            loss = pm.step(*inputs)
        why = compare(loss, pm.gradients(), want_loss, want)
        if not compile:
            return why, f"loss {float(loss):.4f}"
        compiled = pm._executable(pm.plan)._compiled.get(torch.distributed.get_rank())
        first = None if compiled is None else compiled.first_call_s
        if first is None:
            why = why or "the second step did not run the compiled program"
        return why, f"loss {float(loss):.4f}; compiled, first call {first or 0:.1f} s of CPU"
    return run


# -- the checks -------------------------------------------------------------------------------
def local_rows(device, ranks: int, compile_on_cpu: bool, runs: int, quick: bool = False) -> list:
    """The one-device rows; ``quick``: one model of one layer and one case of each check (the CI test's)."""
    cuda = device.type == "cuda"
    size = dict(TINY, layers=1) if quick else TINY
    models = ("gpt2",) if quick else ("gpt2", "llama")
    rows = [row("threads", f"{name} {lay} x{ranks}", threads_row(name, lay, ranks, device, size=size))
            for name in models for lay in (("data", "ring") if quick else LAYOUTS)]
    bf16 = sw.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rows += [row("bf16", f"{name} {lay} x{ranks}", threads_row(name, lay, ranks, device, bf16, size))
             for name in models for lay in (("data",) if quick else ("data", "megatron"))]
    seq = 2048 if cuda else (128 if quick else 256)
    for dtype in ((torch.bfloat16, torch.float32) if cuda else (torch.float32,)):
        for causal in ((True,) if quick else (False, True)):
            rows.append(row("attention", f"{str(dtype)[6:]} seq {seq}{' causal' if causal else ''}",
                            attention_row(device, dtype, causal, seq, runs)))
    if cuda:
        rows.append(row("kernels", "choice vs torch's, each kernel vs float64", kernels_row(device)))
    else:
        rows.append(skipped("kernels", "choice vs torch's", "CUDA only (tests/attention/test_cuda_select.py "
                            "checks the choice on mocked devices)"))
        rows.append(skipped("attention", "bfloat16", "CUDA only: the fused-kernel choice is a CUDA question "
                            "(CPU's bf16 path is covered by tests/attention)"))
    rows += [row("memory", f"gpt2 {lay} x{ranks} rank 0", memory_row(lay, ranks, device, size))
             for lay in (("fsdp",) if quick else ("data", "megatron", "fsdp"))]
    backend = "nccl" if cuda else "gloo"
    with single_rank_group(backend, device):
        rows.append(row("group", f"one-rank {backend} group, gpt2", group_row(backend, device, compile=False, size=size)))
        if cuda or compile_on_cpu:
            rows.append(row("compile", f"gpt2 data, one-rank {backend} group", group_row(backend, device, compile=True)))
        else:
            rows.append(skipped("compile", "gpt2", "on CPU inductor's C++ build takes ~15 s of CPU per program "
                                "(pass --compile; tests/run/test_compile.py runs it on gloo)"))
    return rows


def distributed_rows(device, world: int, compile: bool) -> list:
    """Under torchrun: the torch backend over every process of the group."""
    backend = torch.distributed.get_backend()
    # a head (and a KV head) per rank for Megatron; a batch row per rank
    heads = max(TINY["heads"], world)
    size = dict(TINY, heads=heads, kv_heads=heads, width=8 * heads, batch=max(TINY["batch"], world))
    rows = [row("torch", f"{name} {lay} x{world} ({backend})",
                group_row(backend, device, False, world, lay, name, size))
            for name in ("gpt2", "llama") for lay in ("data", "megatron", "fsdp")]
    if compile:
        rows.append(row("compile", f"gpt2 data x{world} ({backend})",
                        group_row(backend, device, True, world, size=size)))
    return rows


def print_table(rows: list, title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in ("check", "config", "result", "figures", "note", "s"):
        table.add_column(col, overflow="fold")
    style = {"ok": "green", "skipped": "yellow"}
    for r in rows:
        table.add_row(escape(r["check"]), escape(r["config"]), f"[{style.get(r['result'], 'bold red')}]{r['result']}[/]",
                      escape(r["figures"]), escape(r["note"]), f"{r['s']:.1f}")  # a kernel's reason reads "[batch, seq, ...]"
    Console(width=200).print(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo); CUDA-only rows are skipped, saying why")
    p.add_argument("--ranks", type=int, default=2, choices=(2, 3, 4), help="simulated ranks on the one device")
    p.add_argument("--compile", action="store_true", help="with --cpu: run the compile=True row too (~30 s)")
    p.add_argument("--runs", type=int, default=10, help="timed attention runs per side (median)")
    p.add_argument("--quick", action="store_true", help="one model, one case of each check (the CI test's)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not a.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; pass --cpu for the CPU checks", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if world > 1:
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cpu") if a.cpu else torch.device("cuda", local)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if a.cpu else "nccl", **({} if a.cpu else {"device_id": device}))
        rows = distributed_rows(device, world, compile=not a.cpu or a.compile)
        every = [None] * world
        dist.all_gather_object(every, rows)
        rows = [dict(r, config=f"{r['config']} rank {i}") for i, rs in enumerate(every) for r in rs]
        dist.destroy_process_group()
        if local != 0 or int(os.environ.get("RANK", "0")) != 0:
            return 0 if all(r["result"] in ("ok", "skipped") for r in rows) else 1
    else:
        device = torch.device("cpu") if a.cpu else torch.device("cuda", torch.cuda.current_device())
        rows = local_rows(device, a.ranks, a.compile, a.runs, a.quick)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print_table(rows, f"shardwise GPU check on {name}, torch {torch.__version__}, "
                      f"{time.perf_counter() - start:.0f} s")
    failed = [r for r in rows if r["result"] not in ("ok", "skipped")]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows ok or skipped; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
