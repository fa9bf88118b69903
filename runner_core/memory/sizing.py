"""Sizing the KV pool: bytes per token, memory available, blocks to allocate."""

from __future__ import annotations

import os

import torch

CPU_KV_FRACTION = 0.2  # share of available RAM the CPU pool may take when kv_cache_memory is unset
CPU_KV_CAP_BYTES = 4 << 30  # and never more than this by default (as vLLM's CPU backend)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_num_blocks(*, bytes_per_token: int, block_size: int, max_model_len: int, max_num_seqs: int,
                    kv_cache_memory: int | None, device: torch.device, gpu_memory_utilization: float) -> int:
    """Blocks for the pool: `kv_cache_memory` if given; else what memory allows, capped by what
    `max_num_seqs` sequences of `max_model_len` tokens could ever use."""
    block_bytes = bytes_per_token * block_size
    wanted = -(-max_model_len * max_num_seqs // block_size)
    if kv_cache_memory is not None:
        return max(1, kv_cache_memory // block_bytes)
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - torch.cuda.memory_reserved(device)
    else:
        budget = min(int(available_memory_bytes(device) * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
    return max(1, min(wanted, budget // block_bytes))
