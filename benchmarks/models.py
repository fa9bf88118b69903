"""Model families: ours against transformers' best on the mixed workload, one section per family kind.

Sections (`SECTIONS`, run in order; `--sections` picks some): each is a function `(args) -> dict`
that prints its table and returns its figures, which end up under its name in the final JSON line.
Others add theirs (the transformers fallback, LLaVA) the same way.

  moe   1. the fused experts alone, "loop" (one matmul pair per expert) against "grouped_mm"
           (torch._grouped_mm), on each model's layer shape at 1, 32 and 512 tokens, fp32 and bf16;
        2. per model (tiny-mixtral; small-qwen3-moe, 90M parameters of which ~25M active per token):
           the mixed workload of benchmarks/workload.py (64 requests, prompts 16-256, outputs
           16-128, greedy, EOS ignored) through ours (eager, loop experts; then grouped_mm experts)
           and through transformers as benchmarks/throughput.py measures it (one request at a time
           for the first 8, FIFO batches of 16 and 64 with left padding, its continuous batching),
           with transformers' default experts implementation (grouped_mm) and, for batch 64, its
           "eager" loop; greedy tokens checked against the unpadded one-at-a-time run.
Useful tok/s = the requests' output tokens / wall seconds. The last stdout line is one JSON object.

Run:  make bench-models    or    .venv/bin/python benchmarks/models.py [--quick] [--sections moe]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from runner_core import ModelRunner
from runner_core.layers import fused_moe
from runner_core.model_loader import resolve_model_path

try:
    from throughput import best_of, hf_batches, hf_continuous, matches, run_ours
    from workload import make_workload, useful_tokens
except ImportError:  # run as `python -m benchmarks.models`
    from benchmarks.throughput import best_of, hf_batches, hf_continuous, matches, run_ours
    from benchmarks.workload import make_workload, useful_tokens

MOE_MODELS = ("tiny-mixtral", "small-qwen3-moe")


# ---- moe ----------------------------------------------------------------------------------------
def _experts_ms(num_tokens: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, impl: str, rounds: int) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).to(dtype)
    weights, ids = fused_moe.route(torch.randn(num_tokens, e, generator=g), k, True)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first run warms up
            t = time.perf_counter()
            fused_moe.fused_experts(x, w13, w2, weights, ids, impl=impl)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def experts_microbench(models, rounds: int) -> dict:
    """ms per fused-experts call (best of `rounds`), loop vs grouped_mm, per model shape."""
    from runner_core.model_loader import read_hf_config
    from runner_core.models.moe_spec import MoESpec

    print(f"\nfused experts alone, ms per call (best of {rounds}): loop | grouped_mm")
    out = {}
    for name in models:
        cfg = read_hf_config(resolve_model_path(name))
        spec = MoESpec.from_hf_config(cfg)
        shape = (spec.num_experts, spec.top_k, cfg.hidden_size, spec.intermediate_size)
        for dtype in (torch.float32, torch.bfloat16):
            for n in (1, 32, 512):
                loop, grouped = (_experts_ms(n, *shape, dtype, impl, rounds) for impl in ("loop", "grouped_mm"))
                key = f"{name}/{str(dtype).removeprefix('torch.')}/{n}"
                out[key] = {"loop_ms": round(loop, 3), "grouped_mm_ms": round(grouped, 3)}
                print(f"  {key:<32} {loop:8.3f} | {grouped:8.3f}   grouped/loop {grouped / loop:5.2f}")
    return out


def hf_methods(model_path, reqs, repeats: int, single: int) -> tuple[dict, dict, list[list[int]] | None]:
    """transformers on the workload: {method: tok/s}, {method: (requests, useful tokens)}, the unpadded
    single-request tokens (the greedy reference)."""
    from transformers import AutoModelForCausalLM

    rows, sizes, single_out = {}, {}, None
    for impl in ("grouped_mm", "eager"):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     experts_implementation=impl).eval()
        # EOS becomes a token like any other: with it set, throughput.py's min_new_tokens suppresses the
        # model's EOS id, which our ignore_eos run emits (shared/NOTES.md, transformers 5.x)
        model.generation_config.eos_token_id = None
        runs = [(f"hf batch 64 ({impl})", reqs, 64)]
        if impl == "grouped_mm":
            runs = [("hf single", reqs[:single], 1), ("hf batch 16", reqs, 16)] + runs
        for name, sub, batch in runs:
            secs, outs = best_of(repeats, hf_batches, model, sub, batch, name)
            rows[name], sizes[name] = useful_tokens(sub) / secs, (len(sub), outs)
            if name == "hf single":
                single_out = outs
        if impl == "grouped_mm":
            try:
                secs, outs = best_of(repeats, hf_continuous, model, reqs)
                rows["hf cb"], sizes["hf cb"] = useful_tokens(reqs) / secs, (len(reqs), outs)
            except Exception as e:  # a peer: report, don't crash
                print(f"hf cb skipped: {type(e).__name__}: {e}")
        del model
    return rows, sizes, single_out


def moe_model(name: str, args) -> dict:
    runner = ModelRunner({"model": name, "dtype": "float32", "max_num_seqs": 64}).load_model()
    reqs = make_workload(args.num_requests, seed=args.seed, vocab_size=runner.engine.vocab_size,
                         **(dict(prompt_len=(16, 64), output_len=(8, 32)) if args.quick else {}))
    ours = {}
    for impl in fused_moe.EXPERTS_IMPLS:
        fused_moe.EXPERTS_IMPL = impl
        secs, tokens = best_of(args.repeats, run_ours, runner, reqs)
        ours[impl] = (useful_tokens(reqs) / secs, tokens)
    fused_moe.EXPERTS_IMPL = "loop"
    stats = runner.moe_stats()
    runner.shutdown()
    hf, sizes, single = hf_methods(resolve_model_path(name), reqs, args.repeats, args.hf_single_requests)
    best_name = max(hf, key=hf.get)
    print(f"\n{name}: {len(reqs)} requests, {useful_tokens(reqs)} useful tokens")
    print(f"  {'method':<26}{'useful tok/s':>14}{'ours/it':>9}  greedy match")
    mine = ours["loop"][0]
    for label, (tps, toks) in ours.items():
        print(f"  {'ours (' + label + ' experts)':<26}{tps:>14.1f}{mine / tps:>9.2f}  "
              f"{matches(toks, single)}/{len(single)} vs hf single")
    for label, tps in hf.items():
        n, outs = sizes[label]
        print(f"  {label:<26}{tps:>14.1f}{mine / tps:>9.2f}  {matches(ours['loop'][1], outs)}/{n}")
    load = torch.tensor(stats["cumulative"]).float()
    imbalance = (load.max(1).values / load.mean(1)).max().item()
    print(f"  best transformers: {best_name} ({hf[best_name]:.1f} tok/s): ours {mine / hf[best_name]:.2f}x; "
          f"busiest expert / mean over the run: {imbalance:.2f}")
    return {"ours_tok_s": round(mine, 2), "ours_grouped_mm_tok_s": round(ours["grouped_mm"][0], 2),
            "hf_tok_s": {k: round(v, 2) for k, v in hf.items()}, "hf_best": best_name,
            "ratio_to_hf_best": round(mine / hf[best_name], 3),
            "greedy_match_hf_single": f"{matches(ours['loop'][1], single)}/{len(single)}",
            "expert_imbalance": round(imbalance, 3)}


def moe_section(args) -> dict:
    return {"experts_ms": experts_microbench(MOE_MODELS, args.rounds),
            **{name: moe_model(name, args) for name in MOE_MODELS}}


SECTIONS = {"moe": moe_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="time each method this many times, keep the fastest")
    ap.add_argument("--rounds", type=int, default=20, help="timed calls per micro-benchmark figure")
    ap.add_argument("--hf-single-requests", type=int, default=8, help="requests transformers runs one at a time")
    args = ap.parse_args()
    args.num_requests = args.num_requests or (8 if args.quick else 64)
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} "
          "(other busy processes skew every figure)")
    figures = {name: SECTIONS[name](args) for name in args.sections}
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(json.dumps({**figures, "num_requests": args.num_requests, "quick": args.quick, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
