"""The checks `make gpu-check` runs on a CUDA machine (benchmarks/gpu_check.py starts each in a process of its own,
with its own time limit). Each returns its figures with "ok" (passed) and "why" (what failed), and prints them as one
JSON line as it goes, so a check cut off by its limit still reports what it measured. Every check refuses without
CUDA (`require_cuda`: a message naming the check, exit code 2). The models are presets built on this machine
(random weights, generated tokenizers): no network. What each check compares is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from runner_core import ModelRunner, SamplingParams

SMALL = "small-llama"  # float32: tokens compare exactly
REAL = "qwen2.5-0.5b"  # bfloat16 in Qwen2.5-0.5B's shape: a throughput figure worth setting against the HBM
# two batch mixes: prompt lengths and tokens to generate (the 300-token prompt is prefilled in chunks beside decodes)
MIXES = {"mix_a": ((5, 90, 300, 17, 40, 3), (24, 8, 16, 32, 4, 20)), "mix_b": ((12, 150, 7, 64), (10, 30, 18, 6))}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
BASE = {"device": "cuda", "max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 256,
        "kv_cache_memory": 1 << 28, "compile_cache_dir": "build/gpu-check-compile-cache"}


def require_cuda(check: str) -> None:
    """Exit 2, saying why, unless torch sees a CUDA device."""
    if not torch.cuda.is_available():
        print(f"gpu check {check!r} needs CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}) "
              "sees no CUDA device here. Run `make gpu-check` on a GPU machine, with GPU_PYTHON naming a Python whose "
              "torch is a CUDA build", file=sys.stderr)
        raise SystemExit(2)


def report(figures: dict) -> dict:
    print(json.dumps(figures, default=str), flush=True)
    return figures


def runner(model: str = SMALL, **config) -> ModelRunner:
    return ModelRunner({"model": model, "dtype": "float32", **BASE, **config}).load_model()


def mix(vocab_size: int, name: str, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    lengths, new = MIXES[name]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    return prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in new]


def tokens(r: ModelRunner, name: str) -> list[list[int]]:
    prompts, params = mix(r.engine.vocab_size, name)
    return [o.token_ids for o in r.generate(prompts, params)]


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """The mean share of each reference sequence that `got` matches before its first different token."""
    def prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(1, len(b))
    return round(sum(prefix(a, b) for a, b in zip(got, ref)) / max(1, len(ref)), 3)


def parity_bf16() -> dict:
    """Greedy tokens of the runner in bfloat16, flex and gather, against transformers' in bfloat16 on the same GPU:
    rounding differs between implementations, so the figure is the agreement (ok: at least half of each
    sequence, on average)."""
    import transformers

    from runner_core.models.presets import ensure_preset

    path = ensure_preset(SMALL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    prompts, params = mix(hf.config.vocab_size, "mix_a")
    refs = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=s.max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p, s in zip(prompts, params)]
    del hf
    figures = {}
    for backend in ("flex", "gather"):
        r = runner(dtype="bfloat16", attention_backend=backend)
        figures[backend] = agreement([o.token_ids for o in r.generate(prompts, params)], refs)
        r.shutdown()
    bad = [b for b, share in figures.items() if share < 0.5]
    return report({"agreement": figures, "ok": not bad, "why": f"{bad} agree on under half" if bad else ""})


def compiled_modes() -> dict:
    """Greedy tokens of inductor's modes default (with the runner's decode CUDA graphs), reduce-overhead and
    max-autotune (inductor's CUDA graph trees, split around the attention op) against eager, on two batch mixes."""
    r = runner()
    eager = {name: tokens(r, name) for name in MIXES}
    figures = {"equal": {}, "switch_s": {}, "cuda_graphs": {}, "ok": True, "why": ""}
    for mode in COMPILE_MODES:
        t = time.perf_counter()
        stats = r.set_compile_mode(True, backend="inductor", mode=mode, scope="model")
        figures["switch_s"][mode] = round(time.perf_counter() - t, 1)
        figures["cuda_graphs"][mode] = stats["cuda_graphs"]
        figures["equal"][mode] = ok = stats["enabled"] and all(tokens(r, name) == eager[name] for name in MIXES)
        if not ok:
            figures["ok"] = False
            figures["why"] += f"{mode}: {'tokens differ from eager' if stats['enabled'] else stats['reason']}; "
        report(figures)
    return figures


def quantized() -> dict:
    """int8 and int4 load on CUDA with every stored weight on the GPU, and generate; their agreement with the
    unquantized model's greedy tokens is a figure (random weights have small logit margins)."""
    from runner_core.layers.weight_storage import stored_storages

    base = runner()
    ref = tokens(base, "mix_a")
    base.shutdown()
    figures = {"ok": True, "why": ""}
    for fmt in ("int8", "int4"):
        r = runner(quantization=fmt)
        devices = sorted({t.device.type for s in stored_storages(r.model) for t in s.buffers()})
        got = tokens(r, "mix_a")
        figures[fmt] = {"devices": devices, "agreement": agreement(got, ref), "weights_bytes":
                        r.memory_stats()["weights_bytes"]}
        if devices != ["cuda"] or [len(t) for t in got] != [len(t) for t in ref]:
            figures["ok"], figures["why"] = False, figures["why"] + f"{fmt}: weights on {devices}; "
        r.shutdown()
        report(figures)
    return figures


def engine() -> dict:
    """Three figures of one runner on the GPU (float32, the pool sized from the device's memory): the activation
    estimate against the profile run's measured peak (and flex's warm-up peak); the first request's time against
    the second's (flex compiled at load, not by the first request); the steps' forward_s against CUDA events
    around each forward."""
    from runner_core.memory import ModelShape, estimate_activation_peak

    t = time.perf_counter()
    r = runner(kv_cache_memory=None, gpu_memory_utilization=0.5)
    load_s = time.perf_counter() - t
    worker, config = r.engine.worker, r.engine.config
    tokens_, seqs = config.effective_max_num_batched_tokens, config.max_num_seqs
    measured = worker.measure_activation_peak(tokens_, seqs)
    estimate = estimate_activation_peak(ModelShape.from_hf_config(worker.hf_config), num_tokens=tokens_,
                                        num_seqs=seqs, dtype=worker.dtype, context_len=worker.max_model_len,
                                        attention_backend=worker.forward_pass.attention_backend)
    one = ([list(range(3, 43))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    firsts = []
    for _ in range(2):
        t = time.perf_counter()
        r.generate(*one)
        firsts.append(round(time.perf_counter() - t, 3))
    fp, spans = worker.forward_pass, []
    execute = fp.execute

    def timed(inp):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(inp)
        end.record()
        spans.append((start, end))
        return out

    fp.execute = timed
    r.engine.step_metrics.clear()
    tokens(r, "mix_a")
    fp.execute = execute
    torch.cuda.synchronize()
    events_s = sum(s.elapsed_time(e) for s, e in spans) / 1e3
    forward_s = sum(m.forward_s for m in r.engine.step_metrics)
    figures = {"load_s": round(load_s, 1), "activation_measured_bytes": measured, "activation_estimate_bytes": estimate,
               "flex_warm_up_peak_bytes": worker.pool_plan.activation_peak_bytes, "kv_pool": worker.pool_plan.as_dict(),
               "first_two_requests_s": firsts, "forward_s": round(forward_s, 4), "cuda_events_s": round(events_s, 4)}
    why = [w for w, bad in (("the estimate is under the measured peak", estimate < measured),
                            ("the first request compiled something", firsts[0] > max(2.0, 3 * firsts[1])),
                            ("forward_s misses the GPU's time", forward_s < 0.9 * events_s)) if bad]
    return report({**figures, "ok": not why, "why": "; ".join(why)})


def roofline() -> dict:
    """Batch-1 decode of Qwen2.5-0.5B's shape in bfloat16, eager: tokens/s, and the weight bytes it reads per
    second as a share of the HBM bandwidth measured here (the roofline of batch-1 decode)."""
    from benchmarks.machine import bandwidth_probes

    bandwidth = bandwidth_probes("cuda:0", calls=3)["sum"]["median"]  # GB/s
    r = runner(REAL, dtype="bfloat16")
    r.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    r.engine.step_metrics.clear()
    r.generate([list(range(3, 35))], SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    steps = [m for m in r.engine.step_metrics if not m.num_prefill_tokens]
    tok_s = len(steps) / sum(m.total_s for m in steps)
    weights = r.memory_stats()["weights_bytes"]
    share = weights * tok_s / (bandwidth * 1e9)
    return report({"model": REAL, "batch1_tok_s": round(tok_s, 1), "weights_bytes": weights,
                   "hbm_gbs": round(bandwidth, 1), "roofline_tok_s": round(bandwidth * 1e9 / weights, 1),
                   "bandwidth_share": round(share, 3), "ok": True, "why": ""})


CHECKS = {"parity_bf16": parity_bf16, "compiled_modes": compiled_modes, "quantized": quantized, "engine": engine,
          "roofline": roofline}


def run(name: str) -> int:
    """Run check `name` here: the exit code (0 passed, 1 failed, 2 no CUDA)."""
    require_cuda(name)
    return 0 if CHECKS[name]()["ok"] else 1
