"""What each step did, request by request and block by block, for watching a run step by step and replaying
it: which requests ran and with how many tokens, which were admitted, preempted (and for whom) or finished,
and who owned every KV block after the step. Off unless asked for (`LLMEngine.record_step_detail`): a record
costs a pass over the pool's blocks. The records are kept in a bounded deque: the last `max_steps` steps,
with `max_steps` chosen so the block maps take at most `budget_bytes` (2 bytes a block a step)."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

FREE, CACHED, SHARED = -1, -2, -3  # a block's owner: free and empty; free with a cached prefix; held by several
MAX_STEPS = 2048
BUDGET_BYTES = 64 << 20


@dataclass(slots=True)
class StepDetail:
    """One step, as the scheduler and the pool saw it."""

    step: int  # the StepMetrics record of the same step has the same number
    scheduled: list[tuple[str, int, bool]]  # (request id, tokens run, whether a prompt chunk) in batch order
    admitted: list[str]  # taken from the waiting queue
    preempted: list[tuple[str, str]]  # (request preempted, the request whose next tokens needed its blocks)
    finished: list[str]  # stopped, reached their length, failed or aborted
    waiting: list[str]  # still waiting after the step, in queue order
    owners: tuple[str, ...]  # the request ids `block_owner` indexes
    block_owner: array  # per block after the step: an index into `owners`, FREE, CACHED or SHARED
    shared: dict[int, list[int]]  # a SHARED block -> the indices of the requests holding it

    def block_map(self) -> dict:
        """The blocks after this step in `LLMEngine.kv_block_map()`'s form (each holder's blocks in id order)."""
        return block_map(self.owners, self.block_owner, self.shared)

    def blocks_changed(self, before: StepDetail | None) -> tuple[list[int], list[int]]:
        """(blocks this step allocated: free before, held after; blocks it freed: held before, free after),
        against the step `before` it (None: a pool that was all free)."""
        was = before.block_owner if before is not None else array("h", [FREE]) * len(self.block_owner)
        allocated = [b for b, (old, new) in enumerate(zip(was, self.block_owner, strict=True))
                     if old in (FREE, CACHED) and new not in (FREE, CACHED)]
        freed = [b for b, (old, new) in enumerate(zip(was, self.block_owner, strict=True))
                 if old not in (FREE, CACHED) and new in (FREE, CACHED)]
        return allocated, freed


def block_owners(requests: dict, pool) -> tuple[tuple[str, ...], array, dict[int, list[int]]]:
    """(the ids of the requests holding blocks, each block's owner: an index into them, FREE, CACHED or SHARED,
    and the holders of each SHARED block)."""
    owners = tuple(rid for rid, seq in requests.items() if seq.block_table)
    block_owner = array("h", [FREE]) * pool.num_blocks
    for block_id in pool.cached.values():
        block_owner[block_id] = CACHED
    shared: dict[int, list[int]] = {}
    for i, rid in enumerate(owners):
        for block_id in requests[rid].block_table:
            held = block_owner[block_id]
            if held >= 0 or held == SHARED:
                shared.setdefault(block_id, [held] if held >= 0 else []).append(i)
                block_owner[block_id] = SHARED
            else:
                block_owner[block_id] = i
    return owners, block_owner, shared


def block_map(owners: tuple[str, ...], block_owner: array, shared: dict[int, list[int]]) -> dict:
    """{"num_blocks", "owners": {request id: [block ids]}, "cached_block_ids": free blocks holding a cached
    prefix}; a shared block is in each of its holders' lists."""
    held: dict[str, list[int]] = {}
    cached = []
    for block, i in enumerate(block_owner):
        if i >= 0:
            held.setdefault(owners[i], []).append(block)
        elif i == SHARED:
            for j in shared[block]:
                held.setdefault(owners[j], []).append(block)
        elif i == CACHED:
            cached.append(block)
    return {"num_blocks": len(block_owner), "owners": held, "cached_block_ids": cached}


class StepDetailRecorder:
    """The bounded record of step details; the engine's observer feeds it once per step while it is on."""

    def __init__(self, num_blocks: int, budget_bytes: int = BUDGET_BYTES, max_steps: int = MAX_STEPS):
        self.max_steps = max(16, min(max_steps, budget_bytes // max(1, 2 * num_blocks)))
        self.records: deque[StepDetail] = deque(maxlen=self.max_steps)
        self.finished: list[str] = []  # released since the last record

    def record(self, step: int, sched, waiting, requests: dict, pool) -> None:
        """Record the step `sched` (a SchedulerOutput) ran; `requests` (id -> Sequence) are the live ones and
        `pool` the BlockPool, both as the step left them."""
        owners, block_owner, shared = block_owners(requests, pool)
        self.records.append(StepDetail(
            step=step, scheduled=[(s.request_id, n, n > 1 or s.num_computed_tokens - n < s.num_prompt_tokens - 1)
                                  for s, n in sched.scheduled],
            admitted=[s.request_id for s in sched.admitted],
            preempted=list(zip([s.request_id for s in sched.preempted], sched.preempted_for, strict=True)),
            finished=self.finished, waiting=[s.request_id for s in waiting], owners=owners,
            block_owner=block_owner, shared=shared))
        self.finished = []
