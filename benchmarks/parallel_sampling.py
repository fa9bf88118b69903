"""Parallel sampling benchmark: one request of n=4 against one of n=1 on the same 512-token prompt — the KV
blocks in use at the end of the prompt and the throughput in generated tokens.

Model: small-llama (`--model`; random weights), float32, eager, one process, one engine, one warm-up of each
side before anything is timed. Each run: one request (`--prompt-tokens` random token ids, seeded), temperature
1 with a seed, EOS ignored, `--max-tokens` output tokens per completion, driven step by step through the
engine as `generate` drives it.
  blocks      the blocks in use after the step that samples the first token(s), the prompt's end: n=1 holds
              the prompt's; n=4 forks there, its four sequences sharing those blocks (engine/parallel_sampling.py).
              Reported: n=4 / n=1 against the target <= 1.3 (issue 41); bookkeeping, the same every run.
  throughput  generated tokens (every completion's) per second of the whole request, prefill included.
              `--repeats` rounds (>= 3), the two sides taking turns, the order alternating each round. Reported:
              each side's median and range over the rounds, n=4 / n=1 of the medians against the target >= 2.5
              (issue 41), and each round's own ratio (median and range).
The throughput verdict is refused ("refused: machine not quiet (load X on N cores)") when the 1-minute load
average at the start exceeds half a process per core (benchmarks/verdicts.py) or other processes kept more
than half the cores busy during a timed run (printed for every run). Every figure names the CPU and kernel
tier (runner_core.host.machine_name). The last stdout line is one JSON object of every figure.

Run:  .venv/bin/python benchmarks/parallel_sampling.py [--model small-llama] [--repeats 5] [--max-tokens 64]
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
except ImportError:  # run as `python -m benchmarks.parallel_sampling`
    from benchmarks import machine, verdicts

BLOCKS_TARGET = 1.3  # n=4 blocks / n=1 blocks at the end of the prompt, at most (issue 41)
THROUGHPUT_TARGET = 2.5  # n=4 generated tokens/s / n=1's, at least (issue 41)
SIDES = {"n=1": 1, "n=4": 4}


def timed_run(runner, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    """One request of `n` completions, stepped to its end: the blocks in use at the prompt's end, tokens/s."""
    from runner_core import SamplingParams

    engine = runner.engine
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    busy, own, start = machine.busy_cpu_seconds(), time.process_time(), time.perf_counter()
    seq = engine.add_request(prompt, params)
    blocks, final = None, None
    while final is None:
        for out in engine.step():
            final = out if out.finished else final
        if blocks is None and seq.num_output_tokens:  # the step that sampled the first token(s)
            blocks = engine.memory.num_blocks - engine.memory.num_free_blocks
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in final.outputs)
    out = {"blocks_at_prompt_end": blocks, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "completions": len(final.outputs)}
    if busy is not None:
        others = machine.busy_cpu_seconds() - busy - (time.process_time() - own)
        out["others_cores"] = max(0.0, others) / seconds
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama", help="a preset or model directory")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens of each completion")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.prompt_tokens < 1 or args.max_tokens < 1:
        ap.error("--repeats, --prompt-tokens and --max-tokens must be >= 1 (3 or more repeats for a median with a "
                 "range)")
    start = verdicts.quiet_at_start()  # before this benchmark runs anything of its own
    import torch

    from runner_core import ModelRunner
    from runner_core.host import machine_name

    name = machine_name()
    print(f"CPU and tier: {name}")
    print(f"load average at the start: {start.load:.2f} on {start.cores} cores (quiet up to {start.limit:.2f}: "
          f"{'quiet' if start.ok else 'NOT quiet, the speed verdict refused'})", flush=True)
    runner = ModelRunner(model=args.model, dtype="float32", compile=False,
                         max_model_len=args.prompt_tokens + args.max_tokens + 16).load_model()
    vocab = runner.engine.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {side: [] for side in SIDES}
    try:
        print(f"{args.model}, a {args.prompt_tokens}-token prompt, {args.max_tokens} tokens a completion, "
              f"{args.repeats} rounds:", flush=True)
        for n in SIDES.values():  # warm-up
            timed_run(runner, prompt, n, args.max_tokens, seed=0)
        for r in range(args.repeats):
            for side in (list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]):
                res = timed_run(runner, prompt, SIDES[side], args.max_tokens, seed=r + 1)
                runs[side].append(res)
                print(f"  round {r + 1} {side}: {res['blocks_at_prompt_end']} blocks at the prompt's end, "
                      f"{res['tokens']} tokens in {res['seconds']:.2f} s = {res['tokens_per_s']:.1f} tokens/s; "
                      f"cores others kept busy {res.get('others_cores', float('nan')):.2f}", flush=True)
    finally:
        runner.shutdown()
    blocks = {side: runs[side][0]["blocks_at_prompt_end"] for side in SIDES}
    block_ratio = blocks["n=4"] / blocks["n=1"]
    block_verdict = "met" if block_ratio <= BLOCKS_TARGET else "NOT met"
    rates = {side: spread([x["tokens_per_s"] for x in runs[side]]) for side in SIDES}
    ratio = rates["n=4"]["median"] / rates["n=1"]["median"]
    per_round = spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["n=4"], runs["n=1"])])
    during = [verdicts.Quiet(x["others_cores"], start.cores, f"round {i + 1}'s {side} run")
              for side, results in runs.items() for i, x in enumerate(results) if "others_cores" in x]
    verdict = verdicts.outcome(ratio >= THROUGHPUT_TARGET, start, *during)
    print(f"  blocks at the prompt's end: n=1 {blocks['n=1']}, n=4 {blocks['n=4']}: {block_ratio:.3f}x; target "
          f"<= {BLOCKS_TARGET}x: {block_verdict}")
    for side, f in rates.items():
        print(f"  {side} {f['median']:.1f} tokens/s [{f['min']:.1f}-{f['max']:.1f}]")
    print(f"  n=4 / n=1 throughput: {ratio:.2f}x (of the medians; round by round {per_round['median']:.2f}x "
          f"[{per_round['min']:.2f}-{per_round['max']:.2f}]); target >= {THROUGHPUT_TARGET}x: {verdict}")
    end_load = os.getloadavg()[0]
    print(f"load average after: {end_load:.2f}; CPU and tier: {name}")
    figures = {"machine": name, "model": args.model, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens, "repeats": args.repeats, "quiet_at_start": start.as_dict(),
               "load_average_after": end_load, "blocks_at_prompt_end": blocks, "block_ratio": block_ratio,
               "block_target": BLOCKS_TARGET, "block_verdict": block_verdict, "tokens_per_s": rates,
               "throughput_ratio": ratio, "throughput_ratio_per_round": per_round,
               "throughput_target": THROUGHPUT_TARGET, "throughput_verdict": verdict, "runs": runs}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
