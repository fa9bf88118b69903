"""Two revisions of this repository side by side on the same machine: each checked out in a git worktree,
run in its own process (PYTHONPATH pointing at it) on the same engine workload, turn and turn about for
`--rounds` rounds (the order alternating), and compared: generated tokens per second and the median time a
batch-32 decode step spends outside the model's forward (scheduling, inputs, sampling, outputs, the record).

Workload: small-llama (`--model`), float32, eager, 32 requests of 64 prompt tokens and 64 output tokens (ignore_eos),
generated twice per process after a warm-up; each process reports its best throughput and its lowest
median time outside the forward.

Run:  .venv/bin/python benchmarks/ab_revisions.py BEFORE AFTER [--rounds 5] [--model small-llama]
The last stdout line is one JSON object: per revision, the median, min and max of both figures, and the
ratios after / before of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, time
import torch
from runner_core import ModelRunner, SamplingParams
torch.set_num_threads(2)
runner = ModelRunner(model=os.environ["AB_MODEL"], dtype="float32", max_num_seqs=32, compile=False).load_model()
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(64)] for i in range(32)]
runner.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
tok_s, outside_ms = [], []
for _ in range(2):
    n0 = len(runner.step_metrics)
    t = time.perf_counter()
    outs = runner.generate(prompts, params)
    tok_s.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    full = [r for r in list(runner.step_metrics)[n0:] if r.num_prefill_tokens == 0 and r.num_decode_tokens == 32]
    outside_ms.append(1e3 * statistics.median(r.total_s - r.forward_s for r in full))
print(json.dumps({"tok_s": max(tok_s), "outside_ms": min(outside_ms)}))
"""


def worktree(revision: str, path: Path) -> Path:
    proc = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), revision],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"revision {revision!r}: git worktree add failed: {proc.stderr.strip()} (give a commit, "
                         "branch or tag of this repository)")
    return path


def run_one(tree: Path, model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "AB_MODEL": model}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="small-llama", help="a preset or model directory (default small-llama)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        trees = {name: worktree(rev, Path(tmp) / name) for name, rev in (("before", args.before),
                                                                          ("after", args.after))}
        try:
            rows: dict[str, list[dict]] = {name: [] for name in trees}
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    rows[name].append(run_one(trees[name], args.model))
                    print(f"round {r} {name}: {rows[name][-1]} (load {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    out = {"machine": _machine(), "model": args.model, "before": args.before, "after": args.after,
           "rounds": args.rounds}
    for name, runs in rows.items():
        for key in ("tok_s", "outside_ms"):
            values = [run[key] for run in runs]
            out[f"{name} {key}"] = {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                                    "max": round(max(values), 3)}
    for key in ("tok_s", "outside_ms"):
        out[f"{key} after/before"] = round(out[f"after {key}"]["median"] / out[f"before {key}"]["median"], 3)
    print(json.dumps(out))
    return out


def _machine() -> str:
    from runner_core.host import machine_name  # this checkout's: the CPU and its kernel tier

    return machine_name()


if __name__ == "__main__":
    main()
