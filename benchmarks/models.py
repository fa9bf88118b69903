"""Model adapters side by side, one section per question, each a separate function below.

Section "fallback" (`bench_fallback`): the transformers fallback against the native adapter on the
same checkpoint (default small-llama, ~31.6M Llama), `model_impl="transformers"` vs `"native"`, fp32,
eager, on the mixed workload of benchmarks/workload.py (64 requests, prompts 16-256, outputs
16-128, greedy, EOS ignored), all at once through ModelRunner.generate. Runs alternate
native / fallback `--repeats` times (each runner warmed up once), the fastest of each is kept (the
machine is shared). Useful tok/s = the requests' output tokens / wall seconds; the fallback's
overhead = its seconds / native seconds - 1 (target <= 15%, reported, never enforced); the greedy
check: both must produce the same tokens for every request.

The last stdout line is one JSON object: {"<section>": {figures}, ...}.

Run:  make bench-models    or    .venv/bin/python benchmarks/models.py [--quick] [--sections fallback]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from runner_core import ModelRunner, SamplingParams

try:
    from workload import make_workload, useful_tokens
except ImportError:  # run as `python -m benchmarks.models`
    from benchmarks.workload import make_workload, useful_tokens

FALLBACK_OVERHEAD_TARGET = 0.15


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- section "fallback": transformers fallback vs native adapter --------------------------------
def bench_fallback(args) -> dict:
    runners = {impl: ModelRunner({"model": args.model, "dtype": "float32", "max_num_seqs": 64,
                                  "model_impl": impl}).load_model() for impl in ("native", "transformers")}
    vocab = runners["native"].engine.vocab_size
    n = 8 if args.quick else 64
    lens = dict(prompt_len=(16, 64), output_len=(8, 32)) if args.quick else {}
    reqs = make_workload(n, seed=args.seed, vocab_size=vocab, **lens)
    prompts, params = [r.prompt_ids for r in reqs], [_greedy(r.max_tokens) for r in reqs]
    print(f"[fallback] {args.model}: {n} requests, {useful_tokens(reqs)} useful tokens; "
          f"{runners['transformers'].model_info()['reason']}")
    best, tokens = dict.fromkeys(runners, float("inf")), {}
    for runner in runners.values():
        runner.generate([[5] * 16], [_greedy(4)])  # warm-up
    for _ in range(max(1, args.repeats)):
        for impl, runner in runners.items():
            t0 = time.perf_counter()
            outs = runner.generate(prompts, params)
            best[impl] = min(best[impl], time.perf_counter() - t0)
            tokens[impl] = [o.token_ids for o in outs]
    tok_s = {impl: useful_tokens(reqs) / s for impl, s in best.items()}
    overhead = best["transformers"] / best["native"] - 1
    same = sum(a == b for a, b in zip(tokens["native"], tokens["transformers"]))
    print(f"{'model_impl':<14}{'seconds':>10}{'useful tok/s':>14}")
    for impl in runners:
        print(f"{impl:<14}{best[impl]:>10.2f}{tok_s[impl]:>14.1f}")
    print(f"fallback overhead {100 * overhead:.1f}% (its time / native - 1); target <= "
          f"{100 * FALLBACK_OVERHEAD_TARGET:g}%: {'met' if overhead <= FALLBACK_OVERHEAD_TARGET else 'NOT met'}; "
          f"greedy tokens identical: {same}/{n}")
    return {"model": args.model, "native_tok_s": round(tok_s["native"], 2),
            "transformers_tok_s": round(tok_s["transformers"], 2), "overhead": round(overhead, 4),
            "overhead_target": FALLBACK_OVERHEAD_TARGET, "greedy_match": same == n, "num_requests": n,
            "repeats": args.repeats}


SECTIONS = {"fallback": bench_fallback}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--model", default="small-llama", help="the fallback section's checkpoint (a native one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method; the fastest is kept")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} "
          "(other busy processes skew every figure)")
    figures = {name: SECTIONS[name](args) for name in args.sections}
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
