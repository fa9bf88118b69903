"""What the process holds after a model is loaded: resident memory in steps, and its breakdown.

Each run (model x dtype x weight format) is a fresh process that loads the model with `ModelRunner(...).load_model()`
and records its memory (runner_core.process_memory.process_memory: resident, the anonymous and the
file-backed part, the peak) after each step of the load: Python alone; runner_core (and torch)
imported; config.json read (transformers imported); the tokenizer; the model built; the weights read;
the panel copies packed (while the runner makes them); the KV pool allocated; the load done; the freed
heap handed back (malloc_trim). A thread samples the same figures every 10 ms meanwhile (file-backed:
the checkpoint's mapped pages). The steps are seen from outside: the benchmark wraps the loader's
functions, it does not load in a way of its own.

The resident memory after load is split into: the weights (memory_stats: weights_bytes, then
panel_weights_bytes and decode_programs_bytes); the KV pool's resident part (the pool's own mappings
in /proc/self/smaps: pages not written yet hold nothing); the rotary tables; the runtime (resident
once config.json is read: Python, torch, transformers); the tokenizer; heap that malloc_trim gives
back (allocator slack); the rest. With --tracemalloc the Python heap's largest allocation sites after
load are listed too (the load runs slower).

Target (reported, never enforced): resident after load <= 1.1 x the stored weight bytes + the
KV pool + 300 MiB; peak during the load <= 1.25 x the resident after it. The stored weight bytes are
memory_stats' weights_bytes (a second copy, the panels, counts against the target). "With the pool
full" adds the pool's pages not written yet.

Run:  .venv/bin/python benchmarks/load_memory.py [--models small-llama qwen2.5-0.5b]
          [--dtypes float32 bfloat16] [--quantization none int8 int4] [--kv-cache-gib 1] [--tracemalloc]
The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time

_MiB = 1 << 20
TARGET_FACTOR, TARGET_SLACK, PEAK_FACTOR = 1.1, 300 * _MiB, 1.25
CONFIG_STEP = "config read (transformers imported)"


# ---- the child: one load in a fresh process --------------------------------------------------------
def _bare_status() -> dict:
    """process_memory's figures, read before runner_core (and torch with it) is imported."""
    with open("/proc/self/status") as f:
        text = f.read()
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "peak_rss"}
    return {v: int(re.search(rf"^{k}:\s+(\d+)", text, re.M).group(1)) * 1024 for k, v in keys.items()}


def _kv_resident(kv) -> int:
    """Resident bytes of the mappings the KV pool lies in (/proc/self/smaps), at most the pool's size."""
    if kv is None or kv.device.type != "cpu":
        return 0
    start = kv.data_ptr()
    end = start + kv.numel() * kv.element_size()
    resident, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "Rss:":
                resident += int(line.split()[1]) * 1024
    return min(resident, end - start)


