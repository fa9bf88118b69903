"""Which decode programs to build, and building them: the CPU sizes (`plan_sizes`), the CUDA
capture sizes and the memory the KV-pool plan leaves for their graphs (`cuda_capture_plan`),
whether a configuration will build CPU programs (`cpu_programs_expected`, for the memory estimate
before loading), and `build_decode_programs`, which builds, warms up and (by default) times them.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from runner_core.compile.compile_optimizer import WARM_START_ENV, CompileOptimizer, CompileSettings
from runner_core.compile.decode_programs import CUDAGraphDecodePrograms, DecodePrograms, PackedDecodePrograms
from runner_core.config import CUDA_GRAPH_MODES
from runner_core.layers.attention import resolve_attention_backend
from runner_core.layers.linear import packed_weight_bytes
from runner_core.memory import MemoryManager, ModelShape, available_memory_bytes, estimate_activation_peak

logger = logging.getLogger("runner_core")

GRAPH_MEMORY_FRACTION = 0.1  # decode CUDA graphs may hold at most this share of the device's memory


def default_sizes(device_type: str, max_num_seqs: int) -> list[int]:
    """CPU: [1], kept only where it measures faster (`pays_off`; at 8 and 32 tokens the packed
    GEMM is no faster than the plain one). CUDA: 1, 2, 4, 8 and multiples of 16 up to max_num_seqs."""
    if device_type != "cuda":
        return [1]
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def _compiled_settings(config, device_type: str):
    """The resolved compile settings if `config` (a RunnerConfig) compiles on one `device_type`
    device, else None."""
    device = config.torch_device
    if not config.compile or config.enforce_eager or device.type != device_type or config.world_size > 1:
        return None
    settings = CompileSettings.resolve(True, config.compile_backend, config.compile_mode, config.compile_scope, device)
    return settings if settings.enabled else None


def cpu_programs_expected(config) -> bool:
    """Whether loading `config` builds the CPU decode programs, as far as the configuration tells:
    an upper bound (the memory rule in `plan_sizes` or, by default, `pays_off` may drop them)."""
    settings = _compiled_settings(config, "cpu")
    return (settings is not None and settings.backend == "inductor" and config.compile_sizes != []
            and config.torch_dtype == torch.float32 and torch.backends.mkl.is_available()
            and os.environ.get(WARM_START_ENV, "").strip().lower() != "jit")


def _usable_sizes(configured: list[int] | None, device_type: str, max_num_seqs: int) -> list[int]:
    sizes = default_sizes(device_type, max_num_seqs) if configured is None else configured
    return [s for s in sizes if s <= max_num_seqs]


def cuda_capture_plan(config, hf_config, max_model_len: int, total_bytes: int) -> tuple[list[int], int, str]:
    """The CUDA capture sizes, the memory the KV-pool plan leaves for their graphs' private pool,
    and why. The pool holds the activation peak of the largest size's static-length decode (the
    graphs share it, captured largest first); sizes whose peak would exceed GRAPH_MEMORY_FRACTION
    of the device's `total_bytes` are not captured (the keys of max_model_len tokens are gathered
    per sequence with the gather backend: at 256 sequences x 4096 tokens that is gigabytes; flex reads the pool
    in place). ([], 0, why) where no
    runner-level graphs will be captured."""
    settings = _compiled_settings(config, "cuda")
    sizes = _usable_sizes(config.compile_sizes, "cuda", config.max_num_seqs)
    if settings is None or not sizes:
        return [], 0, "not compiling on one CUDA device, or no capture sizes"
    if settings.backend == "inductor" and settings.mode in CUDA_GRAPH_MODES:
        return [], 0, f"compile_mode={settings.mode!r}: inductor captures its own CUDA graphs"
    shape = ModelShape.from_hf_config(hf_config)
    backend = resolve_attention_backend(config.attention_backend, config.torch_device, config.block_size)
    peaks = {s: estimate_activation_peak(shape, num_tokens=s, num_seqs=s, dtype=config.torch_dtype,
                                         context_len=max_model_len, attention_backend=backend) for s in sizes}
    budget = int(total_bytes * GRAPH_MEMORY_FRACTION)
    kept = [s for s in sizes if peaks[s] <= budget]
    why = "configured" if config.compile_sizes is not None else "device default"
    if len(kept) < len(sizes):
        why += (f"; sizes {[s for s in sizes if s not in kept]} left out: their static-length decode would hold "
                f"over {GRAPH_MEMORY_FRACTION:.0%} of the device ({budget / 2**30:.1f} GiB)")
    return kept, (peaks[max(kept)] if kept else 0), why


def plan_sizes(configured: list[int] | None, model: nn.Module, dtype: torch.dtype, max_num_seqs: int,
               route: str) -> tuple[list[int], str]:
    """The CPU decode sizes to build and why (an empty list says why there are none); CUDA's
    are `cuda_capture_plan`'s."""
    if route != "aoti":
        return [], f"the {route!r} route: CPU decode programs are AOTInductor packages"
    if dtype != torch.float32:
        return [], "CPU decode programs are built for float32 runners"
    if packed_weight_bytes(model) and not torch.backends.mkl.is_available():
        return [], "row-major linear weights need MKL's packed GEMM, which this torch is built without"
    usable = _usable_sizes(configured, "cpu", max_num_seqs)
    if configured is not None and len(usable) < len(configured):
        logger.info("compile_sizes above max_num_seqs=%d are never used: %s", max_num_seqs,
                    [s for s in configured if s > max_num_seqs])
    if usable:
        need, free = packed_weight_bytes(model), available_memory_bytes("cpu")
        if need > free // 2:
            return [], (f"prepacked weights ({need / 2**30:.1f} GiB) would take over half the available "
                        f"memory ({free / 2**30:.1f} GiB)")
    return usable, "configured" if configured is not None else "device default"


def build_decode_programs(optimizer: CompileOptimizer, config, hf_config, model: nn.Module, forward_pass,
                          memory: MemoryManager, max_model_len: int) -> tuple[DecodePrograms | None, str]:
    """The static programs for pure-decode batch sizes under `optimizer`'s settings, built (or loaded)
    and warmed up through `forward_pass.dummy_decode`; (programs or None, why). The CPU default is
    kept only when it measures at least 1 / MIN_GAIN faster than the general program (`pays_off`)."""
    if not optimizer.settings.enabled:
        return None, "compilation is off"
    if config.world_size > 1:
        return None, "parallel ranks run the general program"
    device = config.torch_device
    if device.type == "cuda":
        sizes, _, why = cuda_capture_plan(config, hf_config, max_model_len, torch.cuda.mem_get_info(device)[1])
        if not sizes:
            return None, why
        memory.reset_prefix_cache()  # the capture's warm-up writes dummy K/V into block 0
        programs = CUDAGraphDecodePrograms(model, sizes, forward_pass.buffers.max_blocks * memory.block_size, device)
    else:
        sizes, why = plan_sizes(config.compile_sizes, model, config.torch_dtype, config.max_num_seqs, optimizer.route)
        if not sizes:
            return None, why
        programs = PackedDecodePrograms(model, sizes, optimizer)
    try:
        programs.build(forward_pass.dummy_decode)
    except BaseException:
        programs.release()
        raise
    if device.type == "cpu" and config.compile_sizes is None:  # the default: kept if it pays
        faster, measured = programs.pays_off(forward_pass.dummy_decode)
        if not faster:
            programs.release()
            return None, f"device default [1] dropped: {measured}"
        why = f"{why}; {measured}"
    return programs, why
