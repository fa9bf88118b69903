"""MemoryManager: the KV pool tensor and the blocks of every sequence — allocation, prefix
caching (hash-chained full blocks shared by reference count, evicted least recently used),
defragmentation and shrinking, and the pool's utilization figures."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from runner_core.memory.block_pool import BlockPool, hash_block
from runner_core.engine.sequence import Sequence

logger = logging.getLogger("runner_core")


class MemoryManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.kv_cache: torch.Tensor | None = None
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- the pool tensor --------------------------------------------------------------------
    def allocate_kv_cache(self, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[layers, 2 (K, V), kv_heads, slots, head_dim], slot = block_id * block_size + offset.

        Heads outermost, so gathering a batch's slots yields [kv_heads, batch, keys, head_dim],
        which the attention matmuls consume without another copy."""
        self.kv_cache = torch.zeros(num_layers, 2, num_kv_heads, self.num_blocks * self.block_size, head_dim,
                                    dtype=dtype, device=device)
        return self.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def free_block_ids(self) -> list[int]:
        return list(self.pool.free_queue)

    @property
    def ref_counts(self) -> list[int]:
        return [b.ref_count for b in self.pool.blocks]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` so that it covers `num_tokens` tokens."""
        for _ in range(self.num_new_blocks(seq, num_tokens)):
            seq.block_table.append(self.pool.allocate().block_id)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first: its cached tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []

    # ---- prefix caching ---------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks yet: take the cached full blocks of its longest cached
        prefix (at least its last token is left to compute) and mark those tokens computed."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        bs = self.block_size
        eligible = (seq.num_tokens - 1) // bs
        self.prefix_queries += eligible * bs
        parent = None
        for i in range(eligible):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                break
            self.pool.acquire(block)
            seq.block_table.append(block.block_id)
            seq.block_hashes.append(h)
            parent = h
        hit = len(seq.block_table) * bs
        self.prefix_hits += hit
        seq.num_computed_tokens = hit
        seq.num_cached_tokens = max(seq.num_cached_tokens, hit)
        return hit

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, tokens)
            self.pool.cache(self.pool.blocks[seq.block_table[i]], parent, tokens)
            seq.block_hashes.append(parent)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no sequence uses; returns how many were dropped."""
        dropped = 0
        for block_id in list(self.pool.free_queue):
            block = self.pool.blocks[block_id]
            if block.block_hash is not None:
                self.pool._uncache(block)
                self.pool.free_queue.move_to_end(block_id, last=False)
                dropped += 1
        return dropped

    # ---- defragmentation --------------------------------------------------------------------
    def defragment(self, seqs: Iterable[Sequence]) -> int:
        """Move every occupied block (in use or cached) to the lowest block ids: copy its K/V,
        rewrite the block tables of `seqs` (all sequences holding blocks). Returns blocks moved."""
        blocks = self.pool.blocks
        occupied = [b.block_id for b in blocks if b.ref_count or b.block_hash is not None]
        k = len(occupied)
        sources = [i for i in occupied if i >= k]
        holes = [i for i in range(k) if not (blocks[i].ref_count or blocks[i].block_hash is not None)]
        pairs = dict(zip(sources, holes))
        if not pairs:
            return 0
        if self.kv_cache is not None:
            bs = self.block_size
            offsets = torch.arange(bs)
            src = (torch.tensor(list(pairs)).unsqueeze(1) * bs + offsets).flatten().to(self.kv_cache.device)
            dst = (torch.tensor(list(pairs.values())).unsqueeze(1) * bs + offsets).flatten().to(self.kv_cache.device)
            self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]
        self.pool.swap_ids(pairs)
        for seq in seqs:
            seq.block_table = [pairs.get(b, b) for b in seq.block_table]
        logger.info("defragmented the KV pool: moved %d blocks; occupied blocks now 0..%d", len(pairs), k - 1)
        return len(pairs)

    def shrink(self, num_blocks: int) -> torch.Tensor | None:
        """Cut the pool to `num_blocks` blocks (after `defragment`), releasing the memory beyond.
        Returns the new pool tensor (callers holding the old one must switch)."""
        if num_blocks >= self.num_blocks:
            return self.kv_cache
        self.pool.truncate(num_blocks)
        if self.kv_cache is not None:
            self.kv_cache = self.kv_cache[:, :, :, : num_blocks * self.block_size].clone()
        logger.info("shrank the KV pool to %d blocks", num_blocks)
        return self.kv_cache

    # ---- figures ----------------------------------------------------------------------------
    def stats(self, live: Iterable[Sequence]) -> dict:
        """Physical block counts, KV utilization, internal fragmentation and prefix-cache figures.
        Every block of a live sequence is full except its last (shared blocks are full), so the
        figures cost O(live sequences)."""
        used = self.num_blocks - self.pool.num_free
        allocated = used * self.block_size
        empty = sum(len(s.block_table) * self.block_size - s.num_computed_tokens for s in live if s.block_table)
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": used,
            "blocks_cached": self.pool.num_cached_free,
            "blocks_free": self.pool.num_free,
            "block_size": self.block_size,
            "kv_utilization": (allocated - empty) / allocated if allocated else 0.0,
            "internal_fragmentation": empty / allocated if allocated else 0.0,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }
