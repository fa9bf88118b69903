"""The what-if simulator measured on this machine: its calibration, its errors against the real engine, its speed,
and published GPU figures against its bands.

  calibration  runner_core.simulator.calibrate on `--model` and `--second-model` (two depths: per-layer and per-step
               fixed costs separate): this CPU's peaks and bandwidth, the engine's steps over FIT_SHAPES (`--repeats`
               times, median per shape), the fitted coefficients and the fit's own error; saved where
               Simulation(hardware="cpu") reads it (`--calibration`, default $RUNNER_WORKBENCH_CACHE/whatif/...)
  steps        the real engine's steps over HELD_OUT_SHAPES (no D, K or chunk size of the fit) on `--model`, against
               the cost model: median and p90 relative error, by step kind (target: median <= 10%)
  workloads    validate_workloads: capacity = the real engine's burst rate, measured and simulated (target: within
               15%, a verdict of its own); Poisson arrivals at 30/60/85% of it on the real and the simulated runner
               (same settings and seed, in turns, `--repeats` rounds): median TTFT, median TPOT, output throughput
               and their errors (target: <= 15% up to 85% load)
  70B          llama-3-70b on 8 x H200 (TP=8, typical band): a 1,000-request Poisson workload simulated, wall
               seconds (target: <= 10 s)
  published    compare_published(): each published figure, the predicted low/typical/high band, inside or not
The machine's load average is printed before and after (a shared machine moves the measured figures). The targets
are reported, never enforced, each with its verdict ("verdicts" in the JSON: steps, capacity, below and near
saturation, 70B); the last stdout line is one JSON object with every figure.

Run:  make bench-whatif    or    .venv/bin/python benchmarks/whatif.py [--quick] [--no-published]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import runner_core  # noqa: F401  (before torch: runner_core sets OpenMP's wait policy as torch loads)

try:  # run as a script: benchmarks/ is on sys.path
    import machine
except ImportError:  # run as `python -m benchmarks.whatif`
    from benchmarks import machine

TARGETS = {"step_median_error": 0.10, "capacity_error": 0.15, "workload_error": 0.15, "seconds_70b": 10.0}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--second-model", default="tiny-llama", help="the second depth of the calibration")
    ap.add_argument("--dtype", default=None, help="default: the engine's choice on this CPU (auto)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=48, help="requests of each validation workload")
    ap.add_argument("--calibration", default=None, help="where to save the calibration (default: the cache)")
    ap.add_argument("--no-published", action="store_true", help="skip compare_published()")
    ap.add_argument("--published-requests", type=int, default=None,
                    help="at most this many requests per figure (default: each figure's settled_requests)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 24-request workloads")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.num_requests = 1, 24
    return args


def pct(x) -> str:
    return "   n/a" if x is None else f"{100 * x:5.1f}%"


def verdict(value, target) -> str:
    return "n/a" if value is None else ("met" if value <= target else "MISSED")


def verdicts(steps: dict, workloads: dict, big: dict | None = None) -> dict:
    """Each target's verdict, apart: the held-out steps, the capacity (a saturated burst, which the loads below
    never reach), the loads below and near saturation, the 70B run's seconds."""
    out = {"steps": verdict(steps["median_error"], TARGETS["step_median_error"]),
           "capacity": verdict(workloads["capacity_rps"]["error"], TARGETS["capacity_error"])}
    for side in ("below_saturation", "near_saturation"):
        out[side] = verdict(workloads[side]["max"], TARGETS["workload_error"])
    if big is not None:
        out["seconds_70b"] = verdict(big["seconds"], TARGETS["seconds_70b"])
    return out


