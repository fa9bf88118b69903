"""Offline throughput and start-up: our engine against vLLM and transformers, like with like.

Workload (benchmarks/workload.py, fixed seed): 64 requests (24 on the real-size presets
qwen2.5-0.5b and llama-3.2-1b, which also skip transformers and the step overhead unless asked and run
the engines one at a time), prompts
of 16-256 random token ids, outputs of 16-128 tokens, greedy, EOS ignored; one `--model` (a preset or
a directory; default small-llama) and one `--dtype` per run, torch with 2 threads everywhere.
Engines, each in a process of its own (benchmarks/engine_proc.py), with the same batch limits
(`--max-num-seqs`, `--max-num-batched-tokens`) and prefix-caching setting, read back from each:
  ours eager, ours compiled     ModelRunner.generate on all requests at once, compile off / on
  vllm eager, vllm compiled     vLLM for CPUs (`make bench-peers` makes .venv-peers) on the same
                                model directory and requests, enforce_eager on / off; compared only
                                when it runs on the same device as ours, else the table says none
  hf single / batch 16 / batch 64 / cb   transformers in this process (benchmarks/hf_methods.py)
Start-up (each a new process, caches in fresh temporary folders: our compile cache,
TORCHINDUCTOR_CACHE_DIR, VLLM_CACHE_ROOT): eager; compiled with every cache cold; compiled again on
the caches the cold start filled (warm). Reported: seconds from launch until the engine is ready to
serve, and until its first token; ours / vLLM only within one of those three conditions; the load time
(the engine's constructor) and resident memory after load (benchmarks/engine_proc.py).
Throughput: every method runs the whole workload once untimed (the same warm-up for all), then the
methods take turns (A B C ... A B C ...) for `--repeats` rounds (with `--one-at-a-time`, each engine's
rounds run while it alone is alive); useful tok/s = tokens the method
returned / seconds; the median and range over the rounds. Batch-1 decode (32-token prompt, 128
tokens), the same way. Greedy check: every method's ids against ours eager's.
The device's limits (benchmarks/machine.py) are measured on the device ours runs on: the matmul peak
in the dtype (MFU = tok/s / the workload's compute limit) and the memory bandwidth, probed with a
sum and a copy at sizes past the last-level cache, before the rounds and in each round (a shared
machine's bandwidth moves: the probes see it as the engines do); the batch-1 share is weight bytes x tok/s / the
sum probe's median (also printed against the copy's). Every ratio goes through
benchmarks/verdicts.py, which refuses figures from different devices or unlike conditions, and every
verdict when the machine was not quiet at the start (its 1-minute load average against its cores). Then
the step overhead: 32 requests (prompt 64, 64 outputs); over the pure-decode steps, the share of
step time spent outside the model forward.
Targets (reported, never enforced): ours / vLLM >= 1.25 (eager and compiled each); fp32 MFU >= 70%;
batch-1 >= 75% of the bandwidth; first token <= 1/5 of vLLM's; step overhead <= 5%; ours >= 3x
transformers. A summary (benchmarks/summary.py) closes the run, every line naming the model, dtype, CPU
model and kernel tier; the last stdout line is one JSON object with the figures.

Run:  make bench    or    .venv/bin/python benchmarks/throughput.py [--model qwen2.5-0.5b] [--dtype bfloat16]
                                                                     [--quick] [--skip-hf]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from runner_core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from runner_core.loader.model_loader import read_hf_config, resolve_model_path
from runner_core.memory.shapes import ModelShape
from runner_core.models.presets import REAL_SIZE_PRESETS

try:  # run as a script: benchmarks/ is on sys.path
    import engine_client
    import hf_methods
    import machine
    import summary
    import verdicts
    import workload
except ImportError:  # run as `python -m benchmarks.throughput`
    from benchmarks import engine_client, hf_methods, machine, summary, verdicts, workload

HF_RATIO_TARGET, VLLM_RATIO_TARGET, OVERHEAD_TARGET = 3.0, 1.25, 0.05
REAL_SIZE_REQUESTS = 24  # a real-size run (four engine starts, two of them compiling cold) in ~10 minutes
MFU_TARGET, BANDWIDTH_TARGET, COLD_START_TARGET = 0.70, 0.75, 0.2
SPECS = (engine_client.EngineSpec("ours eager", "ours", False), engine_client.EngineSpec("ours compiled", "ours", True),
         engine_client.EngineSpec("vllm eager", "vllm", False), engine_client.EngineSpec("vllm compiled", "vllm", True))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rounds(procs: dict, hf: dict, model, reqs, repeats: int, errors: dict, probe) -> tuple[dict, dict, dict]:
    """One untimed workload per method, then `repeats` rounds in turn: {name: [(seconds, returned)]},
    {name: first token ids}, {name: [batch-1 tok/s]} (engines only); `probe()` (the bandwidth) runs
    before each round's batch-1 turns, so the probes see the machine as the engines do. An engine
    that fails is dropped from every figure, with its error in `errors`."""
    def ask(name: str, cmd: str) -> dict | None:
        try:
            return procs[name].ask(cmd) if name not in errors else None
        except engine_client.EngineFailed as e:
            errors[name] = str(e)
            print(f"  {e}")
            return None

    for name in procs:
        ask(name, "workload")
        ask(name, "batch1")
    for part, fn in hf.values():
        fn(model, part)
    runs: dict[str, list] = {name: [] for name in [*procs, *hf]}
    tokens, batch1 = {}, {name: [] for name in procs}
    for r in range(repeats):
        print(f"round {r + 1}/{repeats}: {', '.join(runs)}", flush=True)
        for name in procs:
            if res := ask(name, "workload"):
                runs[name].append((res["seconds"], res["returned_tokens"]))
                tokens.setdefault(name, res["tokens"])
        for name, (part, fn) in hf.items():
            seconds, ids = fn(model, part)
            runs[name].append((seconds, sum(map(len, ids))))
            tokens.setdefault(name, ids)
        probe()
        for name in procs:
            if (res := ask(name, "batch1")) and res["many_s"] > res["one_s"]:
                batch1[name].append(128 / (res["many_s"] - res["one_s"]))
            elif res:  # 128 more tokens cannot take no time: the 1-token call was held up
                print(f"  {name}: batch-1 turn discarded (1 token {res['one_s']:.2f} s, 129 tokens "
                      f"{res['many_s']:.2f} s): a busy machine")
    for name in errors:
        for figures in (runs, tokens, batch1):
            figures.pop(name, None)
    return runs, tokens, batch1


def measure(specs, model_dir: str, requests_file: Path, tmp: Path, args, hf_runs: dict, model, reqs, errors: dict,
            probe) -> tuple[dict, dict, dict, dict, dict]:
    """Starts the engines and runs the rounds: (runs, tokens, batch1) as rounds() gives them, the start-up
    figures {(name, condition): ...} and each kept engine's start reply {name: ...}. Together: every engine
    alive, their rounds interleaved. `args.one_at_a_time`: each engine started, measured and closed before
    the next starts (at real sizes four engines' memory would not fit together). Ours eager failing ends it."""
    groups = [[spec] for spec in specs] if args.one_at_a_time else [specs]
    runs, tokens, batch1, starts, started = {}, {}, {}, {}, {}
    for group in groups:
        procs, group_starts = engine_client.start_engines(group, model_dir, requests_file, tmp, args, errors)
        starts.update(group_starts)
        started.update({name: proc.started for name, proc in procs.items()})
        try:
            figures = () if "ours eager" in errors else rounds(
                procs, hf_runs if group is groups[-1] else {}, model, reqs, args.repeats, errors, probe)
            for into, new in zip((runs, tokens, batch1), figures):
                into.update(new)
        finally:
            for proc in procs.values():
                proc.close()
        if "ours eager" in errors:
            raise SystemExit(f"ours failed: {errors['ours eager']}")
    return runs, tokens, batch1, starts, started


def say(line_fn, *args, **kw) -> float | None:
    """Print a verdict line; an unlike comparison prints why it has no figure and yields None."""
    try:
        line, r = line_fn(*args, **kw)
    except verdicts.UnlikeFigures as e:
        print(f"{args[0]}: none ({e})")
        return None
    print(line)
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the defaults of `--model`'s size resolved: a real-size preset runs 24 requests
    and skips transformers and the step overhead unless they are asked for."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"default 64, {REAL_SIZE_REQUESTS} on the real-size presets (8 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="small-llama",
                    help=f"a preset or model directory; the real-size presets: {', '.join(REAL_SIZE_PRESETS)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None, help="ours' device (default: cuda:0 where CUDA is visible, else cpu)")
    ap.add_argument("--hf-single-requests", type=int, default=8, help="requests run one at a time (0 = all)")
    ap.add_argument("--skip-hf", action=argparse.BooleanOptionalAction, default=None,
                    help="no transformers methods (default: skipped on the real-size presets only)")
    ap.add_argument("--skip-compiled", action="store_true", help="no compiled engines (ours and vLLM)")
    ap.add_argument("--skip-vllm", action="store_true", help="no vLLM engines")
    ap.add_argument("--engine-timeout", type=float, default=900, help="seconds an engine may take to start or reply")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every method (median, range)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="both engines' sequence limit")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="both engines' tokens per step (default: ours' default on the device)")
    ap.add_argument("--prefix-caching", action="store_true", help="prefix caching on in both engines (default off)")
    ap.add_argument("--kv-cache-gib", type=int, default=2,
                    help="both engines' KV cache in GiB (vLLM's CPU unit), so resident memory compares like with like")
    ap.add_argument("--one-at-a-time", action=argparse.BooleanOptionalAction, default=None,
                    help="each engine started, measured and closed before the next (default on the real-size "
                         "presets only, whose four engines would not fit in memory together); else interleaved")
    ap.add_argument("--skip-overhead", action=argparse.BooleanOptionalAction, default=None,
                    help="skip the batch-32 decode step figure (default: skipped on the real-size presets only)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats got {args.repeats}; it must be >= 1 (3 or more gives a median and a range)")
    if args.kv_cache_gib < 1:
        ap.error(f"--kv-cache-gib got {args.kv_cache_gib}; it must be >= 1 (vLLM sizes its CPU KV cache in whole GiB)")
    real = args.model in REAL_SIZE_PRESETS
    args.num_requests = args.num_requests or (8 if args.quick else REAL_SIZE_REQUESTS if real else 64)
    args.skip_hf = real if args.skip_hf is None else args.skip_hf
    args.skip_overhead = real if args.skip_overhead is None else args.skip_overhead
    args.one_at_a_time = real if args.one_at_a_time is None else args.one_at_a_time
    return args


