"""MemoryManager: the KV pool tensor (the one owner: it allocates it, binds every attention layer
to its slice, moves and shrinks it) and the blocks of every sequence — allocation, prefix caching
(hash-chained full blocks shared by reference count, evicted least recently used), forks (a parallel
sampling request's sequences share its prompt's blocks; a shared partial block is copied by the first
sequence that writes into it: copy on write, the copies handed to the step's batch), compaction, and the
pool's utilization figures.

In a parallel runner every rank holds a MemoryManager for its KV shard; rank 0's block
bookkeeping decides, and every rank moves its tensor the same way (`move_blocks`, `shrink`).
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from runner_core.layers.attention import bind_kv_cache
from runner_core.memory.block_pool import BlockPool, hash_block
from runner_core.memory.sizing import available_memory_bytes

logger = logging.getLogger("runner_core")


class Sequence(Protocol):
    """What the manager reads and writes of a sequence (the engine's `Sequence` is one): its block table and
    the hashes of its full blocks, which it owns the writing of, and the token counts it allocates for."""

    block_table: list[int]
    block_hashes: list
    num_sent_blocks: int
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int

    def block_key(self, index: int, block_size: int) -> tuple: ...


class MemoryManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.kv_cache: torch.Tensor | None = None
        self._model: nn.Module | None = None  # whose attention layers view the tensor
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.block_copies: list[tuple[int, int]] = []  # (source, destination) copies on write the next step makes

    # ---- the pool tensor --------------------------------------------------------------------
    def allocate_kv_cache(self, model: nn.Module, num_layers: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device) -> None:
        """[layers, 2 (K, V), kv_heads, slots, head_dim], slot = block_id * block_size + offset,
        bound to `model`'s attention layers (one layer slice each).

        Heads outermost, so gathering a batch's slots yields [kv_heads, batch, keys, head_dim],
        which the attention matmuls consume without another copy."""
        self._model = model
        self._bind(_zeros((num_layers, 2, num_kv_heads, self.num_blocks * self.block_size, head_dim), dtype,
                          torch.device(device)))

    def _bind(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        bind_kv_cache(self._model, kv_cache)

    def release_kv_cache(self) -> None:
        """Drop the pool tensor and the layers' views of it (before another pool is allocated, so the
        two never coexist); this manager is not to be used afterwards."""
        if self.kv_cache is not None:
            bind_kv_cache(self._model, self.kv_cache.new_empty(self.kv_cache.shape[0], 0))
        self.kv_cache = None

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

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
        grow = max(0, self.blocks_for(num_tokens) - len(seq.block_table))
        return grow + (self._shared_write_block(seq) is not None)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` so that it covers `num_tokens` tokens; first, if the block its next token
        goes into is shared (a fork's partial block), give it a copy of its own (copy on write)."""
        shared = self._shared_write_block(seq)
        if shared is not None:
            old, new = self.pool.blocks[seq.block_table[shared]], self.pool.allocate()
            self.pool.release(old)  # others still hold it
            seq.block_table[shared] = new.block_id
            seq.num_sent_blocks = min(seq.num_sent_blocks, shared)  # the ranks take the new entry
            self.block_copies.append((old.block_id, new.block_id))
        for _ in range(max(0, self.blocks_for(num_tokens) - len(seq.block_table))):
            seq.block_table.append(self.pool.allocate().block_id)

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The index of the block `seq`'s next token is written into when other sequences hold it too (only
        a fork shares a partial block: a prefix-cache hit shares full blocks, never written again)."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.pool.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` (no blocks yet) `parent`'s blocks, shared: one more reference to each."""
        for block_id in parent.block_table:
            self.pool.acquire(self.pool.blocks[block_id])
        child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies on write since the last call, for the next step's batch (every rank makes them before
        its forward writes)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first: its cached tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []
        seq.num_sent_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (speculative decoding's rejected drafts: the
        slots they wrote in a kept block are simply written again later). They were never full of final tokens,
        so never cached. The ranks take the whole table again with the next batch (a write from index 0 cuts
        their row where it ends)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            for block_id in reversed(seq.block_table[keep:]):
                self.pool.release(self.pool.blocks[block_id])
            del seq.block_table[keep:]
            seq.num_sent_blocks = 0

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
            key = seq.block_key(i, bs)
            h = hash_block(parent, key)
            block = self.pool.lookup(h, key)
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
            key = seq.block_key(i, bs)
            parent = hash_block(parent, key)
            self.pool.cache(self.pool.blocks[seq.block_table[i]], parent, key)
            seq.block_hashes.append(parent)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no sequence uses; returns how many were dropped."""
        return self.pool.evict_cached_free()

    # ---- defragmentation --------------------------------------------------------------------
    @property
    def num_occupied_blocks(self) -> int:
        """Blocks in use or holding a cached prefix (what compaction keeps)."""
        return self.num_blocks - self.pool.num_free + self.pool.num_cached_free

    def compact(self, seqs: Iterable[Sequence]) -> dict[int, int]:
        """Renumber every occupied block (in use or cached) to the lowest block ids and rewrite the
        block tables of `seqs` (all sequences holding blocks). Bookkeeping only: returns the moves
        {old id: new id} for `move_blocks`, which copies the K/V on every rank."""
        blocks = self.pool.blocks
        occupied = [b.block_id for b in blocks if b.ref_count or b.block_hash is not None]
        k = len(occupied)
        sources = [i for i in occupied if i >= k]
        holes = [i for i in range(k) if not (blocks[i].ref_count or blocks[i].block_hash is not None)]
        moves = dict(zip(sources, holes))
        if moves:
            self.pool.swap_ids(moves)
            for seq in seqs:
                seq.block_table = [moves.get(b, b) for b in seq.block_table]
            logger.info("defragmented the KV pool: moved %d blocks; occupied blocks now 0..%d", len(moves), k - 1)
        return moves

    def move_blocks(self, moves: dict[int, int]) -> None:
        """Copy the K/V of block `src` into block `dst` for every move (in this rank's tensor)."""
        self.copy_blocks(list(moves.items()))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of block `src` into block `dst` for every (src, dst) pair, in one indexed copy (every
        source is read before any destination is written); a block may be the source of several."""
        if not pairs or self.kv_cache is None:
            return
        bs, device = self.block_size, self.kv_cache.device
        ids = torch.tensor(pairs).unsqueeze(2) * bs + torch.arange(bs)  # [pairs, 2, bs] slots
        src, dst = ids[:, 0].flatten().to(device), ids[:, 1].flatten().to(device)
        self.kv_cache[:, :, :, dst] = self.kv_cache[:, :, :, src]

    @contextmanager
    def block_kept(self, block_id: int) -> Iterator[None]:
        """Restore block `block_id`'s K/V on exit, for work that writes dummy K/V there (capturing
        CUDA graphs over block 0 while it may hold a live sequence's keys)."""
        if self.kv_cache is None:
            yield
            return
        slots = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        saved = self.kv_cache[:, :, :, slots].clone()
        try:
            yield
        finally:
            self.kv_cache[:, :, :, slots] = saved

    def shrink(self, num_blocks: int) -> None:
        """Cut the pool to `num_blocks` blocks (after `compact`), releasing the memory beyond and
        re-binding the attention layers to the new tensor. The kept part is copied beside the old pool
        when the device has room for it; else it goes through host memory, the old pool released first
        (old and new together would be the peak: a shrink to free memory must not fail for want of it)."""
        if num_blocks >= self.num_blocks:
            return
        self.pool.truncate(num_blocks)
        if self.kv_cache is not None:
            kept = self.kv_cache[:, :, :, : num_blocks * self.block_size]
            device, need = kept.device, kept.numel() * kept.element_size()
            if available_memory_bytes(device) >= need:
                self._bind(kept.clone())
            else:
                staged = kept.to("cpu", copy=True)
                del kept
                self.release_kv_cache()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                self._bind(staged.to(device))
                logger.info("the shrunk KV pool (%.1f MiB) went through host memory: the device had not room for "
                            "it beside the old pool", need / 2**20)
        logger.info("shrank the KV pool to %d blocks", num_blocks)

    # ---- figures ----------------------------------------------------------------------------
    def block_map(self, seqs: dict[str, Sequence]) -> dict:
        """Which sequence (by request id) owns which block, each's in its table's order (a step detail keeps only
        holders); the blocks several hold, {block id: their request ids} (a fork's, a prefix-cache hit's); the
        free blocks that still hold a cached prefix."""
        owners = {rid: list(seq.block_table) for rid, seq in seqs.items() if seq.block_table}
        holders: dict[int, list[str]] = {}
        for rid, ids in owners.items():
            for block_id in ids:
                holders.setdefault(block_id, []).append(rid)
        pool = self.pool
        return {"num_blocks": pool.num_blocks, "block_size": self.block_size, "owners": owners,
                "shared": {b: rids for b, rids in holders.items() if len(rids) > 1},
                "cached_block_ids": [i for i in pool.free_queue if pool.blocks[i].block_hash is not None]}

    def block_counts(self) -> dict:
        """Physical block counts and the prefix cache's hit rate: O(1), in every step's record."""
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": self.num_blocks - self.pool.num_free,
            "blocks_cached": self.pool.num_cached_free,
            "blocks_free": self.pool.num_free,
            "block_size": self.block_size,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }

    def stats(self, live: Iterable[Sequence]) -> dict:
        """`block_counts` with the KV utilization and internal fragmentation of the `live` sequences.
        Every block of a live sequence is full except its last, so the figures cost O(live sequences).
        A last block that forked sequences still share (until the first of them writes to it) holds
        their common tokens: its empty slots count once, keyed by the block."""
        counts = self.block_counts()
        hit_rate = counts.pop("prefix_cache_hit_rate")
        allocated = counts["blocks_used"] * self.block_size
        empty = sum({s.block_table[-1]: len(s.block_table) * self.block_size - s.num_computed_tokens
                     for s in live if s.block_table}.values())
        return {
            **counts,
            "kv_utilization": (allocated - empty) / allocated if allocated else 0.0,
            "internal_fragmentation": empty / allocated if allocated else 0.0,
            "prefix_cache_hit_rate": hit_rate,
        }


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU it lies on fresh anonymous pages (mmap), which the kernel hands
    out zero-filled on first touch: nothing is written, and no page is resident, before the pool
    uses it, yet every byte reads as +0.0 (never left-over heap bytes, which could hold NaN)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping
