"""KV memory waste: the paged pool against contiguous reservations, then prefix caching.

Part 1 (waste). small-llama, float32, the mixed workload of benchmarks/workload.py (fixed seed;
64 requests, prompts 16-256 tokens, outputs 16-128, greedy, EOS ignored), max_model_len 512,
and a KV pool deliberately too small: ~40% of the slots the workload would need if every
request were resident at full length, so the run is memory-bound and admission depends on how
well memory is used. The engine is stepped by hand; after every step the running sequences'
(tokens in KV, blocks owned) go into a FragmentationTracker (runner_core/memory/fragmentation.py)
owned by this script, which also shadows the run with a first-fit contiguous allocator of the
same size that reserves prompt + max_tokens (capped at max_model_len) per request when the
engine first admits it and frees it when the request finishes. Sampled every step:
  paged waste            allocated slots not holding tokens / allocated slots (the engine's pool)
  static reserv. waste   1 - tokens / (live requests x max_model_len): a static per-request cache
  first-fit waste        reserved slots not holding tokens / reserved slots (worst-case reservation)
  first-fit ext. frag.   1 - largest free hole / total free slots
plus the mean batch the paged pool ran (sequences per step) against what a static reservation
(pool slots // max_model_len) and the first-fit simulator (its live allocations) held at once.
Target, from the PagedAttention paper: paged waste <= 4% where contiguous reservation wastes
60-80%; reported, never enforced. A request that fails stops the script, and the engine's own
memory_stats()["kv_utilization"] must equal the tracker's (checked every 25 steps).

Part 2 (prefix caching). 32 requests sharing one 512-token system prompt (fixed seed) followed by
16-64 unique tokens, 32 output tokens each, max_model_len 1024, a pool that holds the whole
workload without sharing; run with enable_prefix_caching False and True. Reports useful output
tok/s of each, the gain, the hit rate from memory_stats()["prefix_cache_hit_rate"], and whether
both runs produced identical tokens. An error in either run stops the script with its traceback;
no prefix-cache hit with caching on, or tokens that differ, end it with the reason (on stderr, after
the JSON line) and exit status 1.

The last stdout line is one JSON object with every figure.

Run:  .venv/bin/python benchmarks/kv_waste.py [--quick] [--num-requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from runner_core import ModelRunner, SamplingParams
from runner_core.loader.model_loader import resolve_model_path
from runner_core.memory import kv_bytes_per_token
from runner_core.memory.fragmentation import FragmentationTracker

try:
    from workload import Request, make_workload, useful_tokens
except ImportError:  # run as `python -m benchmarks.kv_waste`
    from benchmarks.workload import Request, make_workload, useful_tokens

PAGED_WASTE_TARGET = 0.04
CONTIGUOUS_WASTE_RANGE = (0.60, 0.80)
STATS_TOLERANCE = 1e-9  # the engine's KV utilization and the tracker's count the same slots
FIGURES = [("paged waste", "paged_waste"), ("  of which internal frag.", "internal_fragmentation"),
           ("static reservation waste", "static_reservation_waste"),
           ("first-fit reserved waste", "firstfit_reserved_waste"),
           ("first-fit external frag.", "firstfit_external_fragmentation")]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs) if xs else float("nan"), "p50": percentile(xs, 0.5),
            "p90": percentile(xs, 0.9)}


def bytes_per_token(model: str) -> int:
    """KV bytes per token in float32, from the model's config.json (before any pool is sized)."""
    cfg = json.loads((Path(resolve_model_path(model)) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return kv_bytes_per_token(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim,
                              torch.float32)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# ---- part 1: waste ------------------------------------------------------------------------------
def run_waste(args, reqs: list[Request]) -> dict:
    bs, mml = args.block_size, args.max_model_len
    bpt = bytes_per_token(args.model)
    reserve = [min(r.prompt_len + r.max_tokens, mml) for r in reqs]
    peak_need = sum(reserve)  # every request resident at full length at once
    pool_blocks = max(blocks_for(int(args.pool_fraction * peak_need), bs), blocks_for(mml, bs))
    pool_tokens = pool_blocks * bs
    r = ModelRunner({"model": args.model, "dtype": "float32", "max_model_len": mml, "block_size": bs,
                     "max_num_seqs": args.max_num_seqs, "kv_cache_memory": pool_tokens * bpt,
                     "seed": args.seed}).load_model()
    eng = r.engine
    if eng.memory.num_blocks * eng.memory.block_size != pool_tokens:
        raise RuntimeError(f"pool has {eng.memory.num_blocks} blocks, planned {pool_blocks}")
    print(f"part 1: {len(reqs)} requests, prompts {min(r.prompt_len for r in reqs)}-"
          f"{max(r.prompt_len for r in reqs)}, outputs {min(r.max_tokens for r in reqs)}-"
          f"{max(r.max_tokens for r in reqs)}; max_model_len {mml}; pool {pool_blocks} blocks x {bs} = "
          f"{pool_tokens} tokens ({pool_tokens * bpt / 2**20:.0f} MiB) = {pool_tokens / peak_need:.0%} of the "
          f"{peak_need} tokens all requests would hold at full length")

    tracker = FragmentationTracker(pool_tokens)
    ids = [r.add_request(q.prompt_ids, greedy(q.max_tokens)) for q in reqs]
    reserve_of = dict(zip(ids, reserve))
    admitted: set[str] = set()
    samples: dict[str, list[float]] = {key: [] for _, key in FIGURES}
    batch, running_after, ff_live = [], [], []
    preemptions, steps, max_stats_diff = 0, 0, 0.0
    snapshot_s = 0.0
    t0 = time.perf_counter()
    while r.has_unfinished_requests():
        outs = r.step()
        steps += 1
        running = eng.scheduler.running
        for seq in running:  # admitted this step (or re-admitted after preemption: idempotent)
            if seq.request_id not in admitted:
                admitted.add(seq.request_id)
                tracker.on_admit(seq.request_id, reserve_of[seq.request_id])
        for out in outs:
            if out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                if out.request_id not in admitted:  # admitted and finished within one step
                    admitted.add(out.request_id)
                    tracker.on_admit(out.request_id, reserve_of[out.request_id])
                tracker.on_release(out.request_id)
        if eng.step_metrics:
            m = eng.step_metrics[-1]
            if m.step == steps:
                batch.append(m.num_seqs)
                preemptions += m.num_preempted
        ts = time.perf_counter()
        snap = tracker.snapshot([(s.request_id, s.num_computed_tokens, len(s.block_table)) for s in running],
                                bs, mml)
        snapshot_s += time.perf_counter() - ts
        if snap["num_live"]:
            for _, key in FIGURES:
                samples[key].append(snap[key])
            running_after.append(snap["num_live"])
            ff_live.append(snap["firstfit_num_allocations"])
            if steps % 25 == 0:  # cross-check against the engine's own figure
                engine_utilization = r.memory_stats()["kv_utilization"]
                max_stats_diff = max(max_stats_diff, abs(engine_utilization - snap["kv_utilization"]))
    seconds = time.perf_counter() - t0
    final = tracker.snapshot([], bs, mml)
    del r, eng
    gc.collect()

    stats = {key: summary(xs) for key, xs in samples.items()}
    res = {
        "num_requests": len(reqs), "max_model_len": mml, "block_size": bs, "pool_blocks": pool_blocks,
        "pool_tokens": pool_tokens, "peak_need_tokens": peak_need, "pool_fraction": pool_tokens / peak_need,
        "steps": steps, "sampled_steps": len(samples["paged_waste"]), "seconds": seconds,
        "useful_tok_s": useful_tokens(reqs) / seconds, "preemptions": preemptions,
        "mean_batch_paged": sum(batch) / len(batch) if batch else 0.0,
        "max_batch_paged": max(batch, default=0),
        "mean_running_paged": sum(running_after) / len(running_after) if running_after else 0.0,
        "static_max_concurrency": pool_tokens // mml,
        "firstfit_mean_concurrency": sum(ff_live) / len(ff_live) if ff_live else 0.0,
        "firstfit_peak_concurrency": final["firstfit_peak_allocations"],
        "firstfit_failed": final["firstfit_failed"],
        "firstfit_failed_fragmented": final["firstfit_failed_fragmented"],
        "snapshot_us": 1e6 * snapshot_s / max(steps, 1),
        "memory_stats_kv_utilization_max_diff": max_stats_diff,
        **{f"{key}_{k}": v for key, s in stats.items() for k, v in s.items()},
    }
    return res


def print_waste(res: dict) -> None:
    print(f"\n{'figure (per step, running sequences)':<38}{'mean':>8}{'p50':>8}{'p90':>8}")
    for label, key in FIGURES:
        print(f"{label:<38}" + "".join(f"{100 * res[f'{key}_{k}']:>7.1f}%" for k in ("mean", "p50", "p90")))
    print(f"\n{res['steps']} steps in {res['seconds']:.1f} s ({res['useful_tok_s']:.1f} useful tok/s), "
          f"{res['preemptions']} preemptions; tracker snapshot {res['snapshot_us']:.1f} us/step")
    print(f"requests held at once in {res['pool_tokens']} slots: paged mean batch {res['mean_batch_paged']:.1f} "
          f"(max {res['max_batch_paged']}); static max_model_len reservation {res['static_max_concurrency']}; "
          f"first-fit worst-case reservation mean {res['firstfit_mean_concurrency']:.1f} "
          f"(peak {res['firstfit_peak_concurrency']})")
    print(f"first fit could not place {res['firstfit_failed']} of {res['num_requests']} requests on admission "
          f"({res['firstfit_failed_fragmented']} of them with enough free slots in total, lost to fragmentation)")
    pw, sw = res["paged_waste_mean"], res["static_reservation_waste_mean"]
    lo, hi = CONTIGUOUS_WASTE_RANGE
    print(f"target: paged waste <= {100 * PAGED_WASTE_TARGET:g}%: {100 * pw:.2f}% -> "
          f"{'met' if pw <= PAGED_WASTE_TARGET else 'NOT met'}; static reservation waste {100 * sw:.1f}% "
          f"({'inside' if lo <= sw <= hi else 'outside'} the paper's {100 * lo:g}-{100 * hi:g}%), first-fit "
          f"{100 * res['firstfit_reserved_waste_mean']:.1f}% + "
          f"{100 * res['firstfit_external_fragmentation_mean']:.1f}% external fragmentation")


# ---- part 2: prefix caching -----------------------------------------------------------------
def prefix_workload(n: int, seed: int, vocab: int, prefix_len: int, output_len: int) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [Request(system + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))], output_len)
            for _ in range(n)]


