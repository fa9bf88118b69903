"""Sizing the KV pool: the memory a device offers, and the pool plan.

The pool gets, on CUDA, `total x gpu_memory_utilization - weights - activation peak - memory
held outside torch (device used - torch reserved)`, the activation peak being the larger of
a profile run and the formula of `estimate.estimate_activation_peak` (which also covers the
paged attention's reads of long contexts that the profile run cannot see). On the CPU it
gets `CPU_KV_FRACTION` of the available RAM, at most `CPU_KV_CAP_BYTES` (as vLLM's CPU
backend), and never more than `max_num_seqs` sequences of `max_model_len` tokens can use.
`kv_cache_memory` (bytes) overrides both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from runner_core.errors import ConfigError
from runner_core.memory.estimate import estimate_activation_peak
from runner_core.memory.shapes import MiB, ModelShape

logger = logging.getLogger("runner_core")

CPU_KV_FRACTION = 0.2  # share of available RAM the CPU pool may take when kv_cache_memory is unset
CPU_KV_CAP_BYTES = 4 << 30  # and never more than this by default (as vLLM's CPU backend)


def _cpu_available_bytes() -> int:
    """MemAvailable (free plus reclaimable page cache), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory_bytes(device: torch.device | str) -> int:
    """Memory free right now: on CUDA the device's free bytes, on the CPU the available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return _cpu_available_bytes()


def usable_memory_bytes(device: torch.device | str, gpu_memory_utilization: float = 0.9) -> int:
    """What a model may use on `device`: CUDA total x gpu_memory_utilization; CPU available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return int(total * gpu_memory_utilization)
    return _cpu_available_bytes()


def non_torch_memory_bytes(device: torch.device | str) -> int:
    """CUDA memory in use but not reserved by this process's torch allocator (CUDA context,
    libraries' workspaces, other processes); 0 on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


@dataclass(slots=True)
class PoolPlan:
    """How big the KV pool is and why."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int
    activation_peak_bytes: int
    source: str  # "kv_cache_memory", "gpu_memory_utilization" or "cpu_ram"
    budget_bytes: int  # memory the source allowed before rounding down to blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the pool holds at once."""
        return self.num_tokens / self.max_model_len

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({self.num_bytes / MiB:.1f} MiB, sized by {self.source}); maximum concurrency at "
                f"max_model_len={self.max_model_len}: {self.max_concurrency:.2f}x")

    def check_holds(self, max_model_len: int, where: str = "") -> None:
        """ConfigError unless the pool holds one max_model_len sequence, naming the KV memory that would."""
        if self.num_tokens < max_model_len:
            bs = self.block_size
            raise ConfigError(
                f"{where}the KV pool holds {self.num_tokens} tokens ({self.num_blocks} blocks of {bs}), fewer than one "
                f"max_model_len={max_model_len} sequence needs; raise kv_cache_memory to at least "
                f"{-(-max_model_len // bs) * bs * self.bytes_per_token} bytes or lower max_model_len")

    def as_dict(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_size": self.block_size, "num_tokens": self.num_tokens,
                "num_bytes": self.num_bytes, "bytes_per_token": self.bytes_per_token,
                "max_model_len": self.max_model_len, "max_concurrency": self.max_concurrency,
                "activation_peak_bytes": self.activation_peak_bytes, "source": self.source,
                "budget_bytes": self.budget_bytes}


def plan_pool(*, bytes_per_token: int, block_size: int, max_model_len: int, max_num_seqs: int,
              kv_cache_memory: int | None, device: torch.device | str, gpu_memory_utilization: float = 0.9,
              weights_bytes: int = 0, activation_peak_bytes: int = 0, total_bytes: int | None = None,
              non_torch_bytes: int | None = None, available_bytes: int | None = None,
              reserved_bytes: int = 0) -> PoolPlan:
    """The pool for these settings (see the module docstring). `total_bytes`, `non_torch_bytes`
    (CUDA) and `available_bytes` (CPU RAM) default to what the device reports now; `reserved_bytes`
    (CUDA) is kept free for other long-lived allocations (decode CUDA graphs). The plan may
    hold fewer tokens than one max_model_len sequence; the caller refuses that."""
    device = torch.device(device)
    block_bytes = bytes_per_token * block_size
    wanted = -(-max_model_len * max_num_seqs // block_size)
    if kv_cache_memory is not None:
        source, budget = "kv_cache_memory", kv_cache_memory
        num_blocks = max(1, budget // block_bytes)
    elif device.type == "cuda":
        if total_bytes is None:
            total_bytes = torch.cuda.mem_get_info(device)[1]
        if non_torch_bytes is None:
            non_torch_bytes = non_torch_memory_bytes(device)
        source = "gpu_memory_utilization"
        budget = (int(total_bytes * gpu_memory_utilization) - weights_bytes - activation_peak_bytes - non_torch_bytes
                  - reserved_bytes)
        num_blocks = max(0, budget // block_bytes)
    else:
        if available_bytes is None:
            available_bytes = _cpu_available_bytes()
        source = "cpu_ram"
        budget = min(int(available_bytes * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
        num_blocks = max(1, min(wanted, budget // block_bytes))
    return PoolPlan(num_blocks=num_blocks, block_size=block_size, bytes_per_token=bytes_per_token,
                    max_model_len=max_model_len, activation_peak_bytes=activation_peak_bytes, source=source,
                    budget_bytes=budget)


def plan_kv_pool(config, shape: ModelShape, max_model_len: int, *, bytes_per_token: int, weights_bytes: int,
                 attention_backend: str, measured_peak_bytes: int | None = None, reserved_bytes: int = 0) -> PoolPlan:
    """The pool plan of a loaded model (`shape`, its stage's layers) under `config` (a RunnerConfig).

    The activation peak is the formula's figure for the resolved `attention_backend` (gather copies
    each context out of the pool; flex and native read it in place), raised to `measured_peak_bytes` (a profile run,
    `profile.profile_activation_peak`) when given; `weights_bytes` counts the model's parameters and
    buffers on the device; `reserved_bytes` (CUDA) stays free for the decode CUDA graphs.
    """
    device, dtype = config.torch_device, config.torch_dtype
    tokens, seqs = config.effective_max_num_batched_tokens, config.max_num_seqs
    activation = estimate_activation_peak(
        shape, num_tokens=tokens, num_seqs=seqs, dtype=dtype, tensor_parallel_size=config.tensor_parallel_size,
        context_len=max_model_len, attention_backend=attention_backend)
    if measured_peak_bytes is not None:
        logger.info("profile run: %d tokens, %d sequences: activation peak %.1f MiB measured, %.1f MiB estimated",
                    tokens, seqs, measured_peak_bytes / MiB, activation / MiB)
        activation = max(activation, measured_peak_bytes)
    if reserved_bytes:
        logger.info("leaving %.1f MiB for the decode CUDA graphs (estimated)", reserved_bytes / MiB)
    return plan_pool(bytes_per_token=bytes_per_token, block_size=config.block_size, max_model_len=max_model_len,
                     max_num_seqs=seqs, kv_cache_memory=config.kv_cache_memory, device=device,
                     gpu_memory_utilization=config.gpu_memory_utilization, weights_bytes=weights_bytes,
                     activation_peak_bytes=activation, reserved_bytes=reserved_bytes)