def main() -> None:
    args = parse_args()
    quiet = verdicts.quiet_at_start()  # before this benchmark runs anything of its own: else no speed verdict
    verdict = functools.partial(verdicts.verdict, quiet=quiet)
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    info = machine.machine_info(args.device)  # builds the native kernels first: not part of any start below
    device = info["device"]
    kind = torch.device(device).type
    args.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[kind]

    model_dir = str(resolve_model_path(args.model))
    shape = ModelShape.from_hf_config(read_hf_config(Path(model_dir)))
    n = args.num_requests
    lens = dict(prompt_len=(16, 64), output_len=(8, 32)) if args.quick else {}
    reqs = workload.make_workload(n, seed=args.seed, vocab_size=shape.vocab_size, **lens)
    useful = workload.useful_tokens(reqs)
    flops = machine.workload_flops(shape, [(r.prompt_len, r.max_tokens) for r in reqs])
    peak, probes = machine.matmul_peak(dtype, device), machine.bandwidth_probes(device)
    limit = useful / (flops / (peak * 1e9))
    print(machine.describe(info))
    print(f"workload: {n} requests, prompts {min(r.prompt_len for r in reqs)}-{max(r.prompt_len for r in reqs)}, "
          f"outputs {min(r.max_tokens for r in reqs)}-{max(r.max_tokens for r in reqs)}, {useful} useful tokens, "
          f"{flops / 1e12:.3f} TFLOP; {args.dtype}; torch threads {torch.get_num_threads()}; both engines: "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching "
          f"{'on' if args.prefix_caching else 'off'}, KV cache {args.kv_cache_gib} GiB; load average at the start "
          f"{quiet.load:.2f} on {quiet.cores} cores ({'quiet' if quiet.ok else 'NOT quiet: speed verdicts refused'})")
    print(f"{device}: matmul peak {peak:.0f} GFLOP/s ({args.dtype}), the workload's compute limit {limit:.0f} "
          "useful tok/s", flush=True)

    specs = [s for s in SPECS if not (args.skip_compiled and s.compile) and not (args.skip_vllm and s.engine == "vllm")]
    peer_errors = {}
    if kind != "cpu" and engine_client.PEER_PYTHON.exists() and any(s.engine == "vllm" for s in specs):
        peer = engine_client.peer_device()
        if peer != kind:
            peer_errors["vllm"] = f"the vLLM build in .venv-peers runs on {peer}, ours on {device}: no peer on " \
                                  "the same device, so no comparison"
            specs = [s for s in specs if s.engine != "vllm"]
    hf_runs = {} if args.skip_hf else hf_methods.methods(reqs, args.hf_single_requests)
    model = None if args.skip_hf else hf_methods.load(model_dir, dtype, device)
    errors, probe_sets = dict(peer_errors), [probes]

    def probe() -> None:  # the bandwidth as the engines see it, before each round's batch-1 turns
        probe_sets.append(machine.bandwidth_probes(device, calls=2))

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        requests_file = Path(tmp) / "requests.json"
        requests_file.write_text(json.dumps([[r.prompt_ids, r.max_tokens] for r in reqs]))
        runs, tokens, batch1, starts, started = measure(specs, model_dir, requests_file, Path(tmp), args, hf_runs,
                                                        model, reqs, errors, probe)
    probes = machine.pool_probes(probe_sets)
    bandwidth = probes["sum"]["median"]
    print(f"bandwidth probes at {probes['sizes_mib']} MiB (last-level cache {probes['llc_mib']} MiB), before the "
          "rounds and before each round's batch-1 turns:")
    for method in ("sum", "copy"):
        p = probes[method]
        print(f"  {method:<5} median {p['median']:6.1f} GB/s, range {p['min']:.1f}-{p['max']:.1f} "
              f"({len(p['runs'])} calls)")
    devices = {name: s["device"] for name, s in started.items()} | dict.fromkeys(hf_runs, device)
    devices = {k: "cuda:0" if v == "cuda" else v for k, v in devices.items()}
    settings = {name: s["settings"] for name, s in started.items()}
    modes = {s.name: s.mode for s in SPECS} | dict.fromkeys(hf_runs, "eager")
    requested = {name: workload.useful_tokens(hf_runs[name][0]) if name in hf_runs else useful for name in runs}
    tok_s = {name: spread([t / s for s, t in r]) for name, r in runs.items()}
    returned = {name: r[0][1] for name, r in runs.items()}
    ref = tokens["ours eager"]
    match = {name: (workload.matches(ids, ref), len(ids)) for name, ids in tokens.items()}

    print(f"\n{'method':<15}{'device':>7}{'median tok/s':>14}{'range':>17}{'MFU':>6}{'returned/asked':>16}"
          f"  greedy vs ours eager")
    limit_fig = verdicts.Figure(limit, device, label=f"compute limit of {device}")

    def fig(name: str, value: float) -> verdicts.Figure:
        return verdicts.Figure(value, devices[name], modes[name], name)

    for name, t in tok_s.items():
        try:
            used = verdicts.ratio(fig(name, t['median']), limit_fig)
            mfu = f"{100 * used:.0f}%" if requested[name] == useful else "-"
        except verdicts.UnlikeFigures:
            mfu = "-"
        print(f"{name:<15}{devices[name]:>7}{t['median']:>14.1f}{t['min']:>9.1f}-{t['max']:<7.1f}{mfu:>6}"
              f"{returned[name]:>9}/{requested[name]:<6}  {match[name][0]}/{match[name][1]}")
    for name, why in errors.items():
        print(f"{name} not measured: {why}")
    if "hf single" in runs and len(hf_runs["hf single"][0]) < n:
        print(f"(hf single ran the first {len(hf_runs['hf single'][0])} requests only; its tok/s is from that subset)")
    for name, s in settings.items():
        print(f"  {name}: {s}; compile: {started[name].get('compile_route')}")

    print()
    ratios = {}
    for mode in ("eager", "compiled"):
        if f"ours {mode}" in tok_s and f"vllm {mode}" in tok_s:
            ratios[f"vllm {mode}"] = say(verdict, f"ours {mode} / vLLM {mode} (median tok/s)",
                                         fig(f"ours {mode}", tok_s[f"ours {mode}"]["median"]),
                                         fig(f"vllm {mode}", tok_s[f"vllm {mode}"]["median"]), VLLM_RATIO_TARGET)
    best = {side: max((k for k in tok_s if k.startswith(side)), key=lambda k: tok_s[k]["median"], default=None)
            for side in ("ours", "vllm", "hf")}
    if best["vllm"]:
        ratios["best vs best"] = say(verdict, f"extra, best vs best: {best['ours']} / {best['vllm']}",
                                     fig(best["ours"], tok_s[best["ours"]]["median"]),
                                     fig(best["vllm"], tok_s[best["vllm"]]["median"]), VLLM_RATIO_TARGET, like=False)
    if best["hf"]:
        ratios["hf"] = say(verdict, f"ours eager / best transformers ({best['hf']}, eager)",
                           fig("ours eager", tok_s["ours eager"]["median"]),
                           fig(best["hf"], tok_s[best["hf"]]["median"]), HF_RATIO_TARGET)
    mfu = {k: say(verdict, f"{k} MFU (of the {args.dtype} compute limit)", fig(k, tok_s[k]["median"]),
                  limit_fig, MFU_TARGET, percent=True) for k in tok_s if k.startswith("ours")}

    weight_bytes = machine.decode_weight_bytes(shape, args.dtype)
    print(f"\nbatch-1 decode ({weight_bytes / 1e6:.0f} MB of weights read per token); the share is of the sum "
          f"probe's median ({bandwidth:.1f} GB/s), in brackets of the copy probe's ({probes['copy']['median']:.1f}):")
    b1 = {name: spread(v) for name, v in batch1.items() if v}
    share = {}
    for name, t in b1.items():
        moved = verdicts.Figure(weight_bytes * t["median"] / 1e9, devices[name], label=f"{name} weight GB/s")
        share[name] = say(verdict,
                          f"  {name:<14} {t['median']:6.1f} tok/s ({t['min']:.1f}-{t['max']:.1f}) share",
                          moved, verdicts.Figure(bandwidth, device, label=f"sum probe of {device}"), BANDWIDTH_TARGET,
                          percent=True)
        if share[name] is not None:
            fastest = max(probes["sum"]["max"], probes["copy"]["max"])
            print(f"  {'':<14} ({100 * moved.value / probes['copy']['median']:.0f}% of the copy probe's median, "
                  f"{100 * moved.value / fastest:.0f}% of the fastest probe call, {fastest:.1f} GB/s)")
    if any(v is not None and v > 1 for v in share.values()):
        print("  a share above 100% means the probes ran slower than the engines did (a busy machine): rerun quieter")
    for mode in ("eager", "compiled"):
        if f"ours {mode}" in b1 and f"vllm {mode}" in b1:
            say(verdict, f"batch-1 ours {mode} / vLLM {mode}",
                fig(f"ours {mode}", b1[f"ours {mode}"]["median"]), fig(f"vllm {mode}", b1[f"vllm {mode}"]["median"]),
                None)

    print("\nstart-up of a new process (seconds from launch to ready to serve / to the first token; load: the "
          "engine's constructor; resident memory after load):")
    for (name, condition), s in starts.items():
        print(f"  {name:<14} {condition:<24} ready {s['ready_s']:6.1f}  first token {s['first_token_s']:6.1f}  "
              f"load {s['load_s']:6.1f}  RSS {s['rss_mib']:6.0f} MiB  caches: {s['cache_state']}")
    cold = {}
    for condition in ("eager", "compiled, caches cold", "compiled, caches warm"):
        mode = condition.split(",")[0]
        pair = [starts.get((f"{side} {mode}", condition)) for side in ("ours", "vllm")]
        if all(pair):
            dev = [devices.get(f"{side} {mode}", "?") for side in ("ours", "vllm")]
            cold[condition] = say(verdict, f"first token, ours / vLLM ({condition})",
                                  verdicts.Figure(pair[0]["first_token_s"], dev[0], condition, "ours"),
                                  verdicts.Figure(pair[1]["first_token_s"], dev[1], condition, "vLLM"),
                                  COLD_START_TARGET, at_least=False)

    ov = None if args.skip_overhead else workload.decode_overhead(args.model, args.dtype, args.device, args.seed + 1)
    if ov:
        print(f"decode step at batch 32 ({ov['steps']} pure-decode steps): {ov['total_ms']:.2f} ms total, "
              f"{ov['forward_ms']:.2f} ms forward, outside-forward share {100 * ov['share']:.1f}%; "
              f"target <= {100 * OVERHEAD_TARGET:g}%: {verdicts.outcome(ov['share'] <= OVERHEAD_TARGET, quiet)}; "
              f"the step observer (its record) {ov['observer_us']:.0f} us per step")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n\nsummary:")
    print("\n".join(summary.summary_lines(args.model, args.dtype, machine.run_tag(info), tok_s, b1, share, starts,
                                         devices)))

    def r3(x):
        return None if x is None else round(x, 3)

    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "machine": info, "quiet_at_start": quiet.as_dict(),
        "repeats": args.repeats, "num_requests": n,
        "quick": args.quick,
        "tok_s": {k: {q: round(v, 2) for q, v in t.items()} for k, t in tok_s.items()},
        "returned_tokens": returned, "requested_tokens": requested, "devices": devices, "engine_settings": settings,
        "ratio_to_vllm": {k: r3(v) for k, v in ratios.items() if k != "hf"}, "ratio_to_hf": r3(ratios.get("hf")),
        "mfu": {k: r3(v) for k, v in mfu.items()}, "matmul_peak_gflops": round(peak, 1),
        "bandwidth_gbs": {m: {q: round(probes[m][q], 2) for q in ("median", "min", "max")} for m in ("sum", "copy")},
        "bandwidth_probe_mib": probes["sizes_mib"], "share_against": "sum probe median",
        "workload_tflop": round(flops / 1e12, 4), "compute_limit_tok_s": round(limit, 1),
        "batch1_tok_s": {k: {q: round(v, 2) for q, v in t.items()} for k, t in b1.items()},
        "batch1_bandwidth_share": {k: r3(v) for k, v in share.items()},
        "start": {f"{k} ({c})": {**{q: round(s[q], 2) for q in ("ready_s", "first_token_s", "load_s", "rss_mib")},
                                 "memory_mib": s.get("memory_mib"), "cache_state": s["cache_state"]}
                  for (k, c), s in starts.items()},
        "first_token_ratio_to_vllm": {k: r3(v) for k, v in cold.items()},
        "greedy_match": {k: f"{a}/{b}" for k, (a, b) in match.items()},
        "decode_step_overhead_share_b32": None if ov is None else round(ov["share"], 4),
        "decode_step_ms_b32": None if ov is None else round(ov["total_ms"], 3),
        "observer_us_per_step": None if ov is None else round(ov["observer_us"], 1), "errors": errors}))


if __name__ == "__main__":
    main()
