"""Published training runs the calculator is checked against: the rows of docs/calculator.md's
table and of tests/cluster/test_published.py, as data (one place for both).

    rows = RUNS                                  # every published run (Run)
    got = modelled(run)                          # the calculator's estimate of it (calc.estimate)
    err = got.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1
    python -m shardwise.tools.cluster.published [--only KEY ...] [--json F]   # the table, measured

Each run names its source exactly (repository + file + table, or paper + arXiv id + table), its
configuration as published, and its published throughput. Throughput is compared in tokens per
second per GPU; where a source publishes FLOP/s per GPU or MFU, the tokens per second are derived
from it with the source's own FLOP count per token (``_megatron_tokens``), or from its published
iteration time (said per row).

``role``: "set" runs are those the cost model's global constants (core/cost.py GPUS: the GPU
presets and achieved shares) were chosen or checked against when they were set; "held-out" runs
were never used to set anything. ``group`` is the layout family a bound of the issue applies to
(BOUNDS); a compiled or Float8 run is compared but is in no group with a bound (the model prices
eager bf16 kernels only).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

# the relative throughput bound of each group on held-out runs (issue #48: the docs' claim)
BOUNDS = {"1-D FSDP": 0.20, "2-D FSDP x TP": 0.35, "TP x PP": 0.25, "DP x TP x PP": 0.30}
FSDP_MEAN_BOUND = 0.12  # 1-D FSDP held-out runs: mean |error| at most this

TITAN_BENCH = "github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_PERF = "github.com/pytorch/torchtitan, docs/performance.md"
FOUNDRY = "github.com/mosaicml/llm-foundry, scripts/train/benchmarking/README.md"
NARAYANAN = "Narayanan et al. 2021, arXiv:2104.04473, Table 1 (also NVIDIA/Megatron-LM README's scaling table)"
# the Table 1 runs' launch settings (microbatch size, interleaving) as Megatron-LM publishes them
SC21 = "github.com/NVIDIA/Megatron-LM, examples/sc21/run_table_1.sh"
KORTHIKANTI = "Korthikanti et al. 2022, arXiv:2205.05198"

_LLAMA2 = dict(vocab_size=32000, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               max_position_embeddings=4096)


def _gpt(hidden: int, layers: int, heads: int, vocab: int, seq: int = 2048) -> dict:
    """A GPT shape (LayerNorm, 4h GELU MLP, learned positions) as a GPT-2 config: Megatron's GPT
    and MosaicML's MPT (MPT has ALiBi instead of learned positions and no biases: ~0.1% of the flops)."""
    return dict(model_type="gpt2", n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=seq)


@dataclass(frozen=True)
class Run:
    key: str
    source: str  # exact: repository + file + table, or paper + arXiv id + table
    model: str | dict  # a calculator model name (models.NAMED) or a config.json's data
    gpu: str  # core/cost.py GPUS preset
    gpus: int
    mesh: tuple  # one pipeline stage's mesh (dp[, tp])
    layout: str  # calc.LAYOUTS
    local_batch: int  # sequences per data-parallel rank per step
    seq: int
    checkpoint: str  # none | selective | full (as the source ran it, mapped to the calculator's)
    tokens_per_s_per_gpu: float  # published (or derived from a published figure: ``published``)
    published: str  # the figure as the source states it
    group: str | None  # a key of BOUNDS, or None (compiled / Float8: compared, not bounded)
    role: str = "held-out"  # "set" | "held-out"
    pp: int = 1
    microbatches: int | None = None
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # interleaved: stages per pipeline rank (None: calc's default, 2)
    compiled: bool = False
    notes: str = ""  # what the run has that the model does not price
    memory_gib: float | None = None  # published memory per GPU (GiB), where published
    gpus_per_node: int = 8
    names: tuple = field(default=("dp", "tp"))

    @property
    def bound(self) -> float | None:
        return BOUNDS.get(self.group) if self.role == "held-out" else None

    @property
    def layout_text(self) -> str:
        dims = [f"{n.upper()} {s}" for n, s in zip(self.names, self.mesh) if s > 1]
        if self.pp > 1:
            v = f" x {self.stages_per_rank} stages" if self.stages_per_rank else ""
            dims.append(f"PP {self.pp} ({self.schedule}{v}, {self.microbatches} microbatches)")
        return " x ".join(dims)


