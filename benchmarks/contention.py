"""Contention benchmark: throughput on the idle machine and beside one competing busy process.

Five settings, each in a fresh process per round (OpenMP's wait policy is read when torch loads):
  spinning           torch's default thread count, fixed, and libgomp's default wait (waiting threads
                     spin 300,000 iterations: GOMP_SPINCOUNT=300000): what ran before runner_core chose
  passive            torch's default thread count, fixed, OpenMP threads waiting passively
                     (OMP_WAIT_POLICY=PASSIVE)
  adaptive           runner_core's defaults: its wait policy (runner_core/openmp_env.py) and the thread
                     count adapted to load from the engine's own steps (runner_core/engine/threads.py)
  adaptive-spinning  the adaptive count with libgomp's default wait
  adaptive-bounded   the adaptive count, waiting threads spinning BOUNDED_SPIN iterations (tens of µs, the gaps
                     between a step's ops) before they sleep
Each process loads the model, runs the workload once to warm up, then once idle and once beside a busy
process (a Python loop it starts and kills after the run); the settings' order and idle/busy order
alternate between rounds. The workload: benchmarks/workload.py make_workload (greedy, EOS ignored).
Reported per model, setting and load: useful tokens/s, median and range over the rounds; each
setting's busy / idle (the medians); every setting against spinning; the adaptive runner's thread
count after each run. Target (reported, never enforced): beside one busy process, throughput >= 50%
of the idle machine's. "Idle" means no process of ours competes, so other users of a shared machine must
not either: the verdict is refused ("refused: machine not quiet (load X on N cores)") when the 1-minute
load average at the start exceeds half a process per core (benchmarks/verdicts.py), or when other
processes kept more than half the cores busy during one of the setting's runs (the machine's busy CPU
time over the run less this process's and our busy competitor's, per second: printed for every run). The
last stdout line is one JSON object with every figure.

Run:  make bench-contention    or
      .venv/bin/python benchmarks/contention.py [--models small-llama --requests 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import runner_core  # noqa: F401  (before torch: runner_core sets OpenMP's wait policy as torch loads)

try:  # run as a script: benchmarks/ is on sys.path
    import machine
    import verdicts
    import workload
except ImportError:  # run as `python -m benchmarks.contention`
    from benchmarks import machine, verdicts, workload

BUSY_TARGET = 0.5  # busy throughput / idle throughput
SPIN = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default spin, stated so that runner_core leaves it
BOUNDED_SPIN = {"GOMP_SPINCOUNT": "10000"}
# setting -> (environment, adaptive thread count)
SETTINGS = {"spinning": (SPIN, False), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False), "adaptive": ({}, True),
            "adaptive-spinning": (SPIN, True), "adaptive-bounded": (BOUNDED_SPIN, True)}
LOADS = ("idle", "busy")


# ---- the child: one setting, one round ------------------------------------------------------------
def child(spec: dict) -> dict:
    import torch

    from runner_core import ModelRunner

    fixed = {} if SETTINGS[spec["setting"]][1] else {"cpu_threads": torch.get_num_threads()}
    runner = ModelRunner({"model": spec["model"], "device": "cpu", "dtype": spec["dtype"]}, **fixed).load_model()
    info = runner.model_info()
    max_len = min(info["max_model_len"], 512)
    reqs = workload.make_workload(spec["requests"], vocab_size=info["vocab_size"],
                                  prompt_len=(8, max_len // 4), output_len=(16, max_len // 4))
    workload.run_ours(runner, reqs)  # warm-up; the adaptive runner's first choice
    out = {"dtype": info["dtype"], "useful_tokens": workload.useful_tokens(reqs), "threads": info["threads"]}
    for load in spec["loads"]:
        competitor = None
        if load == "busy":
            competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.2)  # running before the workload starts
        busy, own = machine.busy_cpu_seconds(), time.process_time()
        theirs = -machine.cpu_seconds(competitor.pid) if competitor else 0.0  # our competitor's CPU is not others'
        try:
            seconds, _ = workload.run_ours(runner, reqs)
        finally:
            if competitor is not None:
                theirs += machine.cpu_seconds(competitor.pid)
                competitor.kill()
                competitor.wait()
        out[load] = workload.useful_tokens(reqs) / seconds
        if busy is not None:  # the cores other processes kept busy during the run
            others = machine.busy_cpu_seconds() - busy - (time.process_time() - own) - theirs
            out[f"{load}_others_cores"] = max(0.0, others) / seconds
        out[f"{load}_threads"] = runner.model_info()["threads"]["count"]
    out["threads_why"] = runner.model_info()["threads"]["why"]
    runner.shutdown()
    return out


def run_child(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(SETTINGS[spec["setting"]][0])
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                         text=True)
    lines = [x for x in res.stdout.splitlines() if x.startswith("CHILD ")]
    if res.returncode or not lines:
        raise RuntimeError(f"the {spec['setting']} run failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("CHILD "):])


# ---- the parent --------------------------------------------------------------------------------------
def busy_over_idle_verdict(ratio: float, start: verdicts.Quiet, results: list[dict]) -> str:
    """met / NOT met for a setting's busy / idle, or refused: the machine was not quiet at the start, or
    other processes (our busy competitor aside) kept more than QUIET_LOAD_PER_CORE of its cores busy
    during one of the setting's runs."""
    during = [verdicts.Quiet(x[f"{load}_others_cores"], start.cores, f"round {i + 1}'s {load} run")
              for i, x in enumerate(results) for load in LOADS if x.get(f"{load}_others_cores") is not None]
    return verdicts.outcome(ratio >= BUSY_TARGET, start, *during)


