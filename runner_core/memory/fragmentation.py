"""KV memory waste figures: the paged pool against the contiguous allocators it replaces.

Three ways to hold the same live requests' KV, in the same number of slots:

* paged (what the engine does): fixed-size blocks handed out as a sequence grows. Waste is
  the empty tail of each sequence's last block (internal fragmentation), plus any block
  owned beyond what the tokens need (over-allocation).
* static reservation (a static cache): every live request holds `max_model_len` contiguous
  slots from admission to the end.
* first fit (a variable-size contiguous allocator): every request reserves its worst case,
  prompt + max_tokens capped at max_model_len, contiguously at admission, in the lowest hole
  that fits. It wastes the reserved-but-unfilled tail and the holes between reservations
  (external fragmentation), and it refuses requests when no single hole is big enough.

Everything here is plain Python over small lists, microseconds for tens of sequences; the engine's
step observer feeds a FragmentationTracker and asks it for figures only when they are asked of it
(`memory_stats()`, or every step after `record_waste_per_step()`). No torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping

__all__ = ["FirstFitAllocator", "FragmentationTracker", "paged_figures", "static_reservation_waste"]


def paged_figures(token_counts: list[int], block_counts: list[int], block_size: int) -> dict:
    """Waste of the paged pool for the live sequences: `token_counts[i]` tokens held in KV by a
    sequence owning `block_counts[i]` blocks of `block_size` slots.

    Returns slots_allocated, slots_used (slots holding tokens), kv_utilization (used ÷
    allocated), internal_fragmentation (empty slots of partly filled blocks ÷ allocated) and
    paged_waste (allocated slots not holding tokens ÷ allocated: internal fragmentation plus
    wholly empty blocks owned ahead of need). Ratios are 0.0 when nothing is allocated.
    """
    if len(token_counts) != len(block_counts):
        raise ValueError(f"got {len(token_counts)} token counts but {len(block_counts)} block counts")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    allocated = used = partial = 0
    for tokens, blocks in zip(token_counts, block_counts):
        cap = blocks * block_size
        held = tokens if tokens < cap else cap
        allocated += cap
        used += held
        rem = held % block_size
        if rem:  # the last filled block is partly empty
            partial += block_size - rem
    return {
        "slots_allocated": allocated,
        "slots_used": used,
        "kv_utilization": used / allocated if allocated else 0.0,
        "internal_fragmentation": partial / allocated if allocated else 0.0,
        "paged_waste": (allocated - used) / allocated if allocated else 0.0,
    }


def static_reservation_waste(token_counts: list[int], max_model_len: int) -> float:
    """Share of slots wasted if each live request reserved `max_model_len` slots up front:
    1 - tokens ÷ (n × max_model_len); 0.0 with no live request."""
    if not token_counts:
        return 0.0
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    tokens = sum(t if t < max_model_len else max_model_len for t in token_counts)
    return 1.0 - tokens / (len(token_counts) * max_model_len)


class FirstFitAllocator:
    """A simulated contiguous allocator over `capacity` slots: each allocation takes one run of
    slots at the lowest address where it fits. Free space is whatever lies between allocations,
    so freed neighbours coalesce by construction. Calls cost O(live allocations)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = []  # sorted start addresses of live allocations
        self._blocks: list[tuple[int, int, Hashable]] = []  # (start, size, key), same order
        self._by_key: dict[Hashable, tuple[int, int]] = {}  # key -> (start, size)
        self.reserved = 0  # slots held by live allocations
        self.peak_allocations = 0

    # ---- placing -------------------------------------------------------------------------
    def allocate(self, key: Hashable, size: int) -> bool:
        """Reserve `size` contiguous slots for `key` in the first hole that fits (lowest address).
        False when no hole is big enough (the tracker counts those)."""
        if key in self._by_key:
            raise ValueError(f"key {key!r} already holds an allocation")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        start = self._first_fit(size)
        if start is None:
            return False
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._blocks.insert(i, (start, size, key))
        self._by_key[key] = (start, size)
        self.reserved += size
        if len(self._blocks) > self.peak_allocations:
            self.peak_allocations = len(self._blocks)
        return True

    def _first_fit(self, size: int) -> int | None:
        cursor = 0
        for start, n, _ in self._blocks:
            if start - cursor >= size:
                return cursor
            cursor = start + n
        return cursor if self.capacity - cursor >= size else None

    def free(self, key: Hashable) -> bool:
        """Release `key`'s slots; False if it holds none (never placed, or freed already)."""
        placed = self._by_key.pop(key, None)
        if placed is None:
            return False
        start, size = placed
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i], self._blocks[i]
        self.reserved -= size
        return True

    # ---- figures ---------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def free_slots(self) -> int:
        return self.capacity - self.reserved

    def allocations(self) -> list[tuple[int, int, Hashable]]:
        """Live allocations as (start, size, key), by address."""
        return list(self._blocks)

    def holes(self) -> list[tuple[int, int]]:
        """Free runs as (start, size), by address; adjacent free slots always form one run."""
        out, cursor = [], 0
        for start, n, _ in self._blocks:
            if start > cursor:
                out.append((cursor, start - cursor))
            cursor = start + n
        if cursor < self.capacity:
            out.append((cursor, self.capacity - cursor))
        return out

    def largest_hole(self) -> int:
        best, cursor = 0, 0
        for start, n, _ in self._blocks:
            if start - cursor > best:
                best = start - cursor
            cursor = start + n
        return max(best, self.capacity - cursor)

    def external_fragmentation(self) -> float:
        """1 - largest free run ÷ total free: 0 when free space is one run (or there is none),
        near 1 when it is scattered in many small holes."""
        total = self.capacity - self.reserved
        return 1.0 - self.largest_hole() / total if total else 0.0

    def in_use(self, tokens: Mapping[Hashable, int]) -> int:
        """Reserved slots holding tokens, given each key's token count (missing keys hold none)."""
        used = 0
        for key, (_, size) in self._by_key.items():
            t = tokens.get(key, 0)
            used += t if t < size else size
        return used

    def waste(self, tokens: Mapping[Hashable, int]) -> float:
        """Reserved slots not holding tokens ÷ reserved slots; 0.0 when nothing is reserved."""
        return 1.0 - self.in_use(tokens) / self.reserved if self.reserved else 0.0