def _megatron_tokens(tflops: float, hidden: int, layers: int, seq: int, vocab: int, factor: int) -> float:
    """Tokens/s per GPU from FLOP/s per GPU with Megatron's count per token: ``factor`` l h^2 (1 +
    s / 6h + V / (factor / 6 l h)); ``factor`` 96 with full recomputation (Narayanan et al. eq. 3),
    72 without it (Korthikanti et al.'s model FLOPs)."""
    per_token = factor * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (factor / 6 * layers * hidden))
    return tflops * 1e12 / per_token


def _narayanan(key, billions, heads, hidden, layers, tp, pp, gpus, batch, tflops, mbs, per_virtual=None) -> Run:
    """``mbs``: the microbatch size, ``per_virtual``: blocks per virtual pipeline stage where the
    run interleaves (SC21's MBS and --num-layers-per-virtual-pipeline-stage)."""
    dp = gpus // (tp * pp)
    v = layers // pp // per_virtual if per_virtual else 1
    return Run(key, f"{NARAYANAN}: the {billions}B row", _gpt(hidden, layers, heads, 51200), "a100", gpus, (dp, tp),
               "dp+tp", batch // dp, 2048, "full", _megatron_tokens(tflops, hidden, layers, 2048, 51200, 96),
               f"{tflops} TFLOP/s per GPU (their count, recomputation included)",
               "DP x TP x PP" if pp > 1 else None, pp=pp, microbatches=batch // dp // mbs if pp > 1 else None,
               schedule="interleaved" if v > 1 else "1f1b", stages_per_rank=v if v > 1 else None,
               notes=f"A100 80GB, Selene (8 x 200 Gb/s HDR per node); microbatch size {mbs} and interleaving from "
                     f"{SC21}" + ("" if pp > 1 else "; without a pipeline one step of the local batch is modelled "
                                                    "(no gradient accumulation)"))


def _korthikanti(key, billions, heads, hidden, layers, pp, gpus, batch, seconds, group, dp=1) -> Run:
    tokens = batch * 2048 / seconds / gpus
    return Run(key, f"{KORTHIKANTI}: Table 3 (configuration) and Table 5 (end-to-end iteration time, "
                    f"selective recomputation + sequence parallelism), {billions}B",
               _gpt(hidden, layers, heads, 51200), "a100", gpus, (dp, 8), "dp+tp", batch // dp, 2048, "none", tokens,
               f"{seconds} s per iteration of {batch} x 2048 tokens", group, pp=pp,
               microbatches=batch // dp if pp > 1 else None,
               notes="sequence parallelism and selective recomputation of attention's core (a fused attention "
                     "saves nothing there: 'none' modelled); microbatch 1")


