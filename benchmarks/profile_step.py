"""Where a step's time goes against what the step must move and compute: torch.profiler per kind of op, and each
case's floor from the bytes and FLOPs it needs.

Cases (each run once to warm up, then profiled; greedy, 2 threads):
  prefill 8x256   8 requests of 256 prompt tokens, 1 output token each
  decode 32       32 requests of 64 prompt tokens, 64 output tokens (decode steps dominate)
  decode 1        1 request of 32 prompt tokens, 128 output tokens
Formats: fp32, bf16, and int8 / int4 weights (the compute dtype bfloat16, the LM head kept in it), eager or
compiled. For each: the step's time; its floor, the larger of the bytes it must read (the stored weights, the
KV cache its decode tokens attend to) at the bandwidth this script measures first (a sum over 4x the
last-level cache) and the FLOPs it must do (two per weight per token, the attention's QK^T and PV, the LM head
per sampled row) at the measured GEMM peak of the compute dtype; the floor over the time (the efficiency); the
forward's time per layer; the share of self CPU time by kind of op (matmuls; the paged decode kernel; SDPA and
the prefill gathers; norms, rotary and activations; sampling; everything else) and the share of the step spent
outside the forward (scheduling, input building, sampling, outputs: the Python side). Step times are under the
profiler, which inflates small ops. The last stdout line is one JSON object: {case/format/mode: figures}.

Run:  .venv/bin/python benchmarks/profile_step.py [--model qwen2.5-0.5b] [--formats fp32 bf16 int8 int4]
          [--modes eager compiled] [--cases "decode 1" "decode 32"]
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch
from torch.profiler import ProfilerActivity

from runner_core import ModelRunner, SamplingParams
from runner_core.memory.profile import quiet_profile
from runner_core.memory.shapes import ModelShape

CASES = {"prefill 8x256": (8, 256, 1), "decode 32": (32, 64, 64), "decode 1": (1, 32, 128)}
FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8"),
           "int4": ("bfloat16", "int4")}
KINDS = [  # (kind, regex over the op name), first match wins
    ("matmul", r"aten::(mm|addmm|bmm|_mkl_linear|mkldnn_.*|linear)$|packed_linear|panel_linear|quant_linear|mkl"),
    ("paged attention", r"paged_attention$|runner_kernels::paged_attention"),
    ("prefill attention", r"scaled_dot_product|_flash_attention|index_select|gather|index$|masked_fill"),
    ("norm/rope/act", r"rms|rsqrt|pow|mean|silu|sigmoid|cos|sin|neg|cat|aten::mul|aten::add"),
    ("sampling", r"argmax|softmax|topk|sort|multinomial|log_softmax"),
]


def _kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def step_needs(shape: ModelShape, weights_bytes: int, kv_dtype_bytes: int, step, context: float) -> tuple[float, float]:
    """(bytes, FLOPs) one engine step needs: every stored weight read once (an untied embedding table only by
    rows: left out), the KV of `context` tokens per decode token; two FLOPs per weight per token, the
    attention's per (query, key) pair, the LM head per sampled row."""
    head = shape.hidden_size * shape.vocab_size
    layer_weights = 2 * shape.hidden_size * (shape.num_heads + shape.num_kv_heads) * shape.head_dim \
        + 3 * shape.hidden_size * shape.intermediate_size
    tokens = step.num_prefill_tokens + step.num_decode_tokens
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_dtype_bytes
    read = weights_bytes - (0 if shape.tie_word_embeddings else head * kv_dtype_bytes) \
        + step.num_decode_tokens * context * kv_per_token
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * (
        step.num_decode_tokens * context + step.num_prefill_tokens * (step.num_prefill_tokens + 1) / 2
        / max(1, step.num_seqs))
    flops = 2 * shape.num_layers * layer_weights * tokens + attention + 2 * head * step.num_sampled
    return read, flops


def profile_case(runner: ModelRunner, num: int, prompt_len: int, out_len: int, bandwidth: float | None = None,
                 peak: float | None = None) -> dict:
    """A case's figures: step ms, shares by kind of op, outside the forward, ms per layer; with the machine's
    read `bandwidth` (bytes/s) and GEMM `peak` (FLOP/s), its floor and efficiency too."""
    prompts = [[7 + (i * 31 + j) % 500 for j in range(prompt_len)] for i in range(num)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    runner.generate(prompts, params)  # warm-up
    runner.engine.step_metrics.clear()
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.generate(prompts, params)
    steps = list(runner.engine.step_metrics)
    total, forward = sum(m.total_s for m in steps), sum(m.forward_s for m in steps)
    shape = ModelShape.from_hf_config(runner.engine.worker.hf_config)
    figures = {"step_ms": round(1e3 * total / len(steps), 2), "outside_forward": round(1 - forward / total, 3),
               "layer_ms": round(1e3 * forward / len(steps) / shape.num_layers, 3)}
    if bandwidth and peak:
        weights = runner.memory_stats()["weights_bytes"]
        kv_bytes = torch.empty((), dtype=runner.config.torch_dtype).element_size()
        floor = sum(max(read / bandwidth, flops / peak) for read, flops in
                    (step_needs(shape, weights, kv_bytes, m, prompt_len + out_len / 2) for m in steps))
        figures.update(floor_ms=round(1e3 * floor / len(steps), 2), efficiency=round(floor / total, 3))
    by_kind: dict[str, float] = {}
    for event in prof.key_averages():
        by_kind[_kind(event.key)] = by_kind.get(_kind(event.key), 0.0) + event.self_cpu_time_total
    cpu = sum(by_kind.values())
    shares = {kind: round(by_kind.get(kind, 0.0) / cpu, 3) for kind, _ in KINDS + [("other", "")]}
    return {**shares, **figures}


def main() -> None:
    import machine  # benchmarks/ is on sys.path when run as a script

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--formats", nargs="+", default=["fp32", "bf16"], choices=list(FORMATS))
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    torch.set_num_threads(2)
    info = machine.machine_info("cpu")
    bandwidth = machine.bandwidth_probes("cpu")["sum"]["median"] * 1e9
    print(f"{machine.describe(info)}; torch threads {torch.get_num_threads()}; load average "
          f"{os.getloadavg()[0]:.2f}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    figures = {"machine": info, "bandwidth_gbs": round(bandwidth / 1e9, 2)}
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"\n{'case':<15}{'format':<7}{'mode':<9}{'step ms':>8}{'floor ms':>9}{'eff.':>6}{'ms/layer':>9}"
          + "".join(f"{k:>18}" for k in kinds) + f"{'outside fwd':>12}")
    for fmt in args.formats:
        dtype, quantization = FORMATS[fmt]
        peak = machine.matmul_peak(getattr(torch, dtype)) * 1e9
        for mode in args.modes:
            runner = ModelRunner({"model": args.model, "dtype": dtype, "quantization": quantization,
                                  "max_num_seqs": 64, "compile": mode == "compiled"}).load_model()
            for case in args.cases:
                row = profile_case(runner, *CASES[case], bandwidth, peak)
                figures[f"{case}/{fmt}/{mode}"] = row
                print(f"{case:<15}{fmt:<7}{mode:<9}{row['step_ms']:>8.2f}{row['floor_ms']:>9.2f}"
                      f"{100 * row['efficiency']:>5.0f}%{row['layer_ms']:>9.3f}"
                      + "".join(f"{100 * row[k]:>17.0f}%" for k in kinds) + f"{100 * row['outside_forward']:>11.1f}%")
            runner.shutdown()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
