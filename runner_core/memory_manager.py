"""The KV block pool: one preallocated tensor cut into fixed-size blocks, a free list,
reference counts, per-sequence block tables, pool sizing and memory figures."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from runner_core.sequence import Sequence

logger = logging.getLogger("runner_core")

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


class MemoryManager:
    """Owns the KV pool tensor and hands out blocks to sequences."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields low ids first
        self.ref_counts = [0] * num_blocks
        self.kv_cache: torch.Tensor | None = None

    def allocate_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[layers, 2 (K, V), kv_heads, slots, head_dim], slot = block_id * block_size + offset.

        Heads outermost, so gathering a batch's slots yields [kv_heads, batch, keys, head_dim],
        which the attention matmuls consume without another copy."""
        self.kv_cache = torch.zeros(num_layers, 2, num_kv_heads, self.num_blocks * self.block_size, head_dim,
                                    dtype=dtype, device=device)
        return self.kv_cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` so that it covers `num_tokens` tokens."""
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            block = self.free_block_ids.pop()
            self.ref_counts[block] += 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_block_ids.append(block)
        seq.block_table = []

    def stats(self, live: Iterable[Sequence], max_model_len: int) -> dict:
        """Block counts, KV utilization and internal fragmentation of the live sequences."""
        live = list(live)
        used = self.num_blocks - self.num_free_blocks
        slots_allocated = used * self.block_size
        tokens = sum(min(s.num_computed_tokens, len(s.block_table) * self.block_size) for s in live)
        partial = sum(len(s.block_table) * self.block_size - s.num_computed_tokens
                      for s in live if s.block_table)
        static_slots = len([s for s in live if s.block_table]) * max_model_len
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": used,
            "blocks_free": self.num_free_blocks,
            "block_size": self.block_size,
            "kv_utilization": tokens / slots_allocated if slots_allocated else 0.0,
            "internal_fragmentation": partial / slots_allocated if slots_allocated else 0.0,
            "static_reservation_waste": 1 - tokens / static_slots if static_slots else 0.0,
        }
