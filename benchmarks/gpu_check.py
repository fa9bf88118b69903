"""The prepared check for a machine with a CUDA GPU: parity, CUDA graphs, bf16 throughput, one summary.

Needs a CUDA device (says so and exits 2 otherwise). Runs in sequence, each part in a process of its
own with a time limit (together under 8 minutes), and goes on when one fails:
  parity       greedy tokens of ModelRunner on CUDA (float32) equal transformers' on CUDA, with
               attention_backend "flex" and "gather": small-llama, and a tiny Mistral with a
               sliding window of 24; prompts of 3-300 tokens, the longest prefilled in chunks
  cuda_graphs  benchmarks/cuda_graphs.py (eager vs compiled vs decode CUDA graphs)
  throughput   benchmarks/throughput.py --dtype bfloat16 --skip-hf --skip-compiled (ours eager on the
               GPU, its MFU and bandwidth share against the GPU's own peak and bandwidth; vLLM only
               where its build runs on the same device: the CPU build gives no comparison)
Then one summary: each part's status, seconds and figures (the last JSON object line it printed) and
the failures; the summary is also the last stdout line, one JSON object, and is written to --out
when given. The exit code is 1 when any part failed or its figures report tokens unequal to the
reference (even if that part exited 0).

Run:  make gpu-check    or    .venv/bin/python benchmarks/gpu_check.py [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PARTS = {  # name: (command after the python executable, seconds allowed)
    "parity": (["benchmarks/gpu_check.py", "--parity"], 150),
    "cuda_graphs": (["benchmarks/cuda_graphs.py", "--rounds", "1"], 150),
    # --skip-compiled: its compile=True run (max-autotune) could take the whole budget; cuda_graphs
    # measures our compiled modes on CUDA. A timed-out engine process would stop throughput.py whole.
    "throughput": (["benchmarks/throughput.py", "--dtype", "bfloat16", "--skip-hf", "--skip-compiled",
                    "--engine-timeout", "130"], 150),
}
PROMPT_LENGTHS = (3, 40, 300, 17)
NEW_TOKENS = 24


def parity(device: str) -> dict:
    """{case: {backend: greedy sequences equal to transformers' (of len(PROMPT_LENGTHS))}} on `device`."""
    import transformers

    from runner_core import ModelRunner, SamplingParams
    from runner_core.models.presets import ensure_preset

    sys.path.insert(0, str(ROOT))
    from tests.helpers import make_tiny_hf_model

    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    cases = {"small-llama": ensure_preset("small-llama"),
             "mistral-window-24": make_tiny_hf_model(tmp, "mistral", sliding_window=24)}
    result = {}
    for case, path in cases.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
        refs = [hf.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        del hf
        result[case] = {}
        for backend in ("flex", "gather"):
            runner = ModelRunner({"model": str(path), "dtype": "float32", "device": device,
                                  "attention_backend": backend, "max_num_batched_tokens": 128,
                                  "max_num_seqs": 16, "max_model_len": 512,
                                  "kv_cache_memory": 1 << (28 if device == "cuda" else 24)}).load_model()
            outs = runner.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
            result[case][backend] = sum(o.token_ids == r for o, r in zip(outs, refs))
            print(f"parity {case} {backend}: {result[case][backend]}/{len(prompts)} greedy sequences equal "
                  "transformers'", flush=True)
            del runner
            if device == "cuda":
                torch.cuda.empty_cache()
    return result


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def run_part(name: str, parts: dict = PARTS) -> dict:
    """One part in its own process: status (ok, failed, timeout), seconds, figures, the output's tail."""
    cmd, limit = parts[name]
    print(f"== {name}: {' '.join(cmd)} (limit {limit} s)", flush=True)
    t = time.perf_counter()
    # a session of its own, so a timeout ends the part's own child processes too (throughput's engines)
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        out = proc.communicate(timeout=limit)[0]
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, status = proc.communicate()[0], "timeout"
    print(out[-4000:], flush=True)
    figures = next((json.loads(line) for line in reversed(out.splitlines()) if _is_json_object(line)), None)
    return {"status": status, "seconds": round(time.perf_counter() - t, 1), "figures": figures,
            "tail": out.strip().splitlines()[-3:]}


def failures(summary: dict) -> list[str]:
    """Why the check fails: a part that did not exit 0, or whose figures report tokens unequal to the
    reference (cuda_graphs' greedy_equal, parity's counts), whatever its exit code said."""
    problems = []
    for name, part in summary["parts"].items():
        if part["status"] != "ok":
            problems.append(f"{name}: {part['status']}")
        figures = part["figures"] or {}
        unequal = [mode for mode, ok in (figures.get("greedy_equal") or {}).items() if ok is not True]
        if unequal:
            problems.append(f"{name}: greedy tokens of {', '.join(unequal)} differ from eager's")
        if name == "parity":
            short = [f"{case} {backend}" for case, counts in figures.items() for backend, n in counts.items()
                     if n != len(PROMPT_LENGTHS)]
            if short:
                problems.append(f"parity: {', '.join(short)} differ from transformers")
    return problems


def check(parts: dict, summary: dict, out: Path | None = None) -> int:
    """Run every part, print and keep the summary; the exit code: 0 only when nothing failed."""
    summary["parts"] = {name: run_part(name, parts) for name in parts}
    summary["failures"] = failures(summary)
    print("== summary")
    for name, part in summary["parts"].items():
        print(f"{name:>12}: {part['status']} in {part['seconds']} s")
    for problem in summary["failures"]:
        print(f"FAILED {problem}")
    if out:
        out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if summary["failures"] else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parity", action="store_true", help="only the parity part, in this process")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="the parity part's device (cpu: a dry run of its logic, slow: eager flex)")
    ap.add_argument("--out", type=Path, default=None, help="also write the summary JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not (args.parity and args.device == "cpu"):
        print("benchmarks/gpu_check.py needs CUDA: no CUDA device is visible here (run it on a GPU machine)",
              file=sys.stderr)
        sys.exit(2)
    if args.parity:
        result = parity(args.device)
        print(json.dumps(result))
        sys.exit(0 if all(n == len(PROMPT_LENGTHS) for case in result.values() for n in case.values()) else 1)
    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import describe, machine_info

    info = machine_info("cuda:0")
    print(describe(info), flush=True)
    sys.exit(check(PARTS, {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "machine": info},
                   args.out))


if __name__ == "__main__":
    main()
