"""Speculative decoding benchmark: batch-1 greedy decoding of copy-heavy prompts with the n-gram (prompt-lookup)
proposer at k = 1..8 draft tokens, against the same runner without speculation; the draft-model pair at k = 1..8,
batch 1 and batch 8; and at a real size, the cost of a verification pass against a decode step.

Models: tiny-speaker (the trained preset, whose continuations copy spans of code and docstrings) and small-llama
(random weights: it copies only where greedy decoding falls into a loop), float32, eager, one process, one runner
per model switched between the settings with `reconfigure(speculative_config=...)` (no weight changes, nothing
recompiled). Workload: `PROMPTS`, code and text whose continuations repeat spans of the prompt, each one request
at a time (batch 1), greedy, EOS ignored, `--max-tokens` output tokens.
  a run     every prompt in turn under one setting: output tokens / seconds of the whole run (prefill included),
            and the acceptance rate (accepted / proposed draft tokens) and mean acceptance length (tokens a
            verified step gains) of the run's requests.
  rounds    `--repeats` (>= 3) rounds, each running every setting once, the order rotating each round, after one
            warm-up of each. Reported: each setting's median tokens/s and range over the rounds, its speed-up
            over "off" (of the medians, and round by round), and the acceptance figures (the same every round:
            greedy output does not vary).
  draft     `--draft TARGET DRAFT` (tiny-speaker with tiny-speaker-draft): the same rounds with one runner per
            setting (a draft model loads with its target, never by reconfigure), at batch 1 (the prompts one at a
            time) and `--draft-batch` (the prompts in turn, that many requests at once).
  verify    `--verify-model` (qwen2.5-0.5b's shape, random weights, bfloat16): the forward pass of one sequence
            scoring k+1 tokens against a one-token decode step at `--verify-context` tokens of KV, interleaved
            rounds, and the ratio; with per-token acceptance a a verified step yields (1 - a^(k+1)) / (1 - a)
            tokens, so the break-even a is where that equals the ratio (drafting taken as free).
The speed-up target (issue 42: >= 2x on a copy-heavy workload) is refused as a verdict on a busy machine
(benchmarks/verdicts.py): the figures are then indicative. Every figure names the CPU and kernel tier. The last
stdout line is one JSON object of every figure.

Run:  .venv/bin/python benchmarks/spec_decode.py [--models tiny-speaker small-llama] [--ks 1 2 3 4 5 6 7 8]
          [--repeats 3] [--max-tokens 128] [--draft tiny-speaker tiny-speaker-draft] [--draft-batch 8]
          [--verify-model qwen2.5-0.5b] [--verify-context 256]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import runner_core  # noqa: F401  (before torch: runner_core sets OpenMP's wait policy as torch loads)

try:  # run as a script: benchmarks/ is on sys.path
    import machine
    import verdicts
except ImportError:  # run as `python -m benchmarks.spec_decode`
    from benchmarks import machine, verdicts

SPEEDUP_TARGET = 2.0  # speculative / plain tokens per second at batch 1, at least (issue 42)
PROMPTS = [
    "def get_name(self):\n    return self.name\n\ndef get_path(self):\n    return self.path\n\n"
    "def get_size(self):\n    return self.size\n\ndef get_mode(self):\n    return self.",
    "Return the list of the names of the files in the directory. Return the list of the names of the",
    "class Reader:\n    def read(self, size):\n        return self.stream.read(size)\n\n"
    "class Writer:\n    def write(self, data):\n        return self.stream.",
]


def timed_run(runner, max_tokens: int, batch: int = 1) -> dict:
    """Every prompt, one request at a time (batch 1), or `batch` requests at once (the prompts in turn), greedy:
    tokens/s and the acceptance figures of these requests."""
    from runner_core import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    busy, own, start = machine.busy_cpu_seconds(), time.process_time(), time.perf_counter()
    if batch == 1:
        outs = [runner.generate(prompt, params)[0] for prompt in PROMPTS]
    else:
        outs = runner.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    spec = [o.metrics["spec_decoding"] for o in outs if "spec_decoding" in o.metrics]
    drafts, proposed = sum(s["num_drafts"] for s in spec), sum(s["num_draft_tokens"] for s in spec)
    accepted = sum(s["num_accepted_tokens"] for s in spec)
    out = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
           "acceptance_rate": accepted / proposed if proposed else None,
           "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
           "token_ids": [o.token_ids for o in outs]}
    if busy is not None:  # the cores other processes kept busy meanwhile
        out["others_cores"] = max(0.0, machine.busy_cpu_seconds() - busy - time.process_time() + own) / seconds
    return out


def runners_for(model: str, settings: dict):
    """(a function giving the runner of a setting, every runner loaded): one runner switched between the n-gram
    settings with `reconfigure`, and one per draft-model setting (a draft loads with its target)."""
    from runner_core import ModelRunner

    base = dict(model=model, dtype="float32", compile=False, max_num_seqs=8, max_model_len=512)
    shared = ModelRunner(**base).load_model()
    own = {name: ModelRunner(**base, speculative_config=spec).load_model() for name, spec in settings.items()
           if spec is not None and spec.get("model")}

    def use(name: str):
        if name in own:
            return own[name]
        shared.reconfigure(speculative_config=settings[name])
        return shared
    return use, [shared, *own.values()]


def bench_model(model: str, settings: dict, args, start, batch: int = 1) -> dict:
    use, loaded = runners_for(model, settings)
    runs = {name: [] for name in settings}
    try:
        names = list(settings)
        for name in names:  # warm-up
            timed_run(use(name), args.max_tokens, batch)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                res = timed_run(use(name), args.max_tokens, batch)
                runs[name].append(res)
                rate = res["acceptance_rate"]
                print(f"  {model} batch {batch} round {r + 1} {name}: {res['tokens']} tokens in "
                      f"{res['seconds']:.2f} s = "
                      f"{res['tokens_per_s']:.1f} tokens/s" + (f", acceptance {rate:.2f}" if rate is not None else "")
                      + f"; cores others kept busy {res.get('others_cores', float('nan')):.2f}", flush=True)
    finally:
        for runner in loaded:
            runner.shutdown()
    same = all(x["token_ids"] == runs["off"][0]["token_ids"] for rs in runs.values() for x in rs)
    rates = {name: verdicts.spread([x["tokens_per_s"] for x in rs]) for name, rs in runs.items()}
    out = {"greedy_output_identical": same, "settings": {}}
    for name, rs in runs.items():
        speedup = rates[name]["median"] / rates["off"]["median"]
        per_round = verdicts.spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rs, runs["off"])])
        out["settings"][name] = {"tokens_per_s": rates[name], "speedup": speedup, "speedup_per_round": per_round,
                                 "acceptance_rate": rs[0]["acceptance_rate"],
                                 "mean_acceptance_length": rs[0]["mean_acceptance_length"],
                                 "others_cores": [x.get("others_cores") for x in rs]}
    best = max((n for n in settings if n != "off"), key=lambda n: out["settings"][n]["speedup"])
    during = [verdicts.Quiet(x["others_cores"], start.cores, f"{model} round {i + 1}'s {name} run")
              for name, rs in runs.items() for i, x in enumerate(rs) if "others_cores" in x]
    out["best"] = best
    out["verdict"] = verdicts.outcome(out["settings"][best]["speedup"] >= SPEEDUP_TARGET, start, *during)
    out["batch"] = batch
    print(f"  {model}: greedy output identical in every setting: {same}")
    print(f"  {'setting':>8} {'tokens/s median [range]':>28} {'speed-up':>9} {'acceptance':>10} {'mean length':>11}")
    for name, f in out["settings"].items():
        acc, length = f["acceptance_rate"], f["mean_acceptance_length"]
        print(f"  {name:>8} {f['tokens_per_s']['median']:>10.1f} [{f['tokens_per_s']['min']:.1f}-"
              f"{f['tokens_per_s']['max']:.1f}]{'':>6} {f['speedup']:>8.2f}x "
              f"{'-' if acc is None else f'{acc:.2f}':>10} {'-' if length is None else f'{length:.2f}':>11}")
    print(f"  {model}: best {best}, {out['settings'][best]['speedup']:.2f}x; target >= {SPEEDUP_TARGET}x: "
          f"{out['verdict']}", flush=True)
    return out


def verification_cost(model: str, ks: list[int], repeats: int, context: int, calls: int) -> dict:
    """The forward pass of one sequence scoring k+1 tokens (a verification: its last token and k drafts, logits
    at every position) against one decode step (one token), at `context` tokens of KV, for each k: the median
    over `repeats` interleaved rounds of each round's median of `calls` passes, and the ratio. bfloat16, eager,
    one process; the KV holds zeros (the cost does not depend on its values); sampling is not included."""
    from runner_core import ModelRunner
    from runner_core.engine.draft_model import DraftSeq
    from runner_core.engine.input_batch import StepBatch

    runner = ModelRunner(model=model, dtype="bfloat16", compile=False, max_num_seqs=1,
                         max_model_len=context + max(ks) + 1, kv_cache_memory=None).load_model()
    worker = runner.engine.worker
    seq = DraftSeq("verify")
    worker.memory.allocate(seq, context + max(ks) + 1)
    sizes = [1, *(k + 1 for k in ks)]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for r in range(repeats + 1):  # the first round warms up
            for n in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                batch = StepBatch(request_ids=["verify"], starts=[context], num_new_tokens=[n],
                                  token_ids=[3] * n, num_decodes=int(n == 1), sample_rows=[0],
                                  new_blocks=[("verify", 0, seq.block_table)],
                                  spec_rows=[(0, n - 1)] if n > 1 else [])
                one = []
                for _ in range(calls):
                    t = time.perf_counter()
                    worker.execute_model(batch)
                    one.append(time.perf_counter() - t)
                if r:
                    times[n].append(sorted(one)[len(one) // 2])
    finally:
        runner.shutdown()
    decode = verdicts.spread(times[1])
    out = {"model": model, "context": context, "decode_s": decode, "ks": {}}
    print(f"  {model} (bfloat16, context {context}): decode step {decode['median'] * 1e3:.1f} ms "
          f"[{decode['min'] * 1e3:.1f}-{decode['max'] * 1e3:.1f}]")
    print(f"  {'k':>3} {'verify k+1 ms [range]':>26} {'cost ratio':>10} {'break-even a':>12}")
    for k in ks:
        v = verdicts.spread(times[k + 1])
        ratio = v["median"] / decode["median"]
        a = break_even_acceptance(k, ratio)
        out["ks"][k] = {"verify_s": v, "cost_ratio": ratio, "break_even_acceptance": a}
        print(f"  {k:>3} {v['median'] * 1e3:>10.1f} [{v['min'] * 1e3:.1f}-{v['max'] * 1e3:.1f}]{'':>6} "
              f"{ratio:>10.2f} {'-' if a is None else f'{a:.2f}':>12}", flush=True)
    return out


def break_even_acceptance(k: int, ratio: float) -> float | None:
    """The per-token acceptance a at which the expected tokens of a verified step, (1 - a^(k+1)) / (1 - a),
    equal `ratio` (the verification's cost in decode steps; drafting taken as free); None past k+1."""
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if (1 - a ** (k + 1)) / (1 - a) < ratio:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["tiny-speaker", "small-llama"],
                    help="presets or model directories for the n-gram section (none: skipped)")
    ap.add_argument("--ks", nargs="+", type=int, default=list(range(1, 9)), help="num_speculative_tokens values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of each request")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--draft", nargs=2, metavar=("TARGET", "DRAFT"), default=["tiny-speaker", "tiny-speaker-draft"],
                    help="the draft-model pair, measured at batch 1 and --draft-batch ('' '' skips it)")
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--verify-model", default="qwen2.5-0.5b", help="the model whose verification pass is priced "
                    "against a decode step ('' skips it)")
    ap.add_argument("--verify-context", type=int, default=256, help="KV tokens before the verified ones")
    ap.add_argument("--verify-calls", type=int, default=5, help="passes timed per setting per round")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 1 or any(k < 1 for k in args.ks):
        ap.error("--repeats, --max-tokens and every --ks value must be >= 1 (3 or more repeats for a median with "
                 "a range)")
    start, name = verdicts.announce_start()  # before this benchmark runs anything of its own
    settings = {"off": None, **{f"k={k}": {"method": "ngram", "num_speculative_tokens": k,
                                           "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
                                for k in args.ks}}
    models = {}
    for model in args.models:
        print(f"{model}: {len(PROMPTS)} copy-heavy prompts at batch 1, {args.max_tokens} tokens each, "
              f"{args.repeats} rounds of {len(settings)} settings", flush=True)
        models[model] = bench_model(model, settings, args, start)
    target, draft = args.draft
    if draft:
        drafts = {"off": None, **{f"draft k={k}": {"model": draft, "num_speculative_tokens": k} for k in args.ks}}
        for batch in sorted({1, args.draft_batch}):
            print(f"{target} with the draft {draft}: batch {batch}, {args.max_tokens} tokens each, {args.repeats} "
                  f"rounds of {len(drafts)} settings", flush=True)
            models[f"{target} + {draft}, batch {batch}"] = bench_model(target, drafts, args, start, batch)
    verify = None
    if args.verify_model:
        print(f"{args.verify_model}: one verification pass of k+1 tokens against one decode step", flush=True)
        verify = verification_cost(args.verify_model, args.ks, args.repeats, args.verify_context, args.verify_calls)
    end_load = os.getloadavg()[0]
    print(f"load average after: {end_load:.2f}; CPU and tier: {name}")
    figures = {"machine": name, "models": models, "ks": args.ks, "max_tokens": args.max_tokens,
               "repeats": args.repeats, "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min,
               "speedup_target": SPEEDUP_TARGET, "verification_cost": verify, "quiet_at_start": start.as_dict(),
               "load_average_after": end_load}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