def run_prefix(args, reqs: list[Request], enable: bool) -> dict:
    bs, mml = args.block_size, 1024
    pool_tokens = sum(blocks_for(q.prompt_len + q.max_tokens, bs) for q in reqs) * bs
    r = ModelRunner({"model": args.model, "dtype": "float32", "max_model_len": mml, "block_size": bs,
                     "max_num_seqs": len(reqs), "kv_cache_memory": pool_tokens * bytes_per_token(args.model),
                     "enable_prefix_caching": enable, "seed": args.seed}).load_model()
    r.generate([[5] * 16], greedy(4))  # warm-up, shares no prefix with the workload
    ids = [r.add_request(q.prompt_ids, greedy(q.max_tokens)) for q in reqs]
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while r.has_unfinished_requests():
        for out in r.step():
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                tokens[out.request_id] = out.token_ids
    seconds = time.perf_counter() - t0
    hit_rate = r.memory_stats()["prefix_cache_hit_rate"]
    del r
    gc.collect()
    return {"enable_prefix_caching": enable, "seconds": seconds, "tok_s": useful_tokens(reqs) / seconds,
            "tokens": [tokens[i] for i in ids], "hit_rate": hit_rate, "pool_tokens": pool_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 short requests in each part: a smoke run")
    ap.add_argument("--num-requests", type=int, default=None, help="part 1 requests (default 64, 8 with --quick)")
    ap.add_argument("--prefix-requests", type=int, default=None, help="part 2 requests (default 32, 8 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--pool-fraction", type=float, default=0.4,
                    help="KV pool size as a share of the slots all requests need at full length at once")
    ap.add_argument("--skip-prefix", action="store_true", help="skip part 2")
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} "
          f"(other busy processes skew the timings, not the waste figures)")

    vocab = json.loads((Path(resolve_model_path(args.model)) / "config.json").read_text())["vocab_size"]
    n = args.num_requests or (8 if args.quick else 64)
    lens = dict(prompt_len=(16, 64), output_len=(8, 32)) if args.quick else {}
    waste = run_waste(args, make_workload(n, seed=args.seed, vocab_size=vocab, **lens))
    print_waste(waste)

    problems = []
    if waste["memory_stats_kv_utilization_max_diff"] > STATS_TOLERANCE:
        problems.append(f"memory_stats()['kv_utilization'] differs from the tracker's by up to "
                        f"{waste['memory_stats_kv_utilization_max_diff']:.3g} (same step, same sequences)")
    prefix = None
    if not args.skip_prefix:
        n2 = args.prefix_requests or (8 if args.quick else 32)
        out_len = 8 if args.quick else 32
        preqs = prefix_workload(n2, args.seed, vocab, 512, out_len)
        print(f"\npart 2: {n2} requests = one 512-token system prompt + 16-64 unique tokens "
              f"({min(q.prompt_len for q in preqs)}-{max(q.prompt_len for q in preqs)} in all), {out_len} outputs "
              f"each, max_model_len 1024")
        off = run_prefix(args, preqs, False)
        on = run_prefix(args, preqs, True)
        print(f"pool {off['pool_tokens']} tokens (the whole workload without sharing)")
        print(f"{'prefix caching':<16}{'seconds':>9}{'useful tok/s':>14}{'hit rate':>10}")
        for row in (off, on):
            name = "on" if row["enable_prefix_caching"] else "off"
            print(f"{name:<16}{row['seconds']:>9.2f}{row['tok_s']:>14.1f}{100 * row['hit_rate']:>9.1f}%")
        gain = on["tok_s"] / off["tok_s"]
        same = sum(a == b for a, b in zip(on["tokens"], off["tokens"]))
        print(f"gain with prefix caching: {gain:.2f}x")
        print(f"identical tokens with and without: {same}/{n2}{'' if same == n2 else '  <-- MISMATCH'}")
        if not on["hit_rate"]:
            problems.append(f"prefix caching on shows no prefix-cache hit (hit rate {on['hit_rate']!r}) although "
                            f"every request shares a 512-token prefix")
        if same != n2:
            problems.append(f"prefix caching changed the greedy tokens of {n2 - same} of {n2} requests")
        prefix = {"num_requests": n2, "output_len": out_len, "pool_tokens": off["pool_tokens"],
                  "off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"], "off_seconds": off["seconds"],
                  "on_seconds": on["seconds"], "gain": gain, "hit_rate": on["hit_rate"],
                  "off_hit_rate": off["hit_rate"], "identical": same, "identical_all": same == n2}
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")

    def rnd(v):
        return round(v, 5) if isinstance(v, float) else v

    print(json.dumps({
        "waste": {k: rnd(v) for k, v in waste.items()},
        "paged_waste_target": PAGED_WASTE_TARGET,
        "paged_waste_target_met": waste["paged_waste_mean"] <= PAGED_WASTE_TARGET,
        "prefix": None if prefix is None else {k: rnd(v) for k, v in prefix.items()},
        "problems": problems, "quick": args.quick, "seed": args.seed, "model": args.model}))
    if problems:
        sys.exit("kv_waste: " + "; ".join(problems))


if __name__ == "__main__":
    main()