# --- the runs --------------------------------------------------------------------------------------------
RUNS: list[Run] = [
    # torchtitan's end-of-2024 benchmark: Grand Teton H100 96GB HBM2e (the h100-hbm2e preset)
    Run("titan-8b-8", f"{TITAN_BENCH}, Table 1, 'FSDP' row", "llama3-8b", "h100-hbm2e", 8, (8,), "fsdp", 2, 8192,
        "selective", 5762, "5,762 TPS/GPU", "1-D FSDP", role="set", memory_gib=82.4, names=("dp",)),
    Run("titan-8b-128", f"{TITAN_BENCH}, Table 3, 'FSDP' row", "llama3-8b", "h100-hbm2e", 128, (128,), "fsdp", 2,
        8192, "selective", 5605, "5,605 TPS/GPU", "1-D FSDP", role="set", memory_gib=67.0, names=("dp",)),
    Run("titan-8b-8-compile", f"{TITAN_BENCH}, Table 1, 'FSDP + torch.compile' row", "llama3-8b", "h100-hbm2e", 8,
        (8,), "fsdp", 2, 8192, "selective", 6667, "6,667 TPS/GPU", None, compiled=True, memory_gib=77.0,
        names=("dp",), notes="torch.compile (fusion not modelled)"),
    Run("titan-70b-256-2d", f"{TITAN_BENCH}, Table 4, '2D' row", "llama3-70b", "h100-hbm2e", 256, (32, 8),
        "fsdp+tp", 16, 8192, "full", 829, "829 TPS/GPU", "2-D FSDP x TP", compiled=True, memory_gib=71.9,
        notes="torch.compile and Float8 (not modelled; its bf16 baseline, benchmarks/asyncTP_llama3_h100_2025-06_"
              "torchtitan.md, is published as an image only)"),
    Run("titan-405b-512-1f1b", f"{TITAN_BENCH}, Table 5, '1F1B' row", "llama3-405b", "h100-hbm2e", 512, (8, 8),
        "planner", 32, 8192, "full", 100, "100 TPS/GPU", None, pp=8, microbatches=32, compiled=True,
        memory_gib=82.5, notes="torch.compile, Float8, async TP (not modelled); the calculator's own layout choice"),
    Run("titan-405b-512-interleaved", f"{TITAN_BENCH}, Table 5, 'Interleaved 1F1B' row", "llama3-405b", "h100-hbm2e",
        512, (8, 8), "planner", 32, 8192, "full", 128, "128 TPS/GPU", None, pp=8, microbatches=32,
        schedule="interleaved", compiled=True, memory_gib=72.7,
        notes="torch.compile, Float8, async TP (not modelled); 2 stages per rank"),
    # torchtitan's earlier performance page: FSDP2 on 64 A100 80GB
    Run("titan-a100-8b", f"{TITAN_PERF}, 'Llama 3 performance numbers', 8B 'selective op' row", "llama3-8b", "a100",
        64, (64,), "fsdp", 1, 8192, "selective", 2973, "2,973 WPS (tokens/s per GPU), 58.2% MFU", "1-D FSDP",
        names=("dp",)),
    Run("titan-a100-70b", f"{TITAN_PERF}, 'Llama 3 performance numbers', 70B 'full' row", "llama3-70b", "a100", 64,
        (64,), "fsdp", 1, 8192, "full", 331, "331 WPS, 51.7% MFU", "1-D FSDP", names=("dp",)),
    Run("titan-a100-l2-13b", f"{TITAN_PERF}, 'Llama 2 performance numbers', 13B 'no' AC row",
        dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
             num_attention_heads=40, num_key_value_heads=40, **_LLAMA2), "a100", 64, (64,), "fsdp", 2, 4096, "none",
        2162, "2,162 WPS, 61.1% MFU", "1-D FSDP", names=("dp",)),
    Run("titan-a100-l2-70b", f"{TITAN_PERF}, 'Llama 2 performance numbers', 70B batch 2 'full' row",
        dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8, **_LLAMA2), "a100", 64, (64,), "fsdp", 2, 4096, "full",
        353, "353 WPS, 50.5% MFU", "1-D FSDP", names=("dp",)),
    # MosaicML llm-foundry: MPT with FSDP FULL_SHARD, amp_bf16, FlashAttention (eager PyTorch)
    Run("mpt-7b-8-h100", f"{FOUNDRY}, 'H100 80GB BF16' table, 7b 2048 x 8 GPUs row", _gpt(4096, 32, 32, 50368),
        "h100", 8, (8,), "fsdp", 6, 2048, "none", 10643, "10,643 T/s/GPU (MFU 46.44)", "1-D FSDP", role="set",
        names=("dp",)),
    Run("mpt-13b-64-h100", f"{FOUNDRY}, 'H100 80GB BF16' table, 13b 2048 x 64 GPUs row", _gpt(5120, 40, 40, 50368),
        "h100", 64, (64,), "fsdp", 2, 2048, "none", 4800, "4,800 T/s/GPU (MFU 39.86)", "1-D FSDP", names=("dp",)),
    Run("mpt-30b-8-h100", f"{FOUNDRY}, 'H100 80GB BF16' table, 30b 2048 x 8 GPUs row", _gpt(7168, 48, 64, 50368),
        "h100", 8, (8,), "fsdp", 3, 2048, "full", 2002, "2,002 T/s/GPU (MFU 38.11)", "1-D FSDP", names=("dp",),
        notes="gradient accumulation 21 microbatches of 3 (modelled: one step of the microbatch)"),
    Run("mpt-70b-64-h100", f"{FOUNDRY}, 'H100 80GB BF16' table, 70b 2048 x 64 GPUs row", _gpt(8192, 80, 64, 50368),
        "h100", 64, (64,), "fsdp", 8, 2048, "full", 1039, "1,039 T/s/GPU (MFU 42.57)", "1-D FSDP", names=("dp",),
        notes="gradient accumulation 4 microbatches of 8 (modelled: one step of the microbatch)"),
    Run("mpt-7b-8-a100", f"{FOUNDRY}, 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)' table, 7b 2048 x 8 "
        "GPUs row", _gpt(4096, 32, 32, 50368), "a100", 8, (8,), "fsdp", 6, 2048, "none", 4641,
        "4,641 T/s/GPU (MFU 64.23)", "1-D FSDP", role="set", names=("dp",)),
    Run("mpt-13b-8-a100", f"{FOUNDRY}, 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)' table, 13b 2048 x 8 "
        "GPUs row", _gpt(5120, 40, 40, 50368), "a100", 8, (8,), "fsdp", 2, 2048, "none", 2262,
        "2,262 T/s/GPU (MFU 59.57)", "1-D FSDP", names=("dp",)),
    Run("mpt-30b-8-a100", f"{FOUNDRY}, 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)' table, 30b 2048 x 8 "
        "GPUs row", _gpt(7168, 48, 64, 50368), "a100", 8, (8,), "fsdp", 3, 2048, "full", 916,
        "916 T/s/GPU (MFU 55.3)", "1-D FSDP", names=("dp",)),
    # Megatron-LM on Selene (A100 80GB)
    _narayanan("meg-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, mbs=16),
    _narayanan("meg-18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, mbs=8),
    _narayanan("meg-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, mbs=4),
    _narayanan("meg-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, mbs=2, per_virtual=5),
    _korthikanti("sp-22b", 22, 64, 6144, 48, 1, 8, 4, 1.10, None),
    _korthikanti("sp-175b", 175, 96, 12288, 96, 8, 64, 64, 13.75, "TP x PP"),
    _korthikanti("sp-530b", 530, 128, 20480, 105, 35, 280, 280, 37.83, "TP x PP"),
]
BY_KEY = {r.key: r for r in RUNS}
_CONFIGS = tempfile.mkdtemp(prefix="shardwise-published-")


def job(run: Run):
    """The calculator's Job for ``run`` (one layout: the published one)."""
    from .calc import Job

    model, path = run.model, None
    if isinstance(model, dict):
        path = os.path.join(_CONFIGS, f"{run.key}.json")
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(model, f)
        model = None
    return Job(model, gpu=run.gpu, gpus=run.gpus, gpus_per_node=run.gpus_per_node, seq=run.seq,
               local_batch=run.local_batch, precision="bf16", checkpoint=run.checkpoint, config_path=path,
               candidates=(run.layout,), pp=run.pp, microbatches=run.microbatches, schedule=run.schedule,
               stages_per_rank=run.stages_per_rank)


def modelled(run: Run):
    """The calculator's estimate of ``run`` on its published mesh and layout."""
    from .calc import estimate

    return estimate(job(run), run.mesh, run.names)


def measure(run: Run) -> dict:
    """``run``'s row: published and modelled tokens/s per GPU, the relative error, memory, fits."""
    est = modelled(run)
    mem = est.layout.memory
    return {"key": run.key, "published": run.tokens_per_s_per_gpu, "modelled": est.tokens_per_s_per_gpu,
            "error": est.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu - 1, "fits": est.fits,
            "peak_gib": mem["peak"] / 2 ** 30, "reserved_gib": (mem.get("reserved") or 0) / 2 ** 30,
            "layout": est.layout.name, "excess_work": est.layout.excess_work, "seconds": est.seconds}


def markdown(rows: dict) -> str:
    """docs/calculator.md's table from measured rows ({key: measure(run)}), in RUNS' order."""
    out = ["| run | source | layout | GPUs | batch x seq, AC | compiled | published tokens/s/GPU | modelled | error "
           "| role | bound |", "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for run in RUNS:
        row = rows.get(run.key)
        got = "not run" if row is None else f"{row['modelled']:,.0f}"
        err = "" if row is None else f"{row['error']:+.1%}"
        bound = f"+-{run.bound:.0%}" if run.bound is not None else "none"
        out.append(f"| {run.key} | {run.source} ({run.published}) | {run.layout} on {run.layout_text} | "
                   f"{run.gpus} {run.gpu} | {run.local_batch} x {run.seq}, {run.checkpoint} | "
                   f"{'yes' if run.compiled else 'no'} | {run.tokens_per_s_per_gpu:,.0f} | {got} | {err} | "
                   f"{run.role} | {bound} |")
    return "\n".join(out)


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None, help="run keys (default: every run)")
    p.add_argument("--json", default=None, help="append each row as a JSON line to this file")
    p.add_argument("--markdown", default=None, help="print the docs' table from this JSON-lines file and stop")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown, encoding="utf-8") as f:
            print(markdown({r["key"]: r for r in map(json.loads, f)}))
        return 0
    for run in [BY_KEY[k] for k in args.only] if args.only else RUNS:
        try:
            row = measure(run)
        except Exception as e:  # a row that cannot be estimated is reported, the rest still run
            print(f"{run.key}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{run.key}: published {row['published']:,.0f}, modelled {row['modelled']:,.0f} "
              f"({row['error']:+.1%}), peak {row['peak_gib']:.1f} GiB, {row['seconds']:.0f} s", flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
