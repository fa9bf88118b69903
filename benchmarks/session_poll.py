"""The cost of polling a Session's metrics series, as a UI timer does.

tiny-llama (float32) in a workbench.Session that samples a metrics row after every engine step
(sample_interval 0); a random workload fills the series, then `session.metrics.poll(cursor)` is timed:
  empty poll   the cursor at the end: what a timer gets when nothing happened since its last call
  full poll    cursor 0: every row the bounded history holds
Each figure is the median (and range) over --rounds rounds of --calls calls, in microseconds per
call. The budget a UI timer can afford, 100 us per empty poll, is reported, never enforced.
The last stdout line is one JSON object with every figure.

Run:  make bench-poll    or    .venv/bin/python benchmarks/session_poll.py [--rounds 7] [--calls 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from runner_core.models.presets import ensure_preset
from workbench import Session

EMPTY_POLL_BUDGET_US = 100.0
MODEL = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 4 << 20, "max_model_len": 256}


def per_call_us(fn, calls: int, rounds: int) -> dict:
    """Median, min and max over `rounds` of the mean time of one call in `calls` calls, in us."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(1e6 * (time.perf_counter() - t0) / calls)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=32, help="requests of the workload that fills the series")
    ap.add_argument("--history", type=int, default=3000, help="rows the series keeps (Session's default)")
    args = ap.parse_args()

    ensure_preset("tiny-llama")
    session = Session(history=args.history, sample_interval=0.0)
    try:
        session.load_model("tiny-llama", **MODEL)
        handles = session.run_workload(args.requests, max_tokens=(8, 64), seed=0)
        reasons = [h.result(timeout=300).finish_reason for h in handles]
        failed = [r for r in reasons if r not in ("stop", "length")]
        if failed:
            raise SystemExit(f"the workload did not finish cleanly: {failed}")
        rows, cursor = session.metrics.poll(0)
        empty = per_call_us(lambda: session.metrics.poll(cursor), args.calls, args.rounds)
        full = per_call_us(lambda: session.metrics.poll(0), args.calls, args.rounds)
    finally:
        session.close()

    met = empty["median"] <= EMPTY_POLL_BUDGET_US
    print(f"load average {os.getloadavg()[0]:.2f}; series of {len(rows)} rows (history {args.history}) "
          f"after {args.requests} requests")
    print(f"empty poll: {empty['median']:.2f} us per call (range {empty['min']:.2f}-{empty['max']:.2f}) -> "
          f"budget {EMPTY_POLL_BUDGET_US:g} us {'met' if met else 'NOT met'}")
    print(f"full poll ({len(rows)} rows): {full['median']:.1f} us per call (range {full['min']:.1f}-{full['max']:.1f})")
    print(json.dumps({"rows": len(rows), "history": args.history, "rounds": args.rounds, "calls": args.calls,
                      "empty_poll_us": {k: round(v, 3) for k, v in empty.items()},
                      "full_poll_us": {k: round(v, 3) for k, v in full.items()},
                      "empty_poll_budget_us": EMPTY_POLL_BUDGET_US, "empty_poll_budget_met": met}))


if __name__ == "__main__":
    main()
