"""Structured outputs benchmark: the cost of the grammar masks per engine step, and the validity of what a
JSON-schema constraint lets through, on a held-out set of schemas.

Model: small-llama (`--model`; random weights, its tokenizer real), float32, eager, `max_num_seqs` = `--batch`
(8). One process, one engine, one warm-up of each side before anything is timed.
  masks     `--batch` requests of `--max-tokens` output tokens, seeded sampling (temperature 1), each with the
            JSON-schema constraint TIMING_SCHEMA (a record of free strings, bounded integers and an array of
            strings: llguidance's masks filled on the helper thread while the forward runs, applied before
            sampling), against the same requests without it (EOS ignored, so that both run the whole length).
            `--repeats` rounds (>= 3), the two sides taking turns, the order alternating each round. Each run's
            figure: the median `total_s` of its steps from `runner.step_metrics` that decoded `--batch`
            sequences and prefilled nothing (a constrained request that completes its grammar early leaves
            the batch: its later steps are not counted); the helper thread's mask fill per constrained step
            beside it. Reported: each side's median and range over the rounds, masked / plain of the
            medians against the target <= 1.10 (issue 41), and each round's own ratio (median and range).
  validity  HELD_OUT: JSON schemas no test uses (strings with length bounds, numbers, integers with bounds,
            enums, booleans, arrays with min/max items, nested objects, required fields, no extra
            properties), each generated with `--seeds` seeds (temperature 1, `--schema-max-tokens`): how many
            finished with `stop`, how many of those `jsonschema.validate` accepts (the target: all of them;
            jsonschema comes with the ui and test extras, through nbformat),
            how many ended with `length` (the grammar not yet complete: not counted as valid) or in error.
The step-time verdict is refused ("refused: machine not quiet (load X on N cores)") when the 1-minute load
average at the start exceeds half a process per core (benchmarks/verdicts.py) or other processes kept more
than half the cores busy during a timed run (the machine's busy CPU time over the run less this process's,
per second: printed for every run). Every figure names the CPU and kernel tier (runner_core.host.machine_name).
The last stdout line is one JSON object of every figure.

Run:  .venv/bin/python benchmarks/structured_outputs.py [--model small-llama] [--batch 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import runner_core  # noqa: F401  (before torch: runner_core sets OpenMP's wait policy as torch loads)

try:  # run as a script: benchmarks/ is on sys.path
    import machine
    import verdicts
except ImportError:  # run as `python -m benchmarks.structured_outputs`
    from benchmarks import machine, verdicts

STEP_TARGET = 1.10  # masked step time / plain step time (issue 41)
PROMPTS = ["Describe the order as JSON:", "Once upon a time", "The record reads", "A list of",
           "Here is the answer:", "User profile:", "The weather today", "Settings file"]
TIMING_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "body": {"type": "string"}, "year": {"type": "integer", "minimum": 1900,
                                                                      "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
    "required": ["title", "body", "year", "tags"], "additionalProperties": False}
S = {"type": "string", "maxLength": 12}  # a short string: the outputs of random weights end within max_tokens
HELD_OUT = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                                "email": S}, "required": ["name", "age"],
               "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {"enabled": {"type": "boolean"}, "beta": {"type": "boolean"},
                                               "level": {"enum": ["low", "mid", "high"]}},
              "required": ["enabled", "level"], "additionalProperties": False},
    "scores": {"type": "object", "properties": {"scores": {"type": "array", "minItems": 2, "maxItems": 4,
                                                           "items": {"type": "integer", "minimum": -5, "maximum": 5}}},
               "required": ["scores"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "street": S, "city": S, "geo": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "geo"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "minLength": 2, "maxLength": 6},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"], "additionalProperties": False},
    "colour": {"enum": ["red", "green", "blue", "cyan"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "measurement": {"type": "object", "properties": {
        "value": {"type": "number", "minimum": 0, "maximum": 1000},
        "unit": {"enum": ["mm", "cm", "m"]}, "ok": {"type": "boolean"}},
        "required": ["value", "unit", "ok"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "kind": {"enum": ["start", "stop", "pause"]}, "at": {"type": "integer", "minimum": 0, "maximum": 86400},
        "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["kind", "at", "note"], "additionalProperties": False},
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "config": {"type": "object", "properties": {
        "name": S, "retries": {"type": "integer", "minimum": 0, "maximum": 5},
        "mode": {"enum": ["fast", "safe"]}, "limits": {"type": "object", "properties": {
            "cpu": {"type": "integer", "minimum": 1, "maximum": 64}, "mem": {"type": "number", "minimum": 0}},
            "required": ["cpu"], "additionalProperties": False}, "debug": {"type": "boolean"}},
        "required": ["name", "mode", "limits"], "additionalProperties": False},
}


def timed_run(runner, params, batch: int) -> dict:
    """One run of the batch: the median step time of its full decode steps, and the cores others kept busy."""
    structured = runner.engine.structured
    n0, fill0 = len(runner.step_metrics), structured.mask_fill_s
    busy, own, start = machine.busy_cpu_seconds(), time.process_time(), time.perf_counter()
    outs = runner.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
    seconds = time.perf_counter() - start
    steps = list(runner.step_metrics)[n0:]
    full = [r.total_s for r in steps if r.num_prefill_tokens == 0 and r.num_decode_tokens == batch]
    out = {"step_ms": 1e3 * statistics.median(full) if full else None, "full_steps": len(full), "steps": len(steps),
           "tokens": sum(len(o.token_ids) for o in outs),
           "finish": {r: sum(o.finish_reason == r for o in outs) for r in {o.finish_reason for o in outs}}}
    if params[0].structured_outputs is not None:
        out["mask_fill_ms_per_step"] = 1e3 * (structured.mask_fill_s - fill0) / max(1, len(steps))
    if busy is not None:
        others = machine.busy_cpu_seconds() - busy - (time.process_time() - own)
        out["others_cores"] = max(0.0, others) / seconds
    return out


def bench_masks(runner, args) -> dict:
    from runner_core import SamplingParams, StructuredOutputsParams

    sides = {
        "masked": [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=TIMING_SCHEMA))
                   for i in range(args.batch)],
        "plain": [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True)
                  for i in range(args.batch)]}
    for params in sides.values():  # warm-up: the grammar compiled and cached, the programs built
        timed_run(runner, params, args.batch)
    runs = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            res = timed_run(runner, sides[side], args.batch)
            runs[side].append(res)
            fill = f", mask fill {res['mask_fill_ms_per_step']:.3f} ms/step" if "mask_fill_ms_per_step" in res else ""
            step = f"{res['step_ms']:.2f} ms" if res["step_ms"] is not None else "none"
            print(f"  round {r + 1} {side:6s} median step {step} over {res['full_steps']} of {res['steps']} steps"
                  f"{fill}; finish {res['finish']}; cores others kept busy "
                  f"{res.get('others_cores', float('nan')):.2f}", flush=True)
    fig = {"runs": runs}
    for side, results in runs.items():
        values = [x["step_ms"] for x in results if x["step_ms"] is not None]
        fig[side] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    fills = [x["mask_fill_ms_per_step"] for x in runs["masked"]]
    fig["mask_fill_ms_per_step"] = {"median": statistics.median(fills), "min": min(fills), "max": max(fills)}
    if fig["masked"] and fig["plain"]:
        fig["ratio"] = fig["masked"]["median"] / fig["plain"]["median"]
        pairs = [m["step_ms"] / p["step_ms"] for m, p in zip(runs["masked"], runs["plain"])
                 if m["step_ms"] and p["step_ms"]]  # each round's two runs, minutes apart at most
        fig["ratio_per_round"] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}
    return fig


def bench_validity(runner, args) -> dict:
    import jsonschema

    from runner_core import SamplingParams, StructuredOutputsParams

    jobs = [(name, seed) for name in HELD_OUT for seed in range(args.seeds)]
    params = [SamplingParams(max_tokens=args.schema_max_tokens, temperature=1.0, seed=1000 + seed,
                             structured_outputs=StructuredOutputsParams(json=HELD_OUT[name])) for name, seed in jobs]
    outs = runner.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(jobs))], params)
    per = {name: {"runs": 0, "stop": 0, "valid": 0, "length": 0, "error": 0, "invalid": []} for name in HELD_OUT}
    for (name, _), out in zip(jobs, outs):
        row = per[name]
        row["runs"] += 1
        if out.finish_reason == "stop":
            row["stop"] += 1
            try:
                jsonschema.validate(json.loads(out.text), HELD_OUT[name])
                row["valid"] += 1
            except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                row["invalid"].append(f"{out.text[:200]!r}: {str(exc).splitlines()[0]}")
        elif out.finish_reason == "length":
            row["length"] += 1
        else:
            row["error"] += 1
            row["invalid"].append(f"{out.finish_reason}: {out.error}")
    print(f"held-out schemas ({len(HELD_OUT)}, {args.seeds} seeds each, max_tokens {args.schema_max_tokens}):")
    for name, row in per.items():
        print(f"  {name:12s} stop {row['stop']}/{row['runs']}, valid {row['valid']}/{row['stop']}, length "
              f"{row['length']}, error {row['error']}" + "".join(f"\n    INVALID {x}" for x in row["invalid"]))
    totals = {k: sum(row[k] for row in per.values()) for k in ("runs", "stop", "valid", "length", "error")}
    totals["all_stop_valid"] = totals["valid"] == totals["stop"] and totals["error"] == 0
    return {"schemas": per, **totals}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama", help="a preset or model directory (its own tokenizer)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of each timed request")
    ap.add_argument("--seeds", type=int, default=3, help="seeded generations per held-out schema")
    ap.add_argument("--schema-max-tokens", type=int, default=256, help="max_tokens of each held-out generation")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or args.seeds < 1:
        ap.error("--repeats, --batch and --seeds must be >= 1 (3 or more repeats for a median with a range)")
    start = verdicts.quiet_at_start()  # before this benchmark runs anything of its own
    from runner_core import ModelRunner
    from runner_core.host import machine_name

    name = machine_name()
    print(f"CPU and tier: {name}")
    print(f"load average at the start: {start.load:.2f} on {start.cores} cores (quiet up to {start.limit:.2f}: "
          f"{'quiet' if start.ok else 'NOT quiet, the speed verdict refused'})", flush=True)
    runner = ModelRunner(model=args.model, dtype="float32", max_num_seqs=args.batch, compile=False).load_model()
    try:
        print(f"{args.model}, batch {args.batch}, {args.max_tokens} tokens a request, {args.repeats} rounds "
              f"(masked = JSON schema, plain = none; median step ms of full decode steps):", flush=True)
        masks = bench_masks(runner, args)
        validity = bench_validity(runner, args)
    finally:
        runner.shutdown()
    during = [verdicts.Quiet(x["others_cores"], start.cores, f"round {i + 1}'s {side} run")
              for side, results in masks["runs"].items() for i, x in enumerate(results) if "others_cores" in x]
    ratio = masks.get("ratio")
    verdict = verdicts.outcome(ratio is not None and ratio <= STEP_TARGET, start, *during)
    for side in ("masked", "plain"):
        f = masks[side]
        print(f"  {side:6s} step " + (f"{f['median']:.2f} ms [{f['min']:.2f}-{f['max']:.2f}]" if f else "no full step"))
    fill = masks["mask_fill_ms_per_step"]
    print(f"  mask fill on the helper thread {fill['median']:.3f} ms per step [{fill['min']:.3f}-{fill['max']:.3f}]")
    if ratio is not None:
        per = masks["ratio_per_round"]
        print(f"  masked / plain step time: {ratio:.3f}x (of the medians; round by round {per['median']:.3f}x "
              f"[{per['min']:.3f}-{per['max']:.3f}]); target <= {STEP_TARGET:.2f}x: {verdict}")
    else:
        print("  masked / plain step time: no full decode step on one side (raise --max-tokens)")
    valid_verdict = "met" if validity["all_stop_valid"] else "NOT met"
    print(f"held-out: {validity['stop']} of {validity['runs']} finished with stop, {validity['valid']} of those "
          f"valid, {validity['length']} ended with length, {validity['error']} in error; every stop valid: "
          f"{valid_verdict}")
    end_load = os.getloadavg()[0]
    print(f"load average after: {end_load:.2f}; CPU and tier: {name}")
    figures = {"machine": name, "model": args.model, "batch": args.batch, "repeats": args.repeats,
               "max_tokens": args.max_tokens, "quiet_at_start": start.as_dict(), "load_average_after": end_load,
               "step_ms": {"masked": masks["masked"], "plain": masks["plain"]}, "step_ratio": ratio,
               "step_ratio_per_round": masks.get("ratio_per_round"),
               "step_target": STEP_TARGET, "step_verdict": verdict, "mask_fill_ms_per_step": fill,
               "runs": masks["runs"], "held_out": validity, "validity_verdict": valid_verdict}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
