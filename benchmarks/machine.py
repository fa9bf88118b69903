"""The limits of the device an engine runs on, measured in the same run as the engines, and the
workload's work in FLOPs.

Every probe takes a device ("cpu", "cuda:0"): the figures an engine's share is computed against come
from the device that engine ran on, never from another one.

  machine_info(device)    what the figures ran on: the CPU model, runner_core's kernel tier
                          (runner_core.kernels.kernel_tier()), torch's CPU kernel tier
                          (torch.backends.cpu.get_cpu_capability()), whether runner_core's AVX512-BF16
                          panel path is active; on CUDA the GPU's name. `run_tag(info)`: the CPU model
                          and kernel tier in a few words, for every summary line
  matmul_peak(dtype, dev) GFLOP/s of the fastest matmul code there at the benchmark's thread count:
                          torch.mm, and on the CPU runner_core's panel GEMM where it is faster (on AMD
                          CPUs MKL takes its AVX2 path: a limit set by torch.mm alone would be beaten),
                          the best over square and tall shapes (64-2048) of the fastest of several calls
  bandwidth_probes(dev)   GB/s of two methods, each at several buffer sizes past the last-level cache
                          (4x, 8x and 16x it: L3 from sysfs on the CPU, L2 on CUDA), several calls each:
                          "sum" reads the buffer once (bytes = its size), "copy" reads it and writes a
                          second buffer (bytes = twice its size, as STREAM counts a copy); each method's
                          median and range over all its calls (pool_probes: over several probe sets)
  workload_flops(...)     the useful work of a workload on a model shape: every prompt and output token
                          through every layer's linears (2 x parameters), causal attention over its
                          context (QK^T and PV), and the LM head once per output token
  decode_weight_bytes     the bytes one decode step reads from the weights (all but the input embedding
                          table, of which it reads one row per token)
  busy_cpu_seconds()      CPU seconds the whole machine's cores spent busy so far (/proc/stat), and
  cpu_seconds(pid)        one process's (/proc/PID/stat): with this process's own, what others used
                          during a run (benchmarks/contention.py's check that its idle runs were idle)
"""

from __future__ import annotations

import functools
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

import runner_core.kernels
from runner_core.config import dtype_bytes
from runner_core.memory.shapes import ModelShape

_PEAK_SHAPES = ((2048, 2048, 2048), (1024, 1024, 1024), (512, 2048, 2048), (256, 1376, 512), (64, 512, 512))
LLC_MULTIPLES = (4, 8, 16)


def device_name(device: str | torch.device) -> str:
    """The canonical name figures carry: "cpu" or "cuda:N"."""
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"
    return d.type