def _watch(steps: list, process_memory, owner, name: str, label: str) -> None:
    """Record process memory under `label` when `owner.name` first returns (skipped where it does not exist)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        if all(label != seen for seen, _ in steps):  # the first call only (config.json is read more than once)
            steps.append((label, process_memory()))
        return out

    setattr(owner, name, wrapped)


def child(spec: dict) -> dict:
    from runner_core.process_memory import process_memory, release_freed_memory

    steps = [("python", spec["python"])]
    steps.append(("import runner_core (torch)", process_memory()))
    import torch

    from runner_core import ModelRunner
    from runner_core.engine import worker
    from runner_core.layers.rotary import RotaryEmbedding
    from runner_core.loader import model_loader
    from runner_core.memory import manager

    for owner, name, label in ((model_loader, "read_hf_config", CONFIG_STEP),
                               (model_loader, "load_tokenizer", "tokenizer"),
                               (model_loader.ModelLoader, "_build", "model built"),
                               (model_loader.ModelLoader, "_load_weights", "weights read"),
                               (model_loader, "pack_panel_weights", "panels packed"),
                               (manager.MemoryManager, "allocate_kv_cache", "KV pool allocated")):
        _watch(steps, process_memory, owner, name, label)
    assert worker.MemoryManager is manager.MemoryManager  # the worker allocates through the wrapped class
    sampled: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:  # the largest resident figures while loading, every 10 ms
        while not done.wait(0.01):
            for key, value in process_memory().items():
                sampled[key] = max(sampled.get(key, 0), value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    quant = {} if spec["quantization"] == "none" else {"quantization": spec["quantization"]}
    runner = ModelRunner({"model": spec["model"], "dtype": spec["dtype"], "device": "cpu", **quant,
                          "kv_cache_memory": int(spec["kv_cache_gib"] * (1 << 30))}).load_model()
    seconds = time.perf_counter() - t
    done.set()
    sampler.join()
    steps.append(("loaded", process_memory()))
    loaded = process_memory()
    t = time.perf_counter()
    release_freed_memory()
    trim_seconds = time.perf_counter() - t
    steps.append(("after malloc_trim", process_memory()))
    stats = runner.memory_stats()
    model = runner.model
    tables = {id(b): b for m in model.modules() if isinstance(m, RotaryEmbedding) for b in m.buffers()}
    kv = runner.engine.memory.kv_cache
    out = {"model": spec["model"], "dtype": spec["dtype"], "format": spec["quantization"], "load_seconds": seconds,
           "trim_seconds": trim_seconds,
           "steps": [(label, mem) for label, mem in steps], "loaded": loaded, "trimmed": process_memory(),
           "weights_bytes": stats["weights_bytes"], "panel_weights_bytes": stats.get("panel_weights_bytes", 0),
           "decode_programs_bytes": stats.get("decode_programs_bytes", 0), "kv_pool_bytes": stats["kv_pool_bytes"],
           "kv_resident_bytes": _kv_resident(kv),
           "rotary_bytes": sum(b.numel() * b.element_size() for b in tables.values()),
           "sampled_during_load": sampled,
           "quantization": runner.model_info().get("quantization"), "torch_threads": torch.get_num_threads()}
    if spec["tracemalloc"]:
        import tracemalloc

        snapshot = tracemalloc.take_snapshot()
        out["python_heap_bytes"] = tracemalloc.get_traced_memory()[0]
        out["python_heap_top"] = [(str(s.traceback[0]), s.size) for s in snapshot.statistics("lineno")[:8]]
    return out


# ---- the parent: one fresh process per run ----------------------------------------------------------
def run_one(model: str, dtype: str, quantization: str, kv_cache_gib: float, trace: bool) -> dict:
    spec = {"model": model, "dtype": dtype, "quantization": quantization, "kv_cache_gib": kv_cache_gib,
            "tracemalloc": trace}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {model} {dtype} {quantization} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def breakdown(r: dict) -> dict:
    """The resident memory after load, split into what holds it (bytes)."""
    steps = dict(r["steps"])
    runtime = steps[CONFIG_STEP]["rss"]
    tokenizer = steps["tokenizer"]["rss"] - runtime if "tokenizer" in steps else 0
    parts = {"weights": r["weights_bytes"], "panel copies": r["panel_weights_bytes"],
             "decode programs": r["decode_programs_bytes"], "KV pool (resident)": r["kv_resident_bytes"],
             "rotary tables": r["rotary_bytes"], "runtime (python, torch, transformers)": runtime,
             "tokenizer": max(0, tokenizer),
             "allocator slack (trimmed)": r["loaded"]["rss"] - r["trimmed"]["rss"]}
    parts["rest"] = r["loaded"]["rss"] - sum(parts.values())
    return parts


def verdict(r: dict) -> dict:
    rss, peak = r["loaded"]["rss"], r["loaded"]["peak_rss"]
    target = TARGET_FACTOR * r["weights_bytes"] + r["kv_pool_bytes"] + TARGET_SLACK
    return {"rss": rss, "peak": peak, "target": int(target), "meets_target": rss <= target,
            "peak_over_final": peak / rss, "meets_peak": peak <= PEAK_FACTOR * rss,
            "rss_pool_full": rss + r["kv_pool_bytes"] - r["kv_resident_bytes"]}


def report(r: dict) -> None:
    print(f"\n{r['model']} {r['dtype']}, weights {r['format']}: loaded in {r['load_seconds']:.1f} s, KV pool "
          f"{r['kv_pool_bytes'] / _MiB:.0f} MiB, {r['torch_threads']} torch threads")
    print(f"  {'step':<42}{'RSS MiB':>9}{'anon':>8}{'file':>8}{'peak':>8}")
    for label, mem in r["steps"]:
        print(f"  {label:<42}{mem['rss'] / _MiB:>9.0f}{mem['rss_anon'] / _MiB:>8.0f}{mem['rss_file'] / _MiB:>8.0f}"
              f"{mem['peak_rss'] / _MiB:>8.0f}")
    print(f"  {'after load, held by':<42}{'MiB':>9}   (malloc_trim took {r['trim_seconds'] * 1e3:.0f} ms)")
    for name, value in breakdown(r).items():
        print(f"  {name:<42}{value / _MiB:>9.0f}")
    v = verdict(r)
    print(f"  target: RSS {v['rss'] / _MiB:.0f} MiB <= {v['target'] / _MiB:.0f} MiB (1.1 x weights + KV pool + 300 "
          f"MiB): {'met' if v['meets_target'] else 'NOT met'}; peak {v['peak'] / _MiB:.0f} MiB = "
          f"{v['peak_over_final']:.2f} x the final (<= 1.25: {'met' if v['meets_peak'] else 'NOT met'}); "
          f"with the pool full {v['rss_pool_full'] / _MiB:.0f} MiB")
    s = r["sampled_during_load"]
    print(f"  sampled every 10 ms while loading: RSS up to {s['rss'] / _MiB:.0f} MiB, anonymous up to "
          f"{s['rss_anon'] / _MiB:.0f}, file-backed up to {s['rss_file'] / _MiB:.0f} (mapped checkpoint pages)")
    for site, size in r.get("python_heap_top", []):
        print(f"    python heap {size / _MiB:8.1f} MiB  {site}")
    if "python_heap_bytes" in r:
        print(f"    python heap in all {r['python_heap_bytes'] / _MiB:.1f} MiB (tracemalloc)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["small-llama", "qwen2.5-0.5b"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"],
                    help="the linear weights' storage formats to load (none: the compute dtype)")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="the KV pool in GiB (kv_cache_memory)")
    ap.add_argument("--tracemalloc", action="store_true", help="list the Python heap's largest allocation sites")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = {**json.loads(args.child), "python": _bare_status()}
        if spec["tracemalloc"]:
            import tracemalloc

            tracemalloc.start()
        print(json.dumps(child(spec)))
        return
    if args.kv_cache_gib <= 0:
        ap.error(f"--kv-cache-gib got {args.kv_cache_gib}; it must be > 0 (the KV pool's size in GiB)")
    import machine  # benchmarks/ is on sys.path when run as a script

    print(machine.describe(machine.machine_info("cpu")))
    results = []
    for model in args.models:
        for dtype in args.dtypes:
            for quantization in args.quantization:
                r = run_one(model, dtype, quantization, args.kv_cache_gib, args.tracemalloc)
                r["breakdown"], r["verdict"] = breakdown(r), verdict(r)
                report(r)
                results.append(r)
    print(json.dumps({"kv_cache_gib": args.kv_cache_gib, "runs": results}))


if __name__ == "__main__":
    main()
