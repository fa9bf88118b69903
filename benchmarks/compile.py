"""Compile benchmark: cold compile, warm start, compiled vs eager decode and mixed throughput.

On the `small-llama` preset (fp32, torch threads 2), for each compile scope (model, layer), with
inductor in mode "default":
  cold start   seconds of `set_compile_mode(True)` (compile + warm-up of every compile size) in a
               fresh process whose compile_cache_dir AND TORCHINDUCTOR_CACHE_DIR are new, empty
               temporary folders (set in the child's environment / config)
  warm start   the same call in another fresh process given the same two folders (a cache hit
               must be reported); "ready" is the child's whole import + load + compile time
  decode       tokens/s of steady-state pure-decode steps (runner.step_metrics: steps with no
               prefill token and the full batch; tokens / sum of total_s) at batch 1 and 32,
               eager, "general" (the one dynamic-size program, compile_sizes=[]) and compiled
               (with the default decode programs: a static batch-1 package on MKL-prepacked
               weights on CPU) alternating in one process, best of --rounds
  mixed        useful tokens/s of benchmarks/workload.py make_workload(64) (prompts 16-256,
               outputs 16-128, greedy, EOS ignored), eager and compiled alternating in one
               process, best of --rounds
  greedy       compiled token ids == eager token ids, request by request (mixed workload)
Routes: the CompileOptimizer's default warm-start route on CPU ("aoti": an AOTInductor package)
and, with --routes aoti,jit (the default), the torch.compile + mega-cache route ("jit", forced by
RUNNER_CORE_WARM_START=jit) for its cold and warm start; decode and mixed use the default route.
Each measurement whose process freshness matters runs in its own subprocess.
Targets (reported, never enforced): warm start <= 15% of cold (stretch <= 5%); compiled decode
>= 1.3x eager. This machine's cores are shared: figures are noisy; rerun before trusting a ratio.
The last stdout line is one JSON object with every figure.

Run:  make bench-compile    or    .venv/bin/python benchmarks/compile.py [--quick] [--routes aoti]
      (--quick: tiny-llama, 8 short requests, aoti route only: a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCOPES = ("model", "layer")
WARM_TARGET, WARM_STRETCH, DECODE_TARGET = 0.15, 0.05, 1.3


# ---- children (one fresh process per measurement) --------------------------------------------
def _runner(spec: dict, **extra):
    import torch

    from runner_core import ModelRunner

    torch.set_num_threads(2)
    cfg = {"model": spec["model"], "dtype": "float32", "compile": False, "compile_mode": "default",
           "compile_cache_dir": spec["cache_dir"], **extra}
    return ModelRunner(cfg).load_model()


def child_start(spec: dict) -> dict:
    """Time set_compile_mode(True) (the whole compile or warm start) in this fresh process."""
    runner = _runner(spec)
    t0 = time.perf_counter()
    runner.set_compile_mode(True, backend="inductor", mode="default", scope=spec["scope"])
    seconds, ready_s = time.perf_counter() - t0, time.time() - spec["t_launch"]
    out = runner.generate([[5, 6, 7, 8]], _greedy(4))
    stats = runner.compile_stats()
    return {"seconds": seconds, "ready_s": ready_s,
            "cache": stats["cache"], "warm_start": stats["warm_start"], "reason": stats["warm_start_reason"],
            "recompiles": stats["recompiles_after_warmup"], "ok": out[0].finish_reason == "length"}


def _greedy(n: int):
    from runner_core import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _decode_tok_s(runner, batch: int, prompt_len: int, out_len: int, seed: int) -> float:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from workload import fixed_workload

    engine = runner.engine
    reqs = fixed_workload(batch, prompt_len, out_len, seed=seed, vocab_size=engine.vocab_size)
    engine.step_metrics.clear()
    runner.generate([r.prompt_ids for r in reqs], [_greedy(r.max_tokens) for r in reqs])
    steps = [m for m in engine.step_metrics if m.num_prefill_tokens == 0 and m.num_seqs == batch]
    return sum(m.num_decode_tokens for m in steps) / sum(m.total_s for m in steps)


def child_speed(spec: dict) -> dict:
    """Eager vs compiled (warm caches) decode tok/s at batch 1 and 32, then the mixed workload."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from workload import make_workload, useful_tokens

    runner = _runner(spec, max_num_seqs=spec["max_num_seqs"])
    runner.generate([[5] * 16], _greedy(4))
    engine = runner.engine

    def compiled(sizes):
        def switch():
            engine.worker.config = engine.worker.config.replace(compile_sizes=sizes)  # what the switch reads
            return runner.set_compile_mode(True, backend="inductor", mode="default", scope=spec["scope"])
        return switch

    # "general": the one dynamic-size program only; "compiled": with the default decode programs
    modes = {"eager": lambda: runner.set_compile_mode(False), "general": compiled([]), "compiled": compiled(None)}
    decode = {m: {b: 0.0 for b in (1, 32)} for m in modes}
    for rnd in range(spec["rounds"]):
        for mode, switch in modes.items():
            switch()
            for b in (1, 32):
                tok_s = _decode_tok_s(runner, b, spec["prompt_len"], spec["decode_len"], seed=rnd)
                decode[mode][b] = max(decode[mode][b], tok_s)
    vocab = runner.engine.vocab_size
    lens = dict(prompt_len=(16, 64), output_len=(8, 32)) if spec["quick"] else {}
    reqs = make_workload(spec["num_requests"], seed=0, vocab_size=vocab, **lens)
    mixed, tokens = {"eager": 0.0, "compiled": 0.0}, {}
    for _ in range(spec["rounds"]):  # alternating, best kept: this machine drifts by 10-20% over minutes
        for mode in mixed:
            modes[mode]()
            runner.generate([[5] * 16], _greedy(4))
            t0 = time.perf_counter()
            outs = runner.generate([r.prompt_ids for r in reqs], [_greedy(r.max_tokens) for r in reqs])
            mixed[mode] = max(mixed[mode], useful_tokens(reqs) / (time.perf_counter() - t0))
            tokens[mode] = [o.token_ids for o in outs]
    stats = runner.compile_stats()
    same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"]))
    return {"decode": decode, "mixed": mixed, "greedy_equal": same, "greedy_total": len(reqs),
            "recompiles": stats["recompiles_after_warmup"], "warm_start": stats["warm_start"],
            "cuda_graphs": stats["cuda_graphs"], "decode_programs": stats["decode_programs"]}


