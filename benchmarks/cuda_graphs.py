"""Decode CUDA graphs on one CUDA device: eager, compiled without graphs, compiled with graphs.

Needs a CUDA device (says so and exits 2 otherwise). On `small-llama` (float32 so tokens compare
exactly), in one process, each mode switched on the same loaded runner:
  eager      compile off
  compiled   inductor, mode "default", compile_sizes=[] (the one dynamic-shape program, no graphs)
  graphs     inductor, mode "default", default capture sizes (1, 2, 4, 8, 16, 32, ... <= max_num_seqs):
             every pure-decode step replays a CUDA graph of its padded size
For decode batches 1, 3 (padded to 4), 8 and 32: tokens/s of the steady pure-decode steps
(runner.step_metrics), best of --rounds. Checks: greedy tokens of every mode equal eager's;
compile_stats()["cuda_graphs"] names the captured sizes; the graphs' memory. The last stdout line
is one JSON object with the figures; the exit code is 1 when any mode's tokens differ from eager's.

Run:  .venv/bin/python benchmarks/cuda_graphs.py [--model small-llama] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from runner_core import ModelRunner, SamplingParams

try:
    from machine import describe, machine_info
    from workload import fixed_workload
except ImportError:  # run as `python -m benchmarks.cuda_graphs`
    from benchmarks.machine import describe, machine_info
    from benchmarks.workload import fixed_workload

BATCHES = (1, 3, 8, 32)


def decode_tok_s(runner, batch: int, seed: int) -> tuple[float, list[list[int]]]:
    engine = runner.engine
    reqs = fixed_workload(batch, 32, 64, seed=seed, vocab_size=engine.vocab_size)
    engine.step_metrics.clear()
    outs = runner.generate([r.prompt_ids for r in reqs],
                           [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs])
    steps = [m for m in engine.step_metrics if m.num_prefill_tokens == 0 and m.num_seqs == batch]
    return sum(m.num_decode_tokens for m in steps) / sum(m.total_s for m in steps), [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cuda_graphs.py needs a CUDA device; none is visible here", file=sys.stderr)
        sys.exit(2)
    info = machine_info("cuda:0")
    print(describe(info), flush=True)
    runner = ModelRunner({"model": args.model, "dtype": "float32", "device": 0, "max_num_seqs": 64,
                          "compile_cache_dir": "test-output/cuda-compile-cache"}).load_model()
    engine = runner.engine

    def switch(mode: str) -> float:
        t = time.perf_counter()
        engine.worker.config = engine.worker.config.replace(compile_sizes=[] if mode == "compiled" else None)
        runner.set_compile_mode(mode != "eager", backend="inductor", mode="default", scope="model")
        return time.perf_counter() - t

    modes = ("eager", "compiled", "graphs")
    speed = {m: dict.fromkeys(BATCHES, 0.0) for m in modes}
    tokens: dict[str, dict[int, list]] = {m: {} for m in modes}
    switch_s, stats = {}, {}
    for _ in range(args.rounds):
        for mode in modes:
            switch_s.setdefault(mode, switch(mode))
            for b in BATCHES:
                tok_s, ids = decode_tok_s(runner, b, seed=b)
                speed[mode][b] = max(speed[mode][b], tok_s)
                tokens[mode][b] = ids
            stats[mode] = runner.compile_stats()
    graphs_mem = runner.memory_stats()["decode_programs_bytes"]
    print(f"{'batch':>6}{'eager tok/s':>14}{'compiled':>10}{'graphs':>10}{'graphs/eager':>14}{'graphs/compiled':>17}")
    for b in BATCHES:
        e, c, g = (speed[m][b] for m in modes)
        print(f"{b:>6}{e:>14.1f}{c:>10.1f}{g:>10.1f}{g / e:>13.2f}x{g / c:>16.2f}x")
    equal = {m: all(tokens[m][b] == tokens["eager"][b] for b in BATCHES) for m in modes}
    print(f"greedy tokens equal eager: {equal}; cuda_graphs: {stats['graphs']['cuda_graphs']}; graph memory "
          f"{graphs_mem / 2**20:.1f} MiB; mode switch seconds {switch_s}; recompiles after warm-up "
          f"{stats['graphs']['recompiles_after_warmup']}")
    print(json.dumps({"model": args.model, "device": torch.cuda.get_device_name(0), "machine": info,
                      "decode_tok_s": {m: {str(b): round(v, 1) for b, v in speed[m].items()} for m in modes},
                      "greedy_equal": equal, "cuda_graphs": stats["graphs"]["cuda_graphs"],
                      "decode_programs": stats["graphs"]["decode_programs"], "graph_memory_bytes": graphs_mem,
                      "switch_seconds": switch_s}, default=str))
    sys.exit(parity_exit_code(equal))


def parity_exit_code(equal: dict[str, bool]) -> int:
    """0 when every mode's greedy tokens equal eager's, else 1 (after saying which modes differ)."""
    differ = [mode for mode, ok in equal.items() if not ok]
    if differ:
        print(f"FAILED: greedy tokens of {', '.join(differ)} differ from eager's", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    main()
