"""The prepared check for a machine with a CUDA GPU (`make gpu-check`): one summary of every part.

Needs a CUDA device and a Python whose torch is a CUDA build (it installs nothing: the Makefile's GPU_PYTHON, by
default python3; a lent machine has its own torch and no network). Without CUDA it says so and exits 2. Runs in
sequence, each part in a process of its own with its own time limit (together about ten minutes), and goes on
when one fails:
  parity          greedy tokens of ModelRunner on CUDA (float32) equal transformers' on CUDA, attention_backend
                  "flex" and "gather": small-llama, and a tiny Mistral with a sliding window of 24; prompts of
                  3-300 tokens, the longest prefilled in chunks
  parity_bf16     the same in bfloat16, flex and gather: agreement with transformers' bfloat16 tokens
  compiled_modes  compile modes default (with the runner's decode CUDA graphs), reduce-overhead and max-autotune
                  against eager on two batch mixes (greedy tokens equal)
  quantized       int8 and int4 load on CUDA, their weights on the GPU, and generate
  engine          activation estimate against the measured profile peak; the first request's time with flex
                  warmed at load; the steps' forward_s against CUDA events
  cuda_graphs     benchmarks/cuda_graphs.py: decode CUDA graphs against eager, tokens, speed and graph memory
  roofline        batch-1 decode of Qwen2.5-0.5B's shape (bfloat16) against the HBM bandwidth measured here
Then one summary: each part's status, seconds and figures (the last JSON object line it printed) and the
failures; the summary is also the last stdout line, one JSON object, and is written to --out when given. The exit
code is 1 when any part failed or its figures report a failed comparison (even if that part exited 0).

Run:  make gpu-check    or    python3 benchmarks/gpu_check.py [--out summary.json] [--part NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
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
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_checks import CHECKS, require_cuda  # noqa: E402
from benchmarks.gpu_checks import run as run_check  # noqa: E402

PARTS = {  # name: (command after the python executable, seconds allowed); together about ten minutes
    "parity": (["benchmarks/gpu_check.py", "--parity"], 100),
    "parity_bf16": (["benchmarks/gpu_check.py", "--part", "parity_bf16"], 60),
    "compiled_modes": (["benchmarks/gpu_check.py", "--part", "compiled_modes"], 180),
    "quantized": (["benchmarks/gpu_check.py", "--part", "quantized"], 50),
    "engine": (["benchmarks/gpu_check.py", "--part", "engine"], 70),
    "cuda_graphs": (["benchmarks/cuda_graphs.py", "--rounds", "1"], 100),
    "roofline": (["benchmarks/gpu_check.py", "--part", "roofline"], 60),
}
NEEDED_MODULES = ("transformers", "safetensors", "tokenizers", "pytest")  # pytest: tests.helpers builds the Mistral
PROMPT_LENGTHS = (3, 40, 300, 17)
NEW_TOKENS = 24


def parity(device: str) -> dict:
    """{case: {backend: greedy sequences equal to transformers' (of len(PROMPT_LENGTHS))}} on `device`."""
    import transformers

    from runner_core import ModelRunner, SamplingParams
    from runner_core.models.presets import ensure_preset
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
        if figures.get("ok") is False:
            problems.append(f"{name}: {figures.get('why') or 'its comparison failed'}")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parity", action="store_true", help="only the parity part, in this process")
    ap.add_argument("--part", choices=sorted(CHECKS), help="only this check, in this process")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="the parity part's device (cpu: a dry run of its logic, slow: eager flex)")
    ap.add_argument("--out", type=Path, default=None, help="also write the summary JSON here")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.part:
        sys.exit(run_check(args.part))
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"benchmarks/gpu_check.py needs {', '.join(missing)} beside torch in {sys.executable} (it installs "
              "nothing); install them there, or name another Python: make gpu-check GPU_PYTHON=...", file=sys.stderr)
        sys.exit(2)
    if not (args.parity and args.device == "cpu"):
        require_cuda("parity" if args.parity else "gpu-check")
    if args.parity:
        result = parity(args.device)
        print(json.dumps(result))
        sys.exit(0 if all(n == len(PROMPT_LENGTHS) for case in result.values() for n in case.values()) else 1)
    from benchmarks.machine import describe, machine_info

    info = machine_info("cuda:0")
    print(describe(info), flush=True)
    sys.exit(check(PARTS, {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "machine": info},
                   args.out))


if __name__ == "__main__":
    main()
