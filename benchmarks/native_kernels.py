"""The native kernels against torch's own CPU code, per instruction-set tier, at real model sizes.

For every kernel tier this CPU runs (or `--tiers`), one process of its own, started with that tier's
RUNNER_CORE_CPU_TIER and with torch's libraries held to the same instruction set (TIER_ENV:
ATEN_CPU_CAPABILITY for ATen's kernels, ONEDNN_MAX_CPU_ISA for oneDNN, MKL_ENABLE_INSTRUCTIONS for
MKL), so an AVX2 row compares AVX2 code with AVX2 code; the micro-architecture stays this CPU's.
  GEMM       panel_linear (our panels) against F.linear (MKL / oneDNN), float32 and bfloat16, on the
             linear layers of qwen2.5-0.5b, llama-3.2-1b and small-llama (LAYERS: [in -> out]) at m
             rows (default 1, 4, 16, 64, 256). Each engine cycles through copies of the weight that
             together pass twice the last-level cache, so every call reads its weight from memory as
             a decode step does. GFLOP/s = 2 m k n / seconds; at m = 1 also GB/s of weight bytes read
             (n k x element size) and its share of the memory bandwidth.
  quant      int8 (per channel) and int4 (groups of --quant-group) weights, x in each dtype, at the same
             layers and rows: ours (quant_linear over pack's panels, dequantized in registers) beside
             torch's weight-only ops (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu) and
             our panels of the dtype, in the same rounds; us per call and GB/s of each one's stored
             bytes read (the panels: the dtype's), at m = 1 also the share of the bandwidth. torch's
             ops take a scalar path for float32 x (seconds per call at m > 1): there m = 1 only. `--hot`:
             one copy of each weight, read from the caches (where it fits): each kernel's compute ceiling.
  attention  decode (one query per sequence, 8 sequences, block size 16, the blocks shuffled in the
             pool) at a few context lengths: the kernel reading K/V in place against the torch path
             (gather the sequences' K/V, then runner_core.layers.gather_attention.decode_attention); GB/s of K/V read.
The engines take turns in each of `--repeats` rounds (after one untimed pass); the median and range over the
rounds. The bandwidth is benchmarks/machine.py's probe (sum and copy past the last-level cache) in each tier's
process, with its threads, before and after its rows, pooled. Every row names the CPU and the tier; the last
stdout line is one JSON object with every figure.

Run:  make bench-kernels    or    .venv/bin/python benchmarks/native_kernels.py [--tiers avx2] [--dtypes bfloat16]
                                      [--models qwen2.5-0.5b] [--rows 1,16] [--repeats 5]
                                      [--sections quant] [--quant-group 64] [--hot]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

try:  # run as a script: benchmarks/ is on sys.path
    import machine
except ImportError:  # run as `python -m benchmarks.kernels`
    from benchmarks import machine

# the libraries' own switches, per kernel tier (the avx512-bf16 tier leaves MKL at its default: MKL's
# float32 GEMM has no bfloat16 path to hold back)
TIER_ENV = {
    "plain": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}
# model -> layer -> (in features k, out features n), as the published configs give them
LAYERS = {
    "qwen2.5-0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
                     "lm_head": (896, 151936)},
    "llama-3.2-1b": {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048),
                     "lm_head": (2048, 128256)},
    "small-llama": {"qkv": (512, 1024), "o": (512, 512), "gate_up": (512, 2752), "down": (1376, 512),
                    "lm_head": (512, 8192)},
}
LAYER_COUNT = {"qwen2.5-0.5b": 24, "llama-3.2-1b": 16, "small-llama": 8}  # decoder layers (one LM head)
# model -> (query heads, KV heads, head dim)
ATTENTION = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "small-llama": (8, 4, 64)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SECTIONS = ("gemm", "quant", "attention")
SEQS, BLOCK = 8, 16
MIN_ROUND_S = 0.1  # each engine's calls in a round take at least this long


def _ring(make, nbytes: int, llc: int) -> list:
    """Copies of one operand set that together pass twice the last-level cache (at least one): read
    in turn, each copy has left the caches by the time it comes round again."""
    return [make(i) for i in range(max(1, -(-2 * llc // nbytes)))]


def _rounds(engines: dict, ring_len: int, repeats: int) -> dict:
    """Seconds per call of each engine (name -> fn(i) for copy i) in each round, engines taking turns;
    each engine goes on through the copies from where its last round stopped. An engine's calls per
    round are sized by its last untimed call (engines may differ a hundredfold)."""
    calls = {}
    for name, fn in engines.items():  # untimed pass: every copy once
        for i in range(ring_len):
            t = time.perf_counter()
            fn(i)
        calls[name] = int(MIN_ROUND_S / max(time.perf_counter() - t, 1e-6)) + 1
    out: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(repeats):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, fn in order:
            t = time.perf_counter()
            for i in range(r * calls[name], (r + 1) * calls[name]):
                fn(i % ring_len)
            out[name].append((time.perf_counter() - t) / calls[name])
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _gemm_layer(dtype: torch.dtype, k: int, n: int, rows: list[int], repeats: int, llc: int) -> list[dict]:
    from runner_core.kernels import pack_panels, panel_linear

    g = torch.Generator().manual_seed(k * n)
    base = torch.randn(n, k, generator=g).div_(k ** 0.5).to(dtype)
    size = base.element_size() * n * k
    weights = _ring(lambda i: base if i == 0 else base.clone(), size, llc)
    panels = [pack_panels(w) for w in weights]
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype)
        secs = _rounds({"ours": functools.partial(lambda x, i: panel_linear(x, panels[i], n, None), x),
                        "torch": functools.partial(lambda x, i: F.linear(x, weights[i]), x)}, len(weights), repeats)
        row = {"k": k, "n": n, "m": m, "copies": len(weights)}
        for name, t in secs.items():
            row[name] = {"gflops": _spread([2 * m * k * n / s / 1e9 for s in t])}
            if m == 1:
                row[name]["gbps"] = _spread([size / s / 1e9 for s in t])
        out.append(row)
    return out


def gemm_rows(dtype: torch.dtype, models: list[str], rows: list[int], repeats: int, llc: int) -> list[dict]:
    return [{"model": model, "layer": layer, **row} for model in models for layer, (k, n) in LAYERS[model].items()
            for row in _gemm_layer(dtype, k, n, rows, repeats, llc)]


def _quant_layer(dtype: torch.dtype, k: int, n: int, rows: list[int], repeats: int, llc: int, group: int) -> list[dict]:
    from runner_core.kernels import pack_panels, panel_linear
    from runner_core.layers.quantization import QuantFormat, pack, quant_linear, quantize

    group = max(size for size in (32, 64, 128) if size <= group and k % size == 0)  # as the loader falls back
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g).div_(k ** 0.5)
    f8, f4 = QuantFormat.of("int8"), QuantFormat.of("int4", group)
    t8, t4 = quantize(w, f8), quantize(w, f4)
    # torch's int4 weights are (q - 8) * scale + zero: the same weights as ours with zero = min + 8 scale
    q4 = torch.stack((t4["qweight"] & 0xF, t4["qweight"] >> 4), dim=2).view(n, k).int()
    zeros = torch.stack((t4["scales"], t4["mins"] + 8 * t4["scales"]), dim=2).transpose(0, 1).contiguous().to(dtype)
    makers = {  # engine -> (make copy i -> its operands, call on x)
        "ours_int8": (lambda i: pack(t8, f8, n, k), lambda x, p: quant_linear(x, p, f8, n, None)),
        "torch_int8": (lambda i: (t8["qweight"].clone(), t8["scales"].view(n).to(dtype)),
                       lambda x, p: torch.ops.aten._weight_int8pack_mm(x, *p)),
        "ours_int4": (lambda i: pack(t4, f4, n, k), lambda x, p: quant_linear(x, p, f4, n, None)),
        "torch_int4": (lambda i: (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2), zeros.clone()),
                       lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], group, p[1])),
        "panels": (lambda i: pack_panels(w.to(dtype)), lambda x, p: panel_linear(x, p, n, None)),
    }
    firsts = {name: make(0) for name, (make, _) in makers.items()}
    nbytes = {name: sum(t.nbytes for t in (f.values() if isinstance(f, dict) else f if isinstance(f, tuple) else (f,)))
              for name, f in firsts.items()}
    rings = {name: _ring(lambda i, make=make, f=firsts[name]: f if i == 0 else make(i), nbytes[name], llc)
             for name, (make, _) in makers.items()}
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype)
        # torch's ops in float32 take a scalar path (seconds per call at the LM head past m = 1): m = 1 only
        engines = {name: functools.partial(lambda x, call, ring, i: call(x, ring[i % len(ring)]), x, call, rings[name])
                   for name, (_, call) in makers.items()
                   if not (name.startswith("torch") and dtype == torch.float32 and m > 1)}
        secs = _rounds(engines, max(len(r) for r in rings.values()), repeats)
        out.append({"k": k, "n": n, "m": m, "group": group, **{
            name: {"us": _spread([s * 1e6 for s in t]), "gbps": _spread([nbytes[name] / s / 1e9 for s in t]),
                   "bytes": nbytes[name]} for name, t in secs.items()}})
    return out


def quant_rows(dtype: torch.dtype, models: list[str], rows: list[int], repeats: int, llc: int, group: int) -> list:
    return [{"model": model, "layer": layer, **row} for model in models for layer, (k, n) in LAYERS[model].items()
            for row in _quant_layer(dtype, k, n, rows, repeats, llc, group)]


def _attention_case(dtype: torch.dtype, model: str, ctx: int, repeats: int, llc: int) -> dict:
    from runner_core.kernels import native_paged_attention
    from runner_core.layers.gather_attention import decode_attention

    heads, kv_heads, dim = ATTENTION[model]
    blocks = SEQS * -(-ctx // BLOCK)
    g = torch.Generator().manual_seed(ctx)
    kv_bytes = 2 * kv_heads * SEQS * ctx * dim * torch.empty((), dtype=dtype).element_size()

    def make(i):
        pool = torch.randn(2, kv_heads, blocks * BLOCK, dim, generator=g).to(dtype)
        tables = torch.randperm(blocks, generator=g).view(SEQS, -1)
        slots = (tables[:, :, None] * BLOCK + torch.arange(BLOCK)).view(SEQS, -1)[:, :ctx]
        return pool, tables, slots

    ring = _ring(make, kv_bytes, llc)
    q = torch.randn(SEQS, heads, dim, generator=g).to(dtype)
    lens, row_seq = torch.full((SEQS,), ctx), torch.arange(SEQS)
    bias = torch.zeros(1, SEQS, 1, ctx, dtype=dtype)
    o, scale = torch.empty_like(q), dim ** -0.5

    def ours(i):
        pool, tables, _ = ring[i]
        native_paged_attention(o, q, pool[0], pool[1], tables, row_seq, lens, BLOCK, scale, None)

    def torch_path(i):
        pool, _, slots = ring[i]
        decode_attention(q, pool[0][:, slots], pool[1][:, slots], bias, kv_heads, scale)

    row = {"model": model, "heads": heads, "kv_heads": kv_heads, "dim": dim, "seqs": SEQS, "context": ctx}
    for name, t in _rounds({"ours": ours, "torch": torch_path}, len(ring), repeats).items():
        row[name] = {"ms": _spread([s * 1e3 for s in t]), "gbps": _spread([kv_bytes / s / 1e9 for s in t])}
    return row


def attention_rows(dtype: torch.dtype, models: list[str], contexts: list[int], repeats: int, llc: int) -> list[dict]:
    return [_attention_case(dtype, model, ctx, repeats, llc) for model in models for ctx in contexts]


def worker(args) -> None:
    """One tier's figures (this process was started with the tier's environment), as one JSON line."""
    from runner_core.kernels import cpu_kernels_available, kernel_tier

    if not cpu_kernels_available():
        raise SystemExit("the native kernels did not load (see the warning above); nothing to measure")
    if args.threads:
        torch.set_num_threads(args.threads)
    llc = machine.last_level_cache_bytes("cpu")
    result = {"tier": kernel_tier(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "env": {k: os.environ.get(k) for k in TIER_ENV["plain"]},
              "gemm": {}, "attention": {}, "quant": {}}
    probes = [machine.bandwidth_probes("cpu", calls=3)]
    for name in args.dtypes:
        dtype = DTYPES[name]
        if "gemm" in args.sections:
            result["gemm"][name] = gemm_rows(dtype, args.models, args.rows, args.repeats, llc)
        if "quant" in args.sections:
            result["quant"][name] = quant_rows(dtype, args.models, args.rows, args.repeats, 0 if args.hot else llc,
                                               args.quant_group)
        if "attention" in args.sections:
            result["attention"][name] = attention_rows(dtype, args.models, args.contexts, args.repeats, llc)
    probes.append(machine.bandwidth_probes("cpu", calls=3))
    pooled = machine.pool_probes(probes)
    result["bandwidth_gbps"] = {method: _spread(pooled[method]["runs"]) for method in ("sum", "copy")}
    print(json.dumps(result))


def _fmt(s: dict, unit: str = "") -> str:
    return f"{s['median']:.1f}{unit} [{s['min']:.1f}-{s['max']:.1f}]"


def decode_steps(tier: dict) -> list[dict]:
    """The m = 1 rows of each model and dtype as one decode step's linear layers (each layer's row times
    the decoder layers, the LM head once): seconds, GB/s of the weights and the share of the bandwidth."""
    out = []
    for dtype, rows in tier["gemm"].items():
        for model in dict.fromkeys(r["model"] for r in rows):
            ones = [r for r in rows if r["model"] == model and r["m"] == 1]
            if {r["layer"] for r in ones} != set(LAYERS[model]):
                continue
            count = [1 if r["layer"] == "lm_head" else LAYER_COUNT[model] for r in ones]
            nbytes = sum(c * r["k"] * r["n"] * DTYPES[dtype].itemsize for c, r in zip(count, ones))
            step = {"model": model, "dtype": dtype, "weight_bytes": nbytes}
            for name in ("ours", "torch"):
                secs = sum(c * 2 * r["k"] * r["n"] / (r[name]["gflops"]["median"] * 1e9) for c, r in zip(count, ones))
                step[name] = {"ms": secs * 1e3, "gbps": nbytes / secs / 1e9,
                              "share": nbytes / secs / 1e9 / tier["bandwidth_gbps"]["sum"]["median"]}
            out.append(step)
    return out


QUANT_ENGINES = ("ours_int8", "torch_int8", "ours_int4", "torch_int4", "panels")


def quant_table(cpu: str, tiers: list[dict]) -> None:
    if not any(t.get("quant") for t in tiers):
        return
    print("\nQuantized weights (int4 in groups of the row's group): us per call [range], GB/s of the stored bytes"
          " read (at m = 1 also the share of the bandwidth); panels: our panels in x's dtype")
    print(f"\n| CPU | tier (torch's) | x dtype | model | layer [k -> n] | m | {' | '.join(QUANT_ENGINES)} "
          "| ours / torch int8 | ours / torch int4 |")
    print("|" + " --- |" * 6 + " ---: |" * (len(QUANT_ENGINES) + 2))
    for t in tiers:
        bandwidth = t["bandwidth_gbps"]["sum"]["median"]
        for dtype, rows in t.get("quant", {}).items():
            for r in rows:
                cells = ["not run" if e not in r else f"{_fmt(r[e]['us'])} ({r[e]['gbps']['median']:.1f} GB/s"
                         + (f", {r[e]['gbps']['median'] / bandwidth:.0%})" if r["m"] == 1 else ")")
                         for e in QUANT_ENGINES]
                cells += [f"{r[f'torch_{f}']['us']['median'] / r[f'ours_{f}']['us']['median']:.2f}x"
                          if f"torch_{f}" in r else "" for f in ("int8", "int4")]
                print(f"| {cpu} | {t['tier']} ({t['torch_capability']}) | {dtype} | {r['model']} | {r['layer']} "
                      f"[{r['k']} -> {r['n']}] | {r['m']} | {' | '.join(cells)} |")


def print_tables(cpu: str, tiers: list[dict]) -> None:
    for t in tiers:
        bw = t["bandwidth_gbps"]
        print(f"tier {t['tier']}, {t['threads']} threads: memory bandwidth (benchmarks/machine.py, in the tier's "
              f"process before and after its rows) sum {_fmt(bw['sum'])} GB/s, copy {_fmt(bw['copy'])} GB/s; "
              "the shares below are of the sum's median")
    print("\n| CPU | tier (torch's) | dtype | model | layer [k -> n] | m | ours GFLOP/s | torch GFLOP/s | ours / torch "
          "| m = 1: ours GB/s (of bandwidth) | torch GB/s (of bandwidth) |")
    print("|" + " --- |" * 5 + " ---: |" * 6)
    for t in tiers:
        for dtype, rows in t["gemm"].items():
            for r in rows:
                ours, theirs, bandwidth = r["ours"], r["torch"], t["bandwidth_gbps"]["sum"]["median"]
                ratio = ours["gflops"]["median"] / theirs["gflops"]["median"]
                share = ["", ""]
                if r["m"] == 1:
                    share = [f"{_fmt(e['gbps'])} ({e['gbps']['median'] / bandwidth:.0%})" for e in (ours, theirs)]
                print(f"| {cpu} | {t['tier']} ({t['torch_capability']}) | {dtype} | {r['model']} | {r['layer']} "
                      f"[{r['k']} -> {r['n']}] | {r['m']} | {_fmt(ours['gflops'])} | {_fmt(theirs['gflops'])} "
                      f"| {ratio:.2f}x | {share[0]} | {share[1]} |")
    print("\nBatch-1 decode, the linear layers of one step (the m = 1 rows x the decoder layers, the LM head once):")
    print("\n| CPU | tier (torch's) | model | dtype | weights MB | ours ms | ours GB/s (of bandwidth) | torch ms "
          "| torch GB/s (of bandwidth) | ours / ours float32 |")
    print("|" + " --- |" * 4 + " ---: |" * 6)
    for t in tiers:
        steps = decode_steps(t)
        for s in steps:
            f32 = [x for x in steps if x["model"] == s["model"] and x["dtype"] == "float32"]
            speed = f"{f32[0]['ours']['ms'] / s['ours']['ms']:.2f}x" if f32 else ""
            print(f"| {cpu} | {t['tier']} ({t['torch_capability']}) | {s['model']} | {s['dtype']} | "
                  f"{s['weight_bytes'] / 1e6:.0f} | {s['ours']['ms']:.1f} | {s['ours']['gbps']:.1f} "
                  f"({s['ours']['share']:.0%}) | {s['torch']['ms']:.1f} | {s['torch']['gbps']:.1f} "
                  f"({s['torch']['share']:.0%}) | {speed} |")
    quant_table(cpu, tiers)
    print(f"\n| CPU | tier (torch's) | dtype | model (heads/KV heads/dim) | {SEQS} sequences x context | ours ms "
          "| torch ms | torch / ours | ours GB/s of K/V |")
    print("|" + " --- |" * 5 + " ---: |" * 4)
    for t in tiers:
        for dtype, rows in t["attention"].items():
            for r in rows:
                ours, theirs = r["ours"], r["torch"]
                print(f"| {cpu} | {t['tier']} ({t['torch_capability']}) | {dtype} | {r['model']} ({r['heads']}/"
                      f"{r['kv_heads']}/{r['dim']}) | {r['context']} | {_fmt(ours['ms'])} | {_fmt(theirs['ms'])} "
                      f"| {theirs['ms']['median'] / ours['ms']['median']:.2f}x | {_fmt(ours['gbps'])} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiers", type=lambda s: s.split(","), default=None,
                   help="comma-separated kernel tiers (default: every tier this CPU runs)")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    p.add_argument("--models", type=lambda s: s.split(","), default=list(LAYERS))
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64, 256])
    p.add_argument("--contexts", type=lambda s: [int(v) for v in s.split(",")], default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                   help="comma-separated: " + ", ".join(SECTIONS))
    p.add_argument("--quant-group", type=int, default=64, choices=(32, 64, 128), help="int4 group size (quant)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the tiers' processes (default: torch's)")
    p.add_argument("--hot", action="store_true", help="quant: one copy of each weight, reused from the caches")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for what, given, known in (("dtype", args.dtypes, DTYPES), ("model", args.models, LAYERS),
                               ("section", args.sections, SECTIONS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            p.error(f"unknown {what} {', '.join(unknown)}; pick from {', '.join(known)}")
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (a median and a range)")
    if args.worker:
        worker(args)
        return

    from runner_core.kernels import cpu_kernels_available, kernel_tiers

    if not cpu_kernels_available():
        raise SystemExit("the native kernels did not load (see the warning above); nothing to measure")
    runnable = kernel_tiers()
    tiers = args.tiers or list(runnable)
    if [t for t in tiers if t not in runnable]:
        p.error(f"--tiers {','.join(tiers)}: this CPU runs {', '.join(runnable)}")
    info = machine.machine_info("cpu")
    print(f"CPU {info['cpu_model']}; kernel tiers this CPU runs: {', '.join(runnable)}; measuring {', '.join(tiers)}; "
          f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads", flush=True)
    results = []
    for tier in tiers:
        env = {**os.environ, **TIER_ENV[tier], "RUNNER_CORE_CPU_TIER": tier}
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--dtypes", ",".join(args.dtypes),
                   "--models", ",".join(args.models), "--rows", ",".join(map(str, args.rows)),
                   "--contexts", ",".join(map(str, args.contexts)), "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--sections", ",".join(args.sections),
                   "--quant-group", str(args.quant_group), *(["--hot"] if args.hot else [])]
        print(f"tier {tier}: {' '.join(f'{k}={v}' for k, v in TIER_ENV[tier].items())} ...", flush=True)
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {tier} tier's process failed (exit {done.returncode}); its output is above")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print_tables(info["cpu_model"], results)
    print(json.dumps({"bench": "kernels", "cpu_model": info["cpu_model"], "runnable_tiers": list(runnable),
                      "tiers": results}))


if __name__ == "__main__":
    main()
