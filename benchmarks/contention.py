"""Contention benchmark: throughput on the idle machine and beside one competing busy process.

Two runners of one model in this process: "fixed" runs every step on torch's default thread count
(cpu_threads set to it), "adaptive" leaves cpu_threads unset (runner_core/engine/threads.py: the
count timed on the engine's own steps and re-checked). Each round runs the workload (greedy, EOS
ignored; benchmarks/workload.py make_workload) on each runner idle and then beside a busy process (a
Python loop this script starts and kills after the run), the runners' order alternating between
rounds. Reported per runner and load: useful tokens/s, median and range over the rounds; the ratio
busy / idle of each runner and adaptive / fixed beside the busy process; the thread count the adaptive
runner ended on. Target (reported, never enforced): beside one busy process, throughput >= 50% of the
idle machine's. "Idle" means no process of ours competes: other users of a shared machine still do
(the load average is printed). OpenMP's wait policy is read when torch loads: set OMP_WAIT_POLICY
before running to compare policies. The last stdout line is one JSON object with every figure.

Run:  make bench-contention    or    .venv/bin/python benchmarks/contention.py [--model small-llama] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from runner_core import ModelRunner
from runner_core.engine.threads import wait_policy

try:  # run as a script: benchmarks/ is on sys.path
    import machine
    import workload
except ImportError:  # run as `python -m benchmarks.contention`
    from benchmarks import machine, workload

BUSY_TARGET = 0.5  # busy throughput / idle throughput


def busy_process() -> subprocess.Popen:
    """A competing process that keeps one core busy until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)  # running before the workload starts
    return proc


def run_once(runner: ModelRunner, reqs: list, busy: bool) -> float:
    """Useful tokens/s of one run of the workload, beside a busy process or not."""
    competitor = busy_process() if busy else None
    try:
        seconds, _ = workload.run_ours(runner, reqs)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return workload.useful_tokens(reqs) / seconds


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-speaker", help="a preset or model directory (default tiny-speaker)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    info = machine.machine_info("cpu")
    default_threads = torch.get_num_threads()
    base = {"model": args.model, "device": "cpu", "dtype": args.dtype}
    runners = {"fixed": ModelRunner(base, cpu_threads=default_threads).load_model(),
               "adaptive": ModelRunner(base).load_model()}
    model = runners["adaptive"].model_info()
    max_len = min(model["max_model_len"], 512)
    reqs = workload.make_workload(args.requests, vocab_size=model["vocab_size"],
                                  prompt_len=(8, max_len // 4), output_len=(8, max_len // 8))
    threads = model["threads"]
    print(machine.describe(info))
    print(f"model {args.model} ({model['dtype']}), {len(reqs)} requests, {workload.useful_tokens(reqs)} useful "
          f"tokens; torch's default threads {default_threads}; usable cores {threads['usable_cores']} "
          f"({threads['usable_why']}); OpenMP wait policy {wait_policy()}; load average before "
          f"{os.getloadavg()[0]:.2f}")
    for runner in runners.values():
        workload.run_ours(runner, reqs)  # warm-up: first-call costs out of the figures

    rates = {(name, load): [] for name in runners for load in ("idle", "busy")}
    ended_on = []
    for r in range(args.rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            for load in ("idle", "busy"):
                rate = run_once(runners[name], reqs, load == "busy")
                rates[name, load].append(rate)
                count = runners[name].model_info()["threads"]["count"]
                if name == "adaptive":
                    ended_on.append(f"{load}:{count}")
                print(f"  round {r + 1}: {name:8s} {load}: {rate:8.1f} tok/s ({count} threads)", flush=True)

    figures = {"machine": info, "model": args.model, "dtype": model["dtype"], "requests": len(reqs),
               "default_threads": default_threads, "usable_cores": threads["usable_cores"],
               "omp_wait_policy": wait_policy(), "adaptive_threads": ended_on,
               "load_average_after": os.getloadavg()[0]}
    print(f"useful tok/s, median [min-max] of {args.rounds} rounds ({machine.run_tag(info)}):")
    for (name, load), values in rates.items():
        s = figures[f"{name}_{load}"] = summarise(values)
        print(f"  {name:8s} {load}: {s['median']:8.1f} [{s['min']:.1f}-{s['max']:.1f}]")
    for name in runners:
        ratio = figures[f"{name}_busy_over_idle"] = (figures[f"{name}_busy"]["median"]
                                                     / figures[f"{name}_idle"]["median"])
        verdict = "meets" if ratio >= BUSY_TARGET else "misses"
        print(f"  {name}: busy / idle {ratio:.2f} ({verdict} the target >= {BUSY_TARGET:.2f})")
    for load in ("idle", "busy"):
        ratio = figures[f"adaptive_over_fixed_{load}"] = (figures[f"adaptive_{load}"]["median"]
                                                          / figures[f"fixed_{load}"]["median"])
        print(f"  adaptive / fixed {load}: {ratio:.2f}")
    print(f"  adaptive's thread count after each run: {' '.join(ended_on)}; now: "
          f"{runners['adaptive'].model_info()['threads']['why']}")
    for runner in runners.values():
        runner.shutdown()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