class FragmentationTracker:
    """Shadows the engine with a first-fit contiguous allocator of the paged pool's size and
    merges every waste figure into one flat dict per step.

    `on_admit(request_id, reserve_tokens)` when a request is admitted (idempotent: a request
    already placed, or already waiting for room, is left as it is); `on_release(request_id)`
    when it finishes or is aborted. A request the allocator cannot place is counted and kept
    in a FIFO of deferred requests, retried (first that fits, in arrival order) whenever
    space is released, as a contiguous-reservation engine would keep it waiting.
    """

    def __init__(self, capacity_slots: int):
        self.allocator = FirstFitAllocator(capacity_slots)
        self._deferred: dict[Hashable, int] = {}  # request id -> reserve size, arrival order
        self._oversized: set[Hashable] = set()  # bigger than the whole pool: never placeable
        self.num_failed = 0  # requests that could not be placed when admitted
        self.num_failed_fragmented = 0  # ... while enough slots were free in total
        self.num_oversized = 0  # requests bigger than the whole pool (never placeable)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def __contains__(self, request_id: Hashable) -> bool:
        """Whether `request_id` is tracked: placed, or waiting for room."""
        return request_id in self.allocator or request_id in self._deferred

    def on_admit(self, request_id: Hashable, reserve_tokens: int) -> bool:
        """Place `request_id`'s worst-case reservation; True if it holds one now."""
        alloc = self.allocator
        if request_id in alloc:
            return True
        if request_id in self._deferred or request_id in self._oversized:
            return False
        size = max(1, int(reserve_tokens))
        if alloc.allocate(request_id, size):
            return True
        self.num_failed += 1
        if size > alloc.capacity:
            self.num_oversized += 1
            self._oversized.add(request_id)
            return False
        if size <= alloc.free_slots:
            self.num_failed_fragmented += 1
        self._deferred[request_id] = size
        return False

    def on_release(self, request_id: Hashable) -> None:
        """The request finished or was aborted: free its slots and place deferred requests."""
        if self._deferred.pop(request_id, None) is not None:
            return
        self._oversized.discard(request_id)
        if self.allocator.free(request_id) and self._deferred:
            placed = [rid for rid, size in self._deferred.items()
                      if size <= self.allocator.free_slots and self.allocator.allocate(rid, size)]
            for rid in placed:
                del self._deferred[rid]

    def contiguous_figures(self, tokens: Mapping[Hashable, int], max_model_len: int) -> dict:
        """What the contiguous allocators make of the live requests (`tokens`: request id -> tokens
        in KV): a static max_model_len reservation's waste, and the first-fit simulation's."""
        alloc = self.allocator
        return {
            "static_reservation_waste": static_reservation_waste(list(tokens.values()), max_model_len),
            "static_max_concurrency": alloc.capacity // max_model_len,
            "firstfit_reserved_slots": alloc.reserved,
            "firstfit_reserved_waste": alloc.waste(tokens),
            "firstfit_external_fragmentation": alloc.external_fragmentation(),
            "firstfit_num_allocations": len(alloc),
            "firstfit_peak_allocations": alloc.peak_allocations,
            "firstfit_num_deferred": len(self._deferred),
            "firstfit_failed": self.num_failed,
            "firstfit_failed_fragmented": self.num_failed_fragmented,
        }

    def snapshot(self, live: Iterable[tuple[Hashable, int, int]], block_size: int, max_model_len: int) -> dict:
        """All figures for the live sequences, given as (request_id, tokens in KV, blocks owned): the
        paged pool's (`paged_figures`) and the contiguous allocators' (`contiguous_figures`)."""
        ids, tokens, blocks = [], [], []
        for rid, t, b in live:
            ids.append(rid)
            tokens.append(t)
            blocks.append(b)
        return {**paged_figures(tokens, blocks, block_size), "num_live": len(ids),
                **self.contiguous_figures(dict(zip(ids, tokens)), max_model_len)}