def calibration_table(cal) -> None:
    hw, c = cal.hardware, cal.coefficients
    print(f"\n== calibration ({', '.join(cal.models)}, {cal.dtype}, {cal.settings['cpu_threads']} threads, "
          f"{len(cal.rows)} step shapes, {cal.seconds:.0f} s)")
    print(f"  {hw.name}: float32 {hw.peak_flops['float32'] / 1e9:.0f} GFLOP/s, bfloat16 "
          f"{hw.peak_flops['bfloat16'] / 1e9:.0f} GFLOP/s, read bandwidth {hw.mem_bandwidth / 1e9:.1f} GB/s, "
          f"RAM {hw.memory_bytes / 2**30:.0f} GiB")
    print(f"  efficiencies: compute {c.compute_efficiency:.3f}, memory {c.memory_efficiency:.3f}, attention "
          f"{c.attention_efficiency:.3f}, decode attention {c.decode_attention_efficiency:.3f};  fixed: step "
          f"{c.step_s * 1e3:.3f} ms, layer {c.layer_s * 1e6:.1f} us, sequence {c.seq_s * 1e6:.1f} us, token "
          f"{c.token_s * 1e6:.2f} us")
    for name, e in [("all", cal.fit_error), *cal.fit_error["by_model"].items()]:
        print(f"  fit error {name:12s} median {pct(e['median_error'])}  p90 {pct(e['p90_error'])}  n={e['n']}")


def steps_table(steps: dict) -> None:
    print(f"\n== held-out steps (target: median <= {TARGETS['step_median_error']:.0%}: "
          f"{verdict(steps['median_error'], TARGETS['step_median_error'])})")
    for name, e in [("all", steps), *steps["by_kind"].items()]:
        print(f"  {name:8s} median {pct(e['median_error'])}  p90 {pct(e['p90_error'])}  n={e['n']}")


def workloads_table(w: dict) -> None:
    cap = w["capacity_rps"]
    print(f"\n== workloads ({w['workload']}); capacity {cap['measured']:.2f} requests/s measured, "
          f"{cap['simulated']:.2f} simulated ({pct(cap['error'])}; target <= {TARGETS['capacity_error']:.0%}: "
          f"{verdict(cap['error'], TARGETS['capacity_error'])})")
    print(f"  {'load':>5s}  {'figure':10s} {'measured':>10s} {'simulated':>10s} {'error':>7s}")
    for load, figures in w["loads"].items():
        for name, f in figures.items():
            print(f"  {load:5.0%}  {name:10s} {f['measured']:10.2f} {f['simulated']:10.2f} {pct(f['error'])}")
    for side in ("below_saturation", "near_saturation"):
        s = w[side]
        print(f"  {side.replace('_', ' '):17s} (loads {', '.join(f'{x:.0%}' for x in s['loads'])}): largest error "
              f"TTFT {pct(s['ttft'])}, TPOT {pct(s['tpot'])}, throughput {pct(s['throughput'])}  "
              f"(target <= {TARGETS['workload_error']:.0%}: {verdict(s['max'], TARGETS['workload_error'])})")


def simulate_70b() -> dict:
    """llama-3-70b on 8 x H200, TP=8: 1,000 Poisson requests simulated; the load (config read, pool planned) and
    the run (requests drawn, every step scheduled and timed, outputs streamed) timed apart."""
    from runner_core.simulator import SimulatedRunner, Simulation
    from runner_core.tuning import Arrivals, Lengths, Workload, run_workload

    workload = Workload(num_requests=1000, arrivals=Arrivals.poisson(20.0), prompt_len=Lengths.uniform(128, 2048),
                        output_len=Lengths.uniform(64, 512), seed=0)
    t = time.perf_counter()
    runner = SimulatedRunner({"model": "llama-3-70b", "tensor_parallel_size": 8, "max_model_len": 4096},
                             Simulation(hardware="h200")).load_model()
    load_s = time.perf_counter() - t
    try:
        t = time.perf_counter()
        s = run_workload(runner, workload).summary
        run_s = time.perf_counter() - t
        steps = runner.engine.observer.num_steps
    finally:
        runner.shutdown()
    print(f"\n== llama-3-70b on 8 x H200 (TP=8, typical band), {workload.label}")
    print(f"  simulated in {run_s:.2f} s wall ({steps} steps; the load before it {load_s:.2f} s) (target <= "
          f"{TARGETS['seconds_70b']:g} s: {verdict(run_s, TARGETS['seconds_70b'])}); {s['completed']} completed in "
          f"{s['duration_s']:.1f} simulated s: {s['output_throughput']:.0f} output tok/s, TTFT p50 "
          f"{s['ttft_p50_ms']:.0f} ms, TPOT p50 {s['tpot_p50_ms']:.1f} ms")
    return {"seconds": run_s, "load_seconds": load_s, "steps": steps, "workload": workload.label,
            "completed": s["completed"], "simulated_duration_s": s["duration_s"],
            "output_throughput": s["output_throughput"], "ttft_p50_ms": s["ttft_p50_ms"],
            "tpot_p50_ms": s["tpot_p50_ms"]}


