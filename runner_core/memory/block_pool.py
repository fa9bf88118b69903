"""BlockPool: the bookkeeping of the KV blocks — reference counts, the free queue in eviction
order, and the prefix-cache map from block hash to block.

A free block may still hold a cached prefix: it stays findable by its hash until it is
handed out again (least recently used first)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its tokens are final
    key: tuple | None = None  # its tokens (and images), kept to verify a hash hit


def hash_block(parent_hash: int | None, key: tuple) -> int:
    """Chained hash of a full block: equal hashes mean equal prefixes (verified on hit). `key` is
    the block's token ids and, for image tokens, which image and where in it (Sequence.block_key),
    so two images behind the same text never share a block."""
    return hash((parent_hash, key))


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free blocks, eviction order first: uncached blocks and the least recently used cached ones
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_cached_free = 0  # free blocks still holding a cached prefix (kept as blocks move)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        """Hand out the first free block, evicting its cached prefix if it holds one."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.num_cached_free -= 1
            self._uncache(block)
        block.ref_count = 1
        return block

    def lookup(self, block_hash: int, key: tuple) -> KVBlock | None:
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.key == key else None  # a hash collision is a miss

    def acquire(self, block: KVBlock) -> None:
        """Share a block with one more sequence (a cached block, or a forked sequence's)."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
            self.num_cached_free -= 1  # a lookup only finds cached blocks
        block.ref_count += 1

    def release(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.block_id] = None
            if block.block_hash is None:  # nothing worth keeping: reuse it first
                self.free_queue.move_to_end(block.block_id, last=False)
            else:
                self.num_cached_free += 1

    def cache(self, block: KVBlock, block_hash: int, key: tuple) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self.cached:  # an equal block is cached already; keep that one
            return
        block.block_hash, block.key = block_hash, key
        self.cached[block_hash] = block.block_id

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.key = None

    def evict_cached_free(self) -> int:
        """Forget the prefixes of every free cached block (they are reused first from now on);
        returns how many there were."""
        dropped = 0
        for block_id in list(self.free_queue):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
                self.free_queue.move_to_end(block_id, last=False)
                dropped += 1
        self.num_cached_free = 0
        return dropped

    def swap_ids(self, pairs: dict[int, int]) -> None:
        """Exchange block ids pairwise (a defragmentation move: live block `src` becomes `dst`,
        and the free block `dst` becomes `src`). The caller copies the K/V and rewrites tables."""
        def rename(i: int) -> int:
            return pairs.get(i, back.get(i, i))

        back = {dst: src for src, dst in pairs.items()}
        for src, dst in pairs.items():
            a, b = self.blocks[src], self.blocks[dst]
            a.block_id, b.block_id = dst, src
            self.blocks[dst], self.blocks[src] = a, b
        self.cached = {h: rename(i) for h, i in self.cached.items()}
        self.free_queue = OrderedDict((rename(i), None) for i in self.free_queue)

    def truncate(self, num_blocks: int) -> None:
        """Forget blocks >= num_blocks; they must be free and uncached (defragment first)."""
        tail = self.blocks[num_blocks:]
        if any(b.ref_count or b.block_hash is not None for b in tail):
            raise ValueError("cannot shrink: blocks beyond the new size are in use or cached; defragment first")
        self.blocks = self.blocks[:num_blocks]
        self.free_queue = OrderedDict((i, None) for i in self.free_queue if i < num_blocks)
