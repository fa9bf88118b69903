"""Model families side by side: one section per question, each a function `(args) -> dict` that prints
its table and returns its figures, which end up under its name in the final JSON line (`SECTIONS`,
run in order; `--sections` picks some).

  moe       1. the fused experts alone, "loop" (one matmul pair per expert) against "grouped_mm"
               (torch._grouped_mm), on each model's layer shape at 1, 32 and 512 tokens, fp32 and bf16;
            2. per model (tiny-mixtral; small-qwen3-moe, 90M parameters of which ~25M active per
               token): the mixed workload of benchmarks/workload.py (64 requests, prompts 16-256,
               outputs 16-128, greedy, EOS ignored) through ours (eager, loop experts; then grouped_mm
               experts) and through transformers as benchmarks/throughput.py measures it (one request
               at a time for the first 8, FIFO batches of 16 and 64 with left padding, its continuous
               batching), with transformers' default experts implementation (grouped_mm) and, for
               batch 64, its "eager" loop; greedy tokens checked against the unpadded one-at-a-time run.
  fallback  the transformers fallback against the native adapter on the same checkpoint (default
            small-llama, ~31.6M Llama), `model_impl="transformers"` vs `"native"`, fp32, eager, on the
            mixed workload, all at once through ModelRunner.generate; runs alternate native /
            fallback, the fastest of each is kept. The fallback's overhead = its seconds / native
            seconds - 1 (target <= 15%, reported, never enforced); both must give the same tokens.
  llava     tiny-llava requests per second on repeated images (distinct images fewer than requests),
            with the encoder cache and without it (`encoder_cache_tokens=0`); prefix caching off, so
            only the vision work differs; both must give the same tokens.

Useful tok/s = the requests' output tokens / wall seconds. `--repeats` runs of each method, the
fastest kept (the machine is shared). The last stdout line is one JSON object.

Run:  make bench-models    or    .venv/bin/python benchmarks/models.py [--quick] [--sections moe fallback llava]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.layers import fused_moe
from runner_core.loader.model_loader import resolve_model_path

try:
    from hf_methods import hf_batches, hf_continuous
    from workload import make_workload, matches, run_ours, useful_tokens
except ImportError:  # run as `python -m benchmarks.models`
    from benchmarks.hf_methods import hf_batches, hf_continuous
    from benchmarks.workload import make_workload, matches, run_ours, useful_tokens

MOE_MODELS = ("tiny-mixtral", "small-qwen3-moe")
FALLBACK_OVERHEAD_TARGET = 0.15


def best_of(repeats: int, fn, *args) -> tuple[float, list[list[int]]]:
    """The fastest of `repeats` calls of fn(*args) -> (seconds, token ids), with its tokens."""
    return min((fn(*args) for _ in range(repeats)), key=lambda run: run[0])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


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
    from runner_core.loader.model_loader import read_hf_config
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
        # model's EOS id, which our ignore_eos run emits (transformers 5.x)
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


# ---- fallback ----------------------------------------------------------------------------------
def bench_fallback(args) -> dict:
    runners = {impl: ModelRunner({"model": args.model, "dtype": "float32", "max_num_seqs": 64,
                                  "model_impl": impl}).load_model() for impl in ("native", "transformers")}
    vocab = runners["native"].engine.vocab_size
    n = args.num_requests
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


# ---- llava ---------------------------------------------------------------------------------------
def bench_llava(args) -> dict:
    """LLaVA requests per second on repeated images, with the encoder cache and without it
    (encoder_cache_tokens=0: every request encodes its image again). Prefix caching stays off, so the
    prompts' text is recomputed either way and only the encoder work differs."""
    from PIL import Image

    rng = np.random.default_rng(args.seed)
    images = [Image.fromarray(rng.integers(0, 256, (72, 80, 3), dtype=np.uint8)) for _ in range(args.llava_images)]
    words = "what is in this picture describe the colours count the shapes tell a story".split()
    requests = [{"prompt": f"USER: <image> {' '.join(rng.choice(words, 6))} ASSISTANT:",
                 "multi_modal_data": {"image": images[i % len(images)]}} for i in range(args.llava_requests)]
    params = _greedy(args.llava_tokens)
    out = {"requests": len(requests), "distinct_images": len(images), "output_tokens": args.llava_tokens}
    tokens = {}
    for label, cache in (("cache", None), ("no_cache", 0)):
        runner = ModelRunner({"model": args.llava_model, "dtype": "float32", "encoder_cache_tokens": cache,
                              "max_num_seqs": 64}).load_model()
        runner.generate(requests[:1], params)  # warm-up (it encodes the first image: counted before `before`)
        before = runner.memory_stats()
        t = time.perf_counter()
        outs = runner.generate(requests, params)
        seconds = time.perf_counter() - t
        after = runner.memory_stats()
        tokens[label] = [o.token_ids for o in outs]
        out[label] = {"seconds": round(seconds, 3), "requests_per_s": round(len(requests) / seconds, 2),
                      "images_encoded": after["encoder_cache_misses"] - before["encoder_cache_misses"]}
        runner.shutdown()
    out["gain"] = round(out["cache"]["requests_per_s"] / out["no_cache"]["requests_per_s"], 3)
    out["identical"] = tokens["cache"] == tokens["no_cache"]
    print(f"LLaVA ({args.llava_model}): {len(requests)} requests over {len(images)} distinct images, "
          f"{args.llava_tokens} tokens each")
    for label in ("cache", "no_cache"):
        r = out[label]
        print(f"  encoder cache {'on ' if label == 'cache' else 'off'}: {r['requests_per_s']:.2f} requests/s "
              f"({r['images_encoded']} images encoded)")
    print(f"  gain {out['gain']:.2f}x; identical tokens: {out['identical']}")
    return out


SECTIONS = {"moe": moe_section, "fallback": bench_fallback, "llava": bench_llava}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="time each method this many times, keep the fastest")
    ap.add_argument("--rounds", type=int, default=20, help="timed calls per experts micro-benchmark figure")
    ap.add_argument("--hf-single-requests", type=int, default=8, help="requests transformers runs one at a time")
    ap.add_argument("--model", default="small-llama", help="the fallback section's checkpoint (a native one)")
    ap.add_argument("--llava-model", default="tiny-llava")
    ap.add_argument("--llava-requests", type=int, default=32)
    ap.add_argument("--llava-images", type=int, default=4, help="distinct images the requests cycle through")
    ap.add_argument("--llava-tokens", type=int, default=8, help="output tokens per LLaVA request")
    args = ap.parse_args()
    args.num_requests = args.num_requests or (8 if args.quick else 64)
    if args.quick:
        args.llava_requests = min(args.llava_requests, 8)
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} "
          "(other busy processes skew every figure)")
    figures = {name: SECTIONS[name](args) for name in args.sections}
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(json.dumps({**figures, "num_requests": args.num_requests, "quick": args.quick, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