def published(num_requests: int | None) -> list[dict]:
    try:
        from runner_core.simulator.published import compare_published
    except ImportError as e:
        print(f"\n== published figures: skipped ({e})")
        return []
    rows = compare_published(num_requests)
    print("\n== published GPU figures against the predicted band (low / typical / high)")
    for r in rows:
        if r["error"]:
            print(f"  {r['figure']}: not simulated ({r['error'][:120]})")
            continue
        print(f"  {r['figure']}: {r['metric']} published {r['published']:.0f}, predicted {r['predicted_low']:.0f} / "
              f"{r['predicted_typical']:.0f} / {r['predicted_high']:.0f}: {'inside' if r['inside'] else 'OUTSIDE'} "
              f"(typical / published {r['ratio']:.2f})")
    return [{k: r[k] for k in ("figure", "metric", "published", "predicted_low", "predicted_typical",
                               "predicted_high", "inside", "ratio", "error")} for r in rows]


def main(argv=None) -> None:
    from runner_core.model_runner import ModelRunner
    from runner_core.simulator.calibrate import HELD_OUT_SHAPES, calibrate, measure_steps
    from runner_core.simulator.validate import validate_steps, validate_workloads

    args = parse_args(argv)
    info = machine.machine_info("cpu")
    print(machine.describe(info))
    load_before = os.getloadavg()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)} ({os.cpu_count()} CPUs)", flush=True)
    t0 = time.perf_counter()
    cal = calibrate(args.model, dtype=args.dtype, repeats=args.repeats, models=[args.second_model],
                    path=args.calibration, progress=lambda m: print(f"  {m}", flush=True))
    calibration_table(cal)
    settings = {"model": args.model, "dtype": cal.dtype, **cal.settings}
    with ModelRunner(settings).load_model() as runner:
        held_out = measure_steps(runner, HELD_OUT_SHAPES, repeats=args.repeats, seed=1)
    steps = validate_steps(cal, held_out)
    steps_table(steps)
    workloads = validate_workloads(cal, num_requests=args.num_requests, repeats=args.repeats,
                                   progress=lambda m: print(f"  {m}", flush=True))
    workloads_table(workloads)
    big = simulate_70b()
    pub = [] if args.no_published else published(args.published_requests)
    load_after = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}; {time.perf_counter() - t0:.0f} s in all; "
          f"{machine.run_tag(info)}")
    print(json.dumps({
        "bench": "whatif", "machine": info, "load_average": {"before": load_before, "after": load_after},
        "seconds": time.perf_counter() - t0, "targets": TARGETS, "verdicts": verdicts(steps, workloads, big),
        "calibration": {"models": cal.models, "dtype": cal.dtype, "settings": cal.settings,
                        "hardware": cal.hardware.name, "peak_flops": cal.hardware.peak_flops,
                        "mem_bandwidth": cal.hardware.mem_bandwidth, "coefficients": cal.coefficients.as_dict(),
                        "fit_error": cal.fit_error, "rows": len(cal.rows), "seconds": cal.seconds},
        "steps": steps, "workloads": {**workloads, "loads": {str(k): v for k, v in workloads["loads"].items()}},
        "llama_3_70b_8xh200": big, "published": pub}))


if __name__ == "__main__":
    main()