# ---- the parent ------------------------------------------------------------------------------
def run_child(kind: str, spec: dict, env_extra: dict, timeout: int = 3600) -> dict:
    env = {**os.environ, **env_extra}
    spec = {**spec, "t_launch": time.time()}
    res = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("CHILD ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} child failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(lines[-1][len("CHILD "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama, few short requests, aoti route only")
    ap.add_argument("--model", default=None, help="default small-llama (tiny-llama with --quick)")
    ap.add_argument("--scopes", default=",".join(SCOPES))
    ap.add_argument("--routes", default=None, help="warm-start routes timed cold/warm: aoti,jit (default; "
                                                   "aoti only with --quick)")
    ap.add_argument("--rounds", type=int, default=2, help="eager/compiled decode alternations (best kept)")
    ap.add_argument("--num-requests", type=int, default=None, help="mixed workload size (64; 8 with --quick)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary cache folders")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, spec = args.child
        result = {"start": child_start, "speed": child_speed}[kind](json.loads(spec))
        print("CHILD " + json.dumps(result), flush=True)
        return

    from runner_core.loader.model_loader import resolve_model_path

    model = args.model or ("tiny-llama" if args.quick else "small-llama")
    model_path = str(resolve_model_path(model))
    scopes = [s for s in args.scopes.split(",") if s]
    routes = [r for r in (args.routes or ("aoti" if args.quick else "aoti,jit")).split(",") if r]
    base = {"model": model_path, "quick": args.quick, "rounds": args.rounds,
            "num_requests": args.num_requests or (8 if args.quick else 64), "max_num_seqs": 64,
            "prompt_len": 16 if args.quick else 32, "decode_len": 16 if args.quick else 48}
    root = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from machine import describe, machine_info

    info = machine_info("cpu")
    print(describe(info))
    print(f"model {model}; scopes {scopes}; routes {routes}; temp caches under {root}; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (shared: figures are noisy)", flush=True)

    starts: dict[str, dict[str, dict]] = {}
    speed: dict[str, dict] = {}
    for scope in scopes:
        for route in routes:
            cache_dir, inductor_dir = root / f"{scope}-{route}" / "compile", root / f"{scope}-{route}" / "inductor"
            env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "RUNNER_CORE_WARM_START": route}
            spec = {**base, "scope": scope, "cache_dir": str(cache_dir)}
            cold = run_child("start", spec, env)
            print(f"  {scope:<6}{route:<5} cold {cold['seconds']:7.2f} s  ({cold['warm_start']}, {cold['cache']})",
                  flush=True)
            warm = run_child("start", spec, env)
            print(f"  {scope:<6}{route:<5} warm {warm['seconds']:7.2f} s  ({warm['warm_start']}, {warm['cache']})",
                  flush=True)
            starts.setdefault(scope, {})[route] = {"cold": cold, "warm": warm}
            if route == routes[0]:
                speed[scope] = run_child("speed", spec, env)
                d = speed[scope]["decode"]
                print(f"  {scope:<6}decode b1 {d['eager']['1']:.1f} -> {d['general']['1']:.1f} (general) -> "
                      f"{d['compiled']['1']:.1f} tok/s, b32 {d['eager']['32']:.1f} -> {d['compiled']['32']:.1f} "
                      "tok/s; mixed "
                      f"{speed[scope]['mixed']['eager']:.1f} -> {speed[scope]['mixed']['compiled']:.1f} tok/s",
                      flush=True)
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'scope':<7}{'route':<6}{'cold s':>8}{'warm s':>8}{'warm/cold':>10}{'ready cold':>11}{'ready warm':>11}"
          f"  warm-start cache")
    figures = {"model": model, "quick": args.quick, "machine": info, "targets": {"warm_over_cold": WARM_TARGET,
               "warm_over_cold_stretch": WARM_STRETCH, "decode_speedup": DECODE_TARGET}, "scopes": {}}
    for scope in scopes:
        fs = figures["scopes"].setdefault(scope, {"routes": {}})
        for route, s in starts[scope].items():
            ratio = s["warm"]["seconds"] / s["cold"]["seconds"]
            verdict = "stretch met" if ratio <= WARM_STRETCH else "met" if ratio <= WARM_TARGET else "NOT met"
            print(f"{scope:<7}{route:<6}{s['cold']['seconds']:>8.2f}{s['warm']['seconds']:>8.2f}{100 * ratio:>9.1f}%"
                  f"{s['cold']['ready_s']:>11.2f}{s['warm']['ready_s']:>11.2f}  {s['warm']['warm_start']} "
                  f"{s['warm']['cache']}  (target <= {100 * WARM_TARGET:g}%: {verdict})")
            fs["routes"][route] = {"cold_s": round(s["cold"]["seconds"], 3), "warm_s": round(s["warm"]["seconds"], 3),
                                   "warm_over_cold": round(ratio, 4), "ready_cold_s": round(s["cold"]["ready_s"], 3),
                                   "ready_warm_s": round(s["warm"]["ready_s"], 3), "warm_cache": s["warm"]["cache"],
                                   "route_used": s["warm"]["warm_start"], "recompiles": s["warm"]["recompiles"]}
    print(f"\n{'scope':<7}{'':<22}{'eager tok/s':>12}{'compiled':>10}{'ratio':>7}   (compiled: with decode programs)")
    for scope in scopes:
        sp = speed[scope]
        fs = figures["scopes"][scope]
        for label, e, c in (("decode batch 1", sp["decode"]["eager"]["1"], sp["decode"]["compiled"]["1"]),
                            ("  general program", sp["decode"]["eager"]["1"], sp["decode"]["general"]["1"]),
                            ("decode batch 32", sp["decode"]["eager"]["32"], sp["decode"]["compiled"]["32"]),
                            ("  general program", sp["decode"]["eager"]["32"], sp["decode"]["general"]["32"]),
                            ("mixed workload", sp["mixed"]["eager"], sp["mixed"]["compiled"])):
            note = f"  (target >= {DECODE_TARGET:g}x: {'met' if c / e >= DECODE_TARGET else 'NOT met'})" \
                if label.startswith("decode") else ""
            print(f"{scope:<7}{label:<22}{e:>12.1f}{c:>10.1f}{c / e:>6.2f}x{note}")
        dp = sp["decode_programs"]
        print(f"{scope:<7}greedy tokens equal: {sp['greedy_equal']}/{sp['greedy_total']} requests; "
              f"recompiles after warm-up: {sp['recompiles']}; route {sp['warm_start']}; decode programs "
              f"{dp.get('sizes')} ({dp.get('memory_bytes', 0) / 2**20:.0f} MiB prepacked; {dp['reason']})")
        fs.update({"decode_b1_tok_s": {k: round(v["1"], 2) for k, v in sp["decode"].items()},
                   "decode_b32_tok_s": {k: round(v["32"], 2) for k, v in sp["decode"].items()},
                   "decode_b1_ratio": round(sp["decode"]["compiled"]["1"] / sp["decode"]["eager"]["1"], 3),
                   "decode_b32_ratio": round(sp["decode"]["compiled"]["32"] / sp["decode"]["eager"]["32"], 3),
                   "mixed_tok_s": {k: round(v, 2) for k, v in sp["mixed"].items()},
                   "mixed_ratio": round(sp["mixed"]["compiled"] / sp["mixed"]["eager"], 3),
                   "greedy_equal": sp["greedy_equal"], "greedy_total": sp["greedy_total"],
                   "recompiles_after_warmup": sp["recompiles"],
                   "decode_programs": {"sizes": dp.get("sizes"), "memory_bytes": dp.get("memory_bytes", 0)}})
    figures["cuda_graphs"] = next(iter(speed.values()))["cuda_graphs"] if speed else None
    print(f"CUDA graphs: {figures['cuda_graphs']}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
