"""Where a step's time goes: torch.profiler over prefill-heavy and decode-heavy batches, per dtype.

Cases (small-llama by default, eager, 2 threads, each run once to warm up, then profiled):
  prefill 8x256   8 requests of 256 prompt tokens, 1 output token each
  decode 32       32 requests of 64 prompt tokens, 64 output tokens (decode steps dominate)
  decode 1        1 request of 32 prompt tokens, 128 output tokens
For each, the share of self CPU time by kind of op (matmuls; the paged decode kernel; SDPA and
the prefill gathers; norms, rotary and activations; sampling; everything else) and the share of
the engine's step time spent outside the model forward (scheduling, input building, sampling,
outputs: the Python side). The last stdout line is one JSON object: {case/dtype: {kind: share}}.

Run:  .venv/bin/python benchmarks/profile_step.py [--dtypes float32 bfloat16] [--model small-llama]
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

CASES = {"prefill 8x256": (8, 256, 1), "decode 32": (32, 64, 64), "decode 1": (1, 32, 128)}
KINDS = [  # (kind, regex over the op name), first match wins
    ("matmul", r"aten::(mm|addmm|bmm|_mkl_linear|mkldnn_.*|linear)$|packed_linear|panel_linear|mkl"),
    ("paged attention", r"paged_attention$|runner_kernels::paged_attention"),
    ("prefill attention", r"scaled_dot_product|_flash_attention|index_select|gather|index$|masked_fill"),
    ("norm/rope/act", r"rms|rsqrt|pow|mean|silu|sigmoid|cos|sin|neg|cat|aten::mul|aten::add"),
    ("sampling", r"argmax|softmax|topk|sort|multinomial|log_softmax"),
]


def _kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def profile_case(runner: ModelRunner, num: int, prompt_len: int, out_len: int) -> dict:
    prompts = [[7 + (i * 31 + j) % 500 for j in range(prompt_len)] for i in range(num)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    runner.generate(prompts, params)  # warm-up
    runner.engine.step_metrics.clear()
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.generate(prompts, params)
    steps = list(runner.engine.step_metrics)
    total, forward = sum(m.total_s for m in steps), sum(m.forward_s for m in steps)
    by_kind: dict[str, float] = {}
    for event in prof.key_averages():
        by_kind[_kind(event.key)] = by_kind.get(_kind(event.key), 0.0) + event.self_cpu_time_total
    cpu = sum(by_kind.values())
    shares = {kind: round(by_kind.get(kind, 0.0) / cpu, 3) for kind, _ in KINDS + [("other", "")]}
    return {**shares, "outside_forward": round(1 - forward / total, 3), "step_ms": round(1e3 * total / len(steps), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    figures = {}
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"\n{'case':<16}{'dtype':<10}{'step ms':>8}" + "".join(f"{k:>19}" for k in kinds) + f"{'outside fwd':>13}")
    for dtype in args.dtypes:
        runner = ModelRunner({"model": args.model, "dtype": dtype, "max_num_seqs": 64}).load_model()
        for case, shape in CASES.items():
            row = profile_case(runner, *shape)
            figures[f"{case}/{dtype}"] = row
            print(f"{case:<16}{dtype:<10}{row['step_ms']:>8.2f}" + "".join(f"{100 * row[k]:>18.0f}%" for k in kinds)
                  + f"{100 * row['outside_forward']:>12.1f}%")
        runner.shutdown()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