def _cpu_model() -> str:
    """The CPU's model name with its family and model numbers (a VM may name every EPYC alike)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
    except OSError:
        return platform.processor() or platform.machine()
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    name = fields.get("model name") or platform.processor() or platform.machine()
    return f"{name} (family {fields['cpu family']} model {fields['model']})" if "cpu family" in fields else name


def machine_info(device: str) -> dict:
    """The CPU model and kernel tier (and the GPU's name on CUDA) that the figures ran on."""
    from runner_core.kernels import cpu_kernels_available, panels_support

    kernels = cpu_kernels_available()
    tier = getattr(runner_core.kernels, "kernel_tier", None)
    info = {"device": device_name(device), "cpu_model": _cpu_model(), "kernel_tier": tier() if tier else "unknown",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_kernels": kernels,
            "bf16_panels": bool(kernels and panels_support(torch.bfloat16))}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe(info: dict) -> str:
    """One line: the device, CPU model and kernel tier."""
    gpu = f"GPU {info['gpu']}; " if "gpu" in info else ""
    bf16 = "active" if info["bf16_panels"] else "inactive"
    return (f"device {info['device']}: {gpu}CPU {info['cpu_model']}, kernel tier {info['kernel_tier']}, torch CPU "
            f"capability {info['cpu_capability']}, native kernels "
            f"{'built' if info['native_kernels'] else 'unavailable'}, bfloat16 panels {bf16}")


def run_tag(info: dict) -> str:
    """The CPU model and runner_core's kernel tier (and the GPU where one ran), for a report line."""
    gpu = f"GPU {info['gpu']}, " if "gpu" in info else ""
    return f"{gpu}CPU {info['cpu_model']}, tier {info['kernel_tier']}"


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t
    return seconds


def _fastest(fn, calls: int, device: torch.device, give_up_s: float = float("inf")) -> float:
    """The fastest of `calls` timed calls after an untimed one; the first call's time alone when that
    took over `give_up_s` (a path that slow cannot be the fastest, and repeating it can take minutes)."""
    timed = _timer(device)
    first = timed(fn)
    if first > give_up_s:
        return first
    return min(timed(fn) for _ in range(calls))


def matmul_peak(dtype: torch.dtype, device: str = "cpu", calls: int = 5) -> float:
    """GFLOP/s on `device`: the best rate of torch.mm, and on the CPU of the panel GEMM where it
    applies, over a few shapes (m x k @ k x n)."""
    from runner_core.kernels import cpu_kernels_available, pack_panels, panel_linear, panels_support

    dev = torch.device(device)
    panels = dev.type == "cpu" and cpu_kernels_available() and panels_support(dtype)
    best = 0.0
    for m, k, n in _PEAK_SHAPES:
        a, b = torch.randn(m, k).to(dev, dtype), torch.randn(k, n).to(dev, dtype)
        candidates = [functools.partial(torch.mm, a, b)]
        if panels:
            candidates.append(functools.partial(panel_linear, a, pack_panels(b.t()), n, None))
        for fn in candidates:  # torch's bfloat16 mm without native bf16 takes minutes at 2048^3: tried once
            best = max(best, 2 * m * k * n / _fastest(fn, calls, dev, give_up_s=1.0) / 1e9)
    return best


def last_level_cache_bytes(device: str = "cpu") -> int:
    """The CPU's largest cache (sysfs; 32 MiB when unreadable) or the GPU's L2."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).L2_cache_size
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * scale)
    return best or 32 << 20


def bandwidth_probes(device: str = "cpu", calls: int = 5, multiples=LLC_MULTIPLES) -> dict:
    """{"sum"|"copy": {"median", "min", "max" GB/s, "runs": [...]}, "device", "sizes_mib": [...],
    "llc_mib"} on `device`; each method is timed `calls` times at each size (after one untimed call)."""
    dev = torch.device(device)
    timed = _timer(dev)
    llc = last_level_cache_bytes(device)
    sizes = [m * llc for m in multiples]
    runs: dict[str, list[float]] = {"sum": [], "copy": []}
    for size in sizes:
        x = torch.ones(size // 4, device=dev)
        y = torch.empty_like(x)
        methods = {"sum": (x.sum, size), "copy": (functools.partial(y.copy_, x), 2 * size)}
        for name, (fn, moved) in methods.items():
            fn()
            runs[name] += [moved / timed(fn) / 1e9 for _ in range(calls)]
        del x, y
    out = {name: {"median": statistics.median(r), "min": min(r), "max": max(r), "runs": r} for name, r in runs.items()}
    return {**out, "device": device_name(device), "sizes_mib": [s >> 20 for s in sizes], "llc_mib": llc >> 20}


def pool_probes(probes: list[dict]) -> dict:
    """Several bandwidth_probes() results as one: every call of each method, its median and range."""
    out = dict(probes[0])
    for method in ("sum", "copy"):
        runs = [r for p in probes for r in p[method]["runs"]]
        out[method] = {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}
    return out


def workload_flops(shape: ModelShape, requests: list[tuple[int, int]], attention: bool = True) -> float:
    """FLOPs of the useful work of (prompt_len, output_len) requests on a dense model (`attention`
    False: the matmuls with weights alone)."""
    # every layer's projection weights (the checkpoint's *_proj.weight tensors), two FLOPs per weight
    per_token = 2 * sum(math.prod(dims) for name, dims in shape.checkpoint_tensors()
                        if name.startswith("model.layers.") and name.endswith("_proj.weight"))
    attn = 4 * shape.num_layers * shape.num_heads * shape.head_dim  # per (query, key) pair: QK^T + PV
    head = 2 * shape.hidden_size * shape.vocab_size
    total = 0.0
    for prompt, out in requests:
        tokens = prompt + out - 1  # the last output token is sampled, never fed back
        pairs = tokens * (tokens + 1) / 2  # causal: position p attends to p + 1 keys
        total += tokens * per_token + (pairs * attn if attention else 0) + out * head
    return total


def decode_weight_bytes(shape: ModelShape, dtype: str) -> int:
    """Weight bytes one decode step reads: every tensor but the input embedding table (one row of
    it per token), which is read whole only when it is also the LM head."""
    return dtype_bytes(dtype) * sum(math.prod(dims) for name, dims in shape.checkpoint_tensors()
                                    if name != "model.embed_tokens.weight" or shape.tie_word_embeddings)


def busy_cpu_seconds() -> float | None:
    """Seconds the machine's cores have spent busy since boot (/proc/stat's first line: user, nice,
    system, irq, softirq, steal); None where it cannot be read."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
