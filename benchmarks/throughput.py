"""Offline throughput: our engine against vLLM and transformers on one fixed mixed workload.

Workload (benchmarks/workload.py, fixed seed): 64 requests, prompts of 16-256 random token ids,
outputs of 16-128 tokens, greedy, EOS ignored, so each request yields exactly its own length; one
`--dtype` per run (float32 or bfloat16), torch with 2 threads everywhere. Methods:
  ours, ours compiled   ModelRunner.generate on all requests at once (continuous batching, paged
                 KV), eager and with compile=True, each in a cold process of its own
                 (benchmarks/engine_proc.py)
  vllm           vLLM for CPUs (`make bench-peers` makes its venv, .venv-peers) on the same model
                 directory and requests, compiled (its default; `--vllm-eager` adds eager), in a
                 cold process of its own; without the venv the table says so and goes on
  hf single      transformers generate one request at a time, unpadded (slow: by default only
                 the first 8 requests; its tok/s is from that subset)
  hf batch B     transformers generate, FIFO batches of B in arrival order, left padding; a batch
                 runs to its longest request, only each request's own tokens count
  hf cb          transformers continuous batching (the manager behind generate_batch), each
                 request with its own max_new_tokens
Useful tok/s = sum of the requests' output lengths / wall seconds. Greedy check: every method's ids
against ours (eager); in bf16 the counts are reported, not expected equal.
The same run measures this machine (benchmarks/machine.py): the matmul peak in the dtype and the
memory read bandwidth; a method's MFU is its tok/s / the workload's compute limit (useful tokens
x peak / the workload's FLOPs), and batch-1 decode (32-token prompt, 128 tokens) is reported as
weight bytes x tok/s / bandwidth. Cold start = seconds from launching the process to the first
token. Then the step overhead: 32 requests (prompt 64, 64 outputs, max_num_seqs 32); over the
pure-decode steps, the share of step time spent outside the model forward.
Targets (reported, never enforced): best ours / vLLM >= 1.25; fp32 MFU >= 70%; batch-1 decode >=
75% of the bandwidth; cold start <= 1/5 of vLLM's; step overhead <= 5%; ours >= 3x transformers.
The last stdout line is one JSON object with the figures.

Run:  make bench    or    .venv/bin/python benchmarks/throughput.py [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from runner_core import ModelRunner, SamplingParams
from runner_core.kernels import cpu_kernels_available
from runner_core.memory.shapes import ModelShape
from runner_core.model_loader import read_hf_config, resolve_model_path

try:
    from machine import decode_weight_bytes, matmul_peak, read_bandwidth, workload_flops
    from workload import Request, fixed_workload, make_workload, useful_tokens
except ImportError:  # run as `python -m benchmarks.throughput`
    from benchmarks.machine import decode_weight_bytes, matmul_peak, read_bandwidth, workload_flops
    from benchmarks.workload import Request, fixed_workload, make_workload, useful_tokens

HF_RATIO_TARGET, VLLM_RATIO_TARGET, OVERHEAD_TARGET = 3.0, 1.25, 0.05
MFU_TARGET, BANDWIDTH_TARGET, COLD_START_TARGET = 0.70, 0.75, 0.2
ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_ours(runner: ModelRunner, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    runner.generate([[5] * 16], [greedy(4)])  # warm-up
    t0 = time.perf_counter()
    outs = runner.generate([r.prompt_ids for r in reqs], [greedy(r.max_tokens) for r in reqs])
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def hf_config(n: int):
    from transformers import GenerationConfig
    # min_new_tokens == max_new_tokens: no early stop even if a default eos id gets merged in
    return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


@torch.inference_mode()
def hf_batches(model, reqs: list[Request], batch: int, desc: str) -> tuple[float, list[list[int]]]:
    """generate() over FIFO batches (left padding); batch=1 means unpadded one-at-a-time."""
    model.generate(torch.full((1, 16), 5), attention_mask=torch.ones(1, 16, dtype=torch.long),
                   generation_config=hf_config(4))  # warm-up
    outs, t0 = [], time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch), desc=desc, leave=False):
        chunk = reqs[i:i + batch]
        width = max(r.prompt_len for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):
            ids[j, width - r.prompt_len:] = torch.tensor(r.prompt_ids)
            mask[j, width - r.prompt_len:] = 1
        gen = model.generate(ids, attention_mask=mask, generation_config=hf_config(max(r.max_tokens for r in chunk)))
        outs += [gen[j, width:width + r.max_tokens].tolist() for j, r in enumerate(chunk)]
    return time.perf_counter() - t0, outs


@torch.inference_mode()
def hf_continuous(model, reqs: list[Request]) -> tuple[float, list[list[int]]]:
    """transformers continuous batching with a per-request max_new_tokens (generate_batch takes one)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    gc = GenerationConfig(max_new_tokens=max(r.max_tokens for r in reqs), do_sample=False, eos_token_id=-1)
    hints = WorkloadHints(max(r.prompt_len for r in reqs), gc.max_new_tokens, len(reqs))
    with model.continuous_batching_context_manager(generation_config=gc, workload_hints=hints, timeout=30) as mgr:
        def collect(ids: list[str], bar=None) -> dict[str, list[int]]:
            done = {}
            while len(done) < len(ids):
                res = mgr.get_result(timeout=1)
                if res is None:
                    if not mgr.is_running():
                        raise RuntimeError("generation thread stopped")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(res.error)
                    done[res.request_id] = res.generated_tokens
                    bar and bar.update(1)
            return done
        collect([mgr.add_request([5] * 16, "warmup", max_new_tokens=4, eos_token_id=-1)])
        t0 = time.perf_counter()
        ids = [mgr.add_request(r.prompt_ids, f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
               for i, r in enumerate(reqs)]
        with tqdm(total=len(ids), desc="hf cb", leave=False) as bar:
            done = collect(ids, bar)
        seconds = time.perf_counter() - t0
    return seconds, [done[i] for i in ids]


def decode_overhead(args) -> dict:
    """Mean pure-decode step time at batch 32, the share of it outside the model forward, and what
    the step's observer (its metrics record and waste figures) costs per step."""
    runner = ModelRunner({"model": args.model, "dtype": args.dtype, "max_num_seqs": 32}).load_model()
    runner.generate([[5] * 16], [greedy(4)])
    runner.engine.step_metrics.clear()
    observer = runner.engine.observer
    seconds, num_steps = observer.seconds, observer.num_steps
    reqs = fixed_workload(32, 64, 64, seed=args.seed + 1, vocab_size=runner.engine.vocab_size)
    runner.generate([r.prompt_ids for r in reqs], [greedy(r.max_tokens) for r in reqs])
    steps = [m for m in runner.engine.step_metrics if m.num_prefill_tokens == 0]
    total, fwd = sum(m.total_s for m in steps), sum(m.forward_s for m in steps)
    return {"steps": len(steps), "total_ms": 1e3 * total / len(steps), "forward_ms": 1e3 * fwd / len(steps),
            "share": 1 - fwd / total,
            "observer_us": 1e6 * (observer.seconds - seconds) / (observer.num_steps - num_steps)}


def best_of(repeats: int, fn, *args) -> tuple[float, list[list[int]]]:
    """Fastest of `repeats` runs (this machine is shared: the minimum is the least disturbed)."""
    runs = [fn(*args) for _ in range(max(1, repeats))]
    return min(s for s, _ in runs), runs[0][1]


def matches(ours: list[list[int]], ref: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(ours, ref))


def run_engine(engine: str, compile_: bool, model_dir: str, reqs: list[Request], args) -> dict:
    """benchmarks/engine_proc.py in a cold process: its figures, or {"error": why}."""
    python = sys.executable if engine == "ours" else str(PEER_PYTHON)
    if engine == "vllm" and not PEER_PYTHON.exists():
        return {"error": f"no peer venv at {PEER_PYTHON.parent.parent} (make bench-peers makes it)"}
    with tempfile.TemporaryDirectory() as tmp:
        requests, out = Path(tmp) / "requests.json", Path(tmp) / "figures.json"
        requests.write_text(json.dumps([[r.prompt_ids, r.max_tokens] for r in reqs]))
        cmd = [python, str(ROOT / "benchmarks" / "engine_proc.py"), "--engine", engine, "--model", model_dir,
               "--dtype", args.dtype, "--requests", str(requests), "--out", str(out), "--repeats", str(args.repeats),
               "--launched-at", repr(time.time())] + (["--compile"] if compile_ else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT)} if engine == "ours" else dict(os.environ)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.engine_timeout)
        if proc.returncode or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"{engine} exited {proc.returncode}: {' | '.join(tail)}"}
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-single-requests", type=int, default=8, help="requests run one at a time (0 = all)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers methods")
    ap.add_argument("--skip-compiled", action="store_true", help="no compiled run of ours")
    ap.add_argument("--vllm-eager", action="store_true", help="also run vLLM with enforce_eager")
    ap.add_argument("--engine-timeout", type=float, default=900, help="seconds an engine process may take")
    ap.add_argument("--repeats", type=int, default=1, help="time each method this many times, keep the fastest")
    ap.add_argument("--skip-overhead", action="store_true", help="skip the batch-32 decode step figure")
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)

    model_dir = str(resolve_model_path(args.model))
    cpu_kernels_available()  # a first build (once per machine) is not part of any cold start below
    shape = ModelShape.from_hf_config(read_hf_config(Path(model_dir)))
    n = args.num_requests or (8 if args.quick else 64)
    lens = dict(prompt_len=(16, 64), output_len=(8, 32)) if args.quick else {}
    reqs = make_workload(n, seed=args.seed, vocab_size=shape.vocab_size, **lens)
    useful = useful_tokens(reqs)
    flops = workload_flops(shape, [(r.prompt_len, r.max_tokens) for r in reqs])
    peak, bandwidth = matmul_peak(dtype), read_bandwidth()
    limit = useful / (flops / (peak * 1e9))
    print(f"workload: {n} requests, prompts {min(r.prompt_len for r in reqs)}-{max(r.prompt_len for r in reqs)}, "
          f"outputs {min(r.max_tokens for r in reqs)}-{max(r.max_tokens for r in reqs)}, {useful} useful tokens, "
          f"{flops / 1e12:.3f} TFLOP; {args.dtype}; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.2f} (other busy processes skew every figure)")
    print(f"this machine: matmul peak {peak:.0f} GFLOP/s ({args.dtype}, the faster of torch.mm and the panel GEMM), "
          f"read bandwidth {bandwidth:.1f} GB/s; "
          f"the workload's compute limit {limit:.0f} useful tok/s")

    engines, errors = {}, {}
    runs = [("ours", "ours", False)] + ([] if args.skip_compiled else [("ours compiled", "ours", True)])
    runs += [("vllm", "vllm", True)] + ([("vllm eager", "vllm", False)] if args.vllm_eager else [])
    for name, engine, compile_ in runs:
        print(f"running {name} in its own process ...", flush=True)
        res = run_engine(engine, compile_, model_dir, reqs, args)
        if "error" in res:
            errors[name] = res["error"]
            print(f"  {name}: {res['error']}")
            if engine == "vllm":
                break  # no venv or a broken peer: its other mode would fail the same way
        else:
            engines[name] = res

    if "ours" not in engines:
        raise SystemExit(f"ours did not run: {errors['ours']}")
    rows = {name: (n, r["seconds"], useful / r["seconds"]) for name, r in engines.items()}
    ours = engines["ours"]["tokens"]
    match = {name: (matches(ours, r["tokens"]), n) for name, r in engines.items() if name != "ours"}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        sub = reqs[:args.hf_single_requests or n]
        for name, part, b in (("hf single", sub, 1), ("hf batch 16", reqs, 16), ("hf batch 64", reqs, 64)):
            secs, outs = best_of(args.repeats, hf_batches, model, part, b, name)
            rows[name], match[name] = (len(part), secs, useful_tokens(part) / secs), (matches(ours, outs), len(part))
        try:
            secs, outs = best_of(args.repeats, hf_continuous, model, reqs)
            rows["hf cb"], match["hf cb"] = (n, secs, useful / secs), (matches(ours, outs), n)
        except Exception as e:  # report, don't crash: it is a peer, not the subject
            errors["hf cb"] = f"{type(e).__name__}: {e}"
        del model

    mine = max(rows[k][2] for k in rows if k.startswith("ours"))
    print(f"\n{'method':<15}{'requests':>9}{'seconds':>10}{'useful tok/s':>14}{'MFU':>7}{'best ours/it':>14}"
          f"  greedy match vs ours")
    for name, (k, s, tps) in rows.items():
        mfu = f"{100 * tps / limit:.0f}%" if k == n else "-"
        m = f"{match[name][0]}/{match[name][1]}" if name in match else "-"
        print(f"{name:<15}{k:>9}{s:>10.2f}{tps:>14.1f}{mfu:>7}{mine / tps:>14.2f}  {m}")
    if "hf single" in rows and rows["hf single"][0] < n:
        print(f"(hf single ran the first {rows['hf single'][0]} requests only; its tok/s is from that subset)")
    for name, why in errors.items():
        print(f"{name} not measured: {why}")

    hf = [tps for name, (_, _, tps) in rows.items() if name.startswith("hf")]
    vllm = [tps for name, (_, _, tps) in rows.items() if name.startswith("vllm")]
    hf_ratio = mine / max(hf) if hf else None
    vllm_ratio = mine / max(vllm) if vllm else None
    mfu = mine / limit

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if vllm_ratio is not None:
        print(f"best ours / best vLLM: {vllm_ratio:.2f}x; target >= {VLLM_RATIO_TARGET:g}x: "
              f"{verdict(vllm_ratio >= VLLM_RATIO_TARGET)}")
    if hf_ratio is not None:
        print(f"best ours / best transformers: {hf_ratio:.2f}x; target >= {HF_RATIO_TARGET:g}x: "
              f"{verdict(hf_ratio >= HF_RATIO_TARGET)}")
    print(f"best ours MFU {100 * mfu:.0f}% of the {args.dtype} compute limit"
          + (f"; target >= {100 * MFU_TARGET:g}% in float32: {verdict(mfu >= MFU_TARGET)}"
             if args.dtype == "float32" else ""))

    weight_bytes = decode_weight_bytes(shape, args.dtype)
    print(f"\nbatch-1 decode ({weight_bytes / 1e6:.0f} MB of weights read per token; "
          f"{bandwidth:.1f} GB/s measured) and cold start (launch to first token):")
    batch1, cold = {}, {}
    for name, r in engines.items():
        tps = r["batch1_decode_tok_s"]
        batch1[name], cold[name] = tps, r["first_token_s"]
        share = weight_bytes * tps / (bandwidth * 1e9)
        print(f"  {name:<15}{tps:>8.1f} tok/s  {100 * share:>5.1f}% of bandwidth   "
              f"cold start {r['first_token_s']:6.1f} s")
    best1 = max(v for k, v in batch1.items() if k.startswith("ours"))
    bw_share = weight_bytes * best1 / (bandwidth * 1e9)
    print(f"best ours batch-1: {100 * bw_share:.0f}% of bandwidth; target >= {100 * BANDWIDTH_TARGET:g}%: "
          f"{verdict(bw_share >= BANDWIDTH_TARGET)}")
    vllm_cold = min((v for k, v in cold.items() if k.startswith("vllm")), default=None)
    if vllm_cold:
        print(f"cold start ours / vLLM: {cold['ours'] / vllm_cold:.2f}; target <= {COLD_START_TARGET:g}: "
              f"{verdict(cold['ours'] / vllm_cold <= COLD_START_TARGET)}")

    ov = None if args.skip_overhead else decode_overhead(args)
    if ov:
        print(f"decode step at batch 32 ({ov['steps']} pure-decode steps): {ov['total_ms']:.2f} ms total, "
              f"{ov['forward_ms']:.2f} ms forward, outside-forward share {100 * ov['share']:.1f}%; "
              f"target <= {100 * OVERHEAD_TARGET:g}%: {verdict(ov['share'] <= OVERHEAD_TARGET)}; "
              f"the step observer (record + waste figures) {ov['observer_us']:.0f} us per step")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")

    def r2(x):
        return None if x is None else round(x, 3)

    print(json.dumps({
        "dtype": args.dtype, "tok_s": {k: round(v[2], 2) for k, v in rows.items()},
        "ratio_to_vllm": r2(vllm_ratio), "ratio_to_hf": r2(hf_ratio), "mfu": r2(mfu),
        "mfu_by_method": {k: r2(v[2] / limit) for k, v in rows.items() if v[0] == n},
        "matmul_peak_gflops": round(peak, 1), "read_bandwidth_gbs": round(bandwidth, 2),
        "workload_tflop": round(flops / 1e12, 4), "compute_limit_tok_s": round(limit, 1),
        "batch1_tok_s": {k: round(v, 2) for k, v in batch1.items()}, "batch1_bandwidth_share": r2(bw_share),
        "first_token_s": {k: round(v, 2) for k, v in cold.items()},
        "greedy_match": {k: f"{a}/{b}" for k, (a, b) in match.items()},
        "decode_step_overhead_share_b32": None if ov is None else round(ov["share"], 4),
        "decode_step_ms_b32": None if ov is None else round(ov["total_ms"], 3),
        "observer_us_per_step": None if ov is None else round(ov["observer_us"], 1),
        "errors": errors, "num_requests": n, "quick": args.quick, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
