"""`python -m runner_core tune`: a sweep from the command line, without the workbench (a RunnerBackend in
this process), printing each repeat as it is measured, the points, the recommendation and the frontier."""

from __future__ import annotations

import argparse
import json
import math

from runner_core.tuning.request_metrics import Target
from runner_core.tuning.space import SweepSpace
from runner_core.tuning.sweep import RunnerBackend, TuneProgress, TuneResult, tune
from runner_core.tuning.workload import Arrivals, Lengths, Workload

SCHEDULER_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _range(text: str) -> Lengths:
    values = _ints(text)
    if len(values) == 1:
        return Lengths.fixed(values[0])
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"a length is N or LOW,HIGH, got {text!r}")
    return Lengths.uniform(*values)


def _target(text: str) -> Target:
    metric, sep, limit = text.partition("<=")
    try:
        return Target(metric.strip(), float(limit)) if sep else Target(limit=float(metric))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (write the target as METRIC<=MS, e.g. tpot_p99_ms<=100)") from None


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="sweep concurrency and scheduler knobs under a latency target",
                       description=__doc__)
    p.add_argument("--model", required=True, help="local Hugging Face directory or preset")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-mib", type=int, default=None, help="KV pool size (default: what memory allows)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--requests", type=int, default=32, help="requests per run")
    p.add_argument("--prompt-len", type=_range, default=Lengths.uniform(16, 128), help="N or LOW,HIGH tokens")
    p.add_argument("--output-len", type=_range, default=Lengths.uniform(16, 64), help="N or LOW,HIGH tokens")
    p.add_argument("--dataset", default=None, help="a JSONL or ShareGPT JSON file of prompts")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests/s "
                   "(gamma with --burstiness); default: each concurrency's requests kept in flight")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--concurrency", type=_ints, default=None, help="e.g. 1,4,16 (default: from the KV capacity)")
    for knob in SCHEDULER_KNOBS:
        p.add_argument(f"--{knob.replace('_', '-')}", type=_ints, default=None, help=f"{knob} values to try")
    p.add_argument("--compile", action="store_true", help="a last stage with torch.compile off and on")
    p.add_argument("--target", type=_target, default=Target(), help="METRIC<=MS (default tpot_p99_ms<=100)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--results", default=None, help="a .csv or .json(l) file; a re-run resumes from it")
    p.add_argument("--json", action="store_true", help="end with the result as one JSON object")


def _progress(p: TuneProgress) -> None:
    row = p.last_row
    eta = "" if p.eta_s is None else f", about {math.ceil(p.eta_s)} s left"
    print(f"[{p.stage} {min(p.point_index + 1, p.points_total)}/{p.points_total} repeat {p.repeat + 1}] "
          f"{row.get('label', '')}: {row.get('output_throughput', 0):.1f} tok/s{eta}", flush=True)


def _print_result(result: TuneResult) -> None:
    metric = result.target.metric
    print(f"\n{'point':<44}{'tok/s':>9}{'range':>18}{metric:>16}  target")
    for p in result.points:
        tok_s = [p[k].get("output_throughput") or 0.0 for k in ("median", "min", "max")]
        spread = f"[{tok_s[1]:.1f}, {tok_s[2]:.1f}]"
        value = p["median"].get(metric)
        print(f"{p['label'][:43]:<44}{tok_s[0]:>9.1f}{spread:>18}{float('nan') if value is None else value:>16.1f}  "
              f"{'pass' if p['met'] else 'fail'}")
    rec = result.recommendation
    print(f"\nrecommended: {rec['label']} ({result.why}); margin {rec['margin']:.0%}, ties: {len(rec['ties'])}"
          if rec else f"\nno recommendation: {result.why}")
    print(f"sweep overhead: {result.overhead:.1%} of {result.timings['wall_s']:.0f} s")


def run(args) -> int:
    arrivals = Arrivals.burst() if args.rate is None else (
        Arrivals.poisson(args.rate) if args.burstiness == 1.0 else Arrivals.gamma(args.rate, args.burstiness))
    workload = Workload(num_requests=args.requests, arrivals=arrivals, prompt_len=args.prompt_len,
                        output_len=args.output_len, dataset=args.dataset)
    config = {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len}
    if args.kv_cache_mib:
        config["kv_cache_memory"] = args.kv_cache_mib << 20
    backend = RunnerBackend(config)
    try:
        knobs = {k: getattr(args, k) for k in SCHEDULER_KNOBS if getattr(args, k)}
        space = None if not (args.concurrency or knobs or args.compile) else SweepSpace(  # None: the proposed one
            concurrency=args.concurrency, scheduler=knobs, engine={"compile": [False, True]} if args.compile else {})
        result = tune(space, workload, args.target, backend=backend, repeats=args.repeats, warmup=args.warmup,
                      results=args.results, on_progress=_progress)
    finally:
        backend.close()
    _print_result(result)
    if args.json:
        print(json.dumps({"points": result.points, "recommendation": result.recommendation,
                          "frontier": result.frontier, "overhead": result.overhead, "timings": result.timings},
                         default=str))
    return 0