def bench_model(model: str, args, start: verdicts.Quiet) -> dict:
    runs = {s: [] for s in args.settings}
    for r in range(args.rounds):
        for setting in (args.settings if r % 2 == 0 else args.settings[::-1]):
            spec = {"model": model, "dtype": args.dtype, "requests": args.requests, "setting": setting,
                    "loads": list(LOADS) if r % 2 == 0 else list(LOADS)[::-1]}
            res = run_child(spec)
            runs[setting].append(res)
            others = " ".join(f"{load} {res[f'{load}_others_cores']:.2f}" for load in LOADS
                              if res.get(f"{load}_others_cores") is not None)
            print(f"  round {r + 1} {setting:17s} idle {res['idle']:7.1f} tok/s ({res['idle_threads']} threads), "
                  f"busy {res['busy']:7.1f} tok/s ({res['busy_threads']} threads); cores others kept busy: "
                  f"{others or 'unknown'}", flush=True)
    first = next(iter(runs.values()))[0]
    fig = {"model": model, "dtype": first["dtype"], "useful_tokens": first["useful_tokens"],
           "usable_cores": first["threads"]["usable_cores"], "usable_why": first["threads"]["usable_why"],
           "wait_policy": {s: results[0]["threads"]["omp_wait_policy"] for s, results in runs.items()}}
    print(f"{model} ({first['dtype']}), {args.requests} requests, {first['useful_tokens']} useful tokens; usable "
          f"cores {fig['usable_cores']} ({fig['usable_why']}); OpenMP wait: {fig['wait_policy']}; useful tok/s, "
          f"median [min-max] of {args.rounds}:")
    for setting, results in runs.items():
        for load in LOADS:
            values = [x[load] for x in results]
            fig[f"{setting}_{load}"] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        ratio = fig[f"{setting}_busy_over_idle"] = fig[f"{setting}_busy"]["median"] / fig[f"{setting}_idle"]["median"]
        verdict = fig[f"{setting}_verdict"] = busy_over_idle_verdict(ratio, start, results)
        fig[f"{setting}_others_cores"] = [x.get(f"{load}_others_cores") for x in results for load in LOADS]
        print(f"  {setting:17s} " + ", ".join(f"{load} {fig[f'{setting}_{load}']['median']:7.1f} "
                                            f"[{fig[f'{setting}_{load}']['min']:.1f}-{fig[f'{setting}_{load}']['max']:.1f}]"
                                            for load in LOADS)
              + f"; busy / idle {ratio:.2f}, target >= {BUSY_TARGET:.2f}: {verdict}")
    for setting in [s for s in runs if s != "spinning"] if "spinning" in runs else []:
        for load in LOADS:
            fig[f"{setting}_over_spinning_{load}"] = (fig[f"{setting}_{load}"]["median"]
                                                      / fig[f"spinning_{load}"]["median"])
        print(f"  {setting} / spinning: idle {fig[f'{setting}_over_spinning_idle']:.2f}x, "
              f"busy {fig[f'{setting}_over_spinning_busy']:.2f}x")
    if "adaptive" in runs:
        fig["adaptive_threads"] = [f"{load}:{x[f'{load}_threads']}" for x in runs["adaptive"] for load in LOADS]
        print(f"  adaptive's thread count after each run: {' '.join(fig['adaptive_threads'])}; its last reason: "
              f"{runs['adaptive'][-1]['threads_why']}")
        if "spinning" in runs:
            fig["adaptive_busy_over_spinning_idle"] = fig["adaptive_busy"]["median"] / fig["spinning_idle"]["median"]
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-speaker", help="comma-separated presets or model directories")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", type=lambda v: v.split(","), default=list(SETTINGS),
                    help=f"comma-separated, of {','.join(SETTINGS)} (the ratios to spinning need spinning)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if set(args.settings) - set(SETTINGS):
        ap.error(f"--settings: unknown {sorted(set(args.settings) - set(SETTINGS))}; choose of {list(SETTINGS)}")
    if args.child:
        print("CHILD " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    start = verdicts.quiet_at_start()  # before this benchmark runs anything of its own
    info = machine.machine_info("cpu")
    print(machine.describe(info))
    print(f"load average before: {start.load:.2f} on {start.cores} cores (other processes on this machine; "
          f"quiet up to {start.limit:.2f}: {'quiet' if start.ok else 'NOT quiet, verdicts refused'})")
    figures = {"machine": info, "rounds": args.rounds, "load_average_before": start.load,
               "quiet_at_start": start.as_dict(),
               "models": [bench_model(m, args, start) for m in args.models.split(",")],
               "load_average_after": os.getloadavg()[0]}
    print(f"load average after: {figures['load_average_after']:.2f}; {machine.run_tag(info)}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
