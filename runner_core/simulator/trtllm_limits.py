"""The batch limits `trtllm-bench throughput` picks when a run gives neither --max_batch_size nor
--max_num_tokens (TensorRT-LLM 1.0, PyTorch backend), as its source documents the rule, so a published figure
taken "at default settings" is simulated with the engine's own limits rather than numbers entered by hand.

The rule (tensorrt_llm/bench/build/tuning.py `calc_engine_setting` and `finetune_setting`, called from
tensorrt_llm/bench/benchmark/utils/general.py `get_settings`; the docstring: "trtllm-bench sets a slightly
optimistic upper bound for max batch size and max num tokens"):

1. the engine size is the checkpoint's parameter count x bytes per weight (1 for FP8), in GiB; the KV memory is
   (the first GPU's total memory as NVML reports it x GPUs - engine size) x kv_cache_free_gpu_mem_fraction
   (the command's default 0.90);
2. one token's KV is 2 x layers x max(tp, KV heads) x head size x bytes per KV element (1 for an FP8 cache);
   the requests the KV memory holds at ISL + OSL tokens each is `kv_cache_max_requests`;
3. raw batch = min(requests, 4096) / pp; raw tokens = min(raw batch x (1 + ISL / OSL), 32768);
4. max_batch_size rounds the raw batch up: below 256 to a multiple of 32 (at least 64), below 1024 to a
   multiple of 128, else of 256; max_num_tokens rounds the raw tokens up: below 4096 to a multiple of 256 (at
   least 2048), below 8192 to a multiple of 512, else of 1024;
5. with chunked prefill off (trtllm-bench's default), max_num_tokens is raised to at least ISL + max_batch_size.

The parameter count here is the model shape's checkpoint tensors (trtllm-bench reads the safetensors header; an
FP8 checkpoint adds only per-tensor scales, a few hundred parameters); the GPU memory is the HardwareSpec's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runner_core.loader.model_loader import read_hf_config
from runner_core.memory.shapes import ModelShape
from runner_core.models.catalogue import resolve_model
from runner_core.simulator.hardware import get_hardware

SOURCE = ("TensorRT-LLM trtllm-bench: tensorrt_llm/bench/build/tuning.py calc_engine_setting / finetune_setting, "
          "tensorrt_llm/bench/benchmark/utils/general.py get_settings (chunked prefill off: max_num_tokens >= "
          "ISL + max_batch_size)")
_GiB = 2**30


@dataclass(frozen=True)
class BenchLimits:
    """What the rule gives, with the figures it went through."""

    max_batch_size: int
    max_num_tokens: int
    kv_cache_max_requests: float  # requests of ISL + OSL tokens the KV memory holds
    engine_gib: float
    kv_cache_gib: float


# the rule's rounding: (below this raw value, up to a multiple of, at least)
BATCH_STEPS = ((256, 32, 64), (1024, 128, 0), (math.inf, 256, 0))
TOKEN_STEPS = ((4096, 256, 2048), (8192, 512, 0), (math.inf, 1024, 0))


def _round_up(raw: float, steps: tuple) -> int:
    _, multiple, least = next(step for step in steps if raw < step[0])
    return max(least, multiple * math.ceil(raw / multiple))


def _round_batch(raw: float) -> int:
    return _round_up(raw, BATCH_STEPS)


def _round_tokens(raw: float) -> int:
    return _round_up(raw, TOKEN_STEPS)


def trtllm_bench_limits(model: str, hardware: str, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        input_len: int, output_len: int, weight_bytes: float = 1.0, kv_bytes: float = 1.0,
                        kv_cache_free_gpu_mem_fraction: float = 0.90, chunked_prefill: bool = False) -> BenchLimits:
    """trtllm-bench's max_batch_size and max_num_tokens for `model` (a config-only model, a preset or a directory) on
    `hardware` x tp x pp at a dataset of ISL `input_len` / OSL `output_len` (the module docstring has the rule);
    `weight_bytes` and `kv_bytes` are bytes per weight and per KV element (FP8: 1, 16-bit: 2)."""
    for name, value in (("input_len", input_len), ("output_len", output_len),
                        ("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not 0 < kv_cache_free_gpu_mem_fraction <= 1:
        raise ValueError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {kv_cache_free_gpu_mem_fraction!r}")
    shape = ModelShape.from_hf_config(read_hf_config(resolve_model(model)))
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    params = sum(math.prod(s) for _, s in shape.checkpoint_tensors())
    engine = params * weight_bytes / _GiB
    total = get_hardware(hardware).memory_bytes / _GiB * tp * pp
    if total < engine:
        raise ValueError(f"{model} needs {engine:.1f} GiB of weights; {tp * pp}x {hardware} hold {total:.1f} GiB")
    cache = (total - engine) * kv_cache_free_gpu_mem_fraction
    per_token = 2 * shape.num_layers * max(tp, shape.num_kv_heads) * shape.head_dim * kv_bytes / _GiB
    requests = cache / (per_token * (input_len + output_len))
    raw_batch = min(requests, 4096) / pp
    raw_tokens = min(raw_batch * (1 + input_len / output_len), 32768)
    batch, tokens = _round_batch(raw_batch), _round_tokens(raw_tokens)
    if not chunked_prefill:
        tokens = max(tokens, input_len + batch)
    return BenchLimits(max_batch_size=batch, max_num_tokens=tokens, kv_cache_max_requests=requests,
                       engine_gib=engine, kv_cache_gib=cache)
