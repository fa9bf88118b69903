"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step first advances running sequences (a decode is one token, an unfinished
prompt continues with a chunk), preempting the newest running sequence by recompute
when the pool has no block left, then admits waiting sequences while the token budget,
`max_num_seqs` and free blocks allow (a parallel-sampling request counts as the sequences it forks into).
With speculative decoding a decode carries its drafts (`Sequence.spec_token_ids`): they count in the token
budget, are cut to what the budget leaves, and are dropped (a plain decode) before a sequence is preempted for
their blocks. Long prompts are split into chunks (chunked prefill); a
chunk never ends inside an image's placeholder tokens unless the image's features are cached
(`encoder_cached`), so an image is encoded once for the whole of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runner_core.engine.clock import WallClock
from runner_core.engine.sequence import Sequence, SequenceStatus
from runner_core.memory import MemoryManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    preempted_for: list[str] = field(default_factory=list)  # per preemption: the request whose tokens needed blocks
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue this step
    rejected: list[Sequence] = field(default_factory=list)  # can never fit in the pool

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, memory: MemoryManager, max_num_seqs: int, max_num_batched_tokens: int,
                 encoder_cached: Callable[[str], bool] = lambda digest: False, clock=None):
        self.memory, self.clock = memory, clock or WallClock()
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.encoder_cached = encoder_cached
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.memory.free(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run a parent's new children (engine/parallel_sampling.py) right after it: they are as old as it."""
        i = self.running.index(parent) + 1
        self.running[i:i] = children

    def _preempt(self, seq: Sequence, out: SchedulerOutput, needed_by: Sequence) -> None:
        self.memory.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.preempted_for.append(needed_by.request_id)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to run within `budget`; a chunk that would end inside an uncached image's
        placeholders ends before them instead (0: wait for a step with room for the whole image)."""
        start = seq.num_computed_tokens
        n = min(seq.num_tokens - start, budget)
        for item in seq.mm_items:
            if item.offset < start + n < item.offset + item.length and not self.encoder_cached(item.hash):
                n = max(0, item.offset - start) if item.offset >= start else n
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            if seq.spec_token_ids:  # a decode's drafts (engine/spec_decode.py), as many as the budget leaves room for
                del seq.spec_token_ids[budget - 1:]
                n += len(seq.spec_token_ids)
            target = seq.num_computed_tokens + n
            while not self.memory.can_allocate(seq, target):
                if seq.spec_token_ids:  # the drafts go before any sequence is preempted: a plain decode
                    n, target = 1, seq.num_computed_tokens + 1
                    seq.spec_token_ids.clear()
                    continue
                victim = self.running.pop()
                self._preempt(victim, out, seq)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                break
            self.memory.allocate(seq, target)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if len(self.running) + seq.fork_into > self.max_num_seqs:  # its forked sequences would not fit
                break
            if self.memory.blocks_for(seq.num_tokens) > self.memory.num_blocks:  # can never fit
                self.waiting.popleft()
                out.rejected.append(seq)
                continue
            if not seq.prompt_logprobs_pending:
                self.memory.match_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self.memory.can_allocate(seq, seq.num_computed_tokens + n):
                self.memory.free(seq)  # give back the cached prefix it took
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.memory.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = self.clock.now()
            self.running.append(seq)
            out.scheduled.append((seq, n))
            out.admitted.append(seq)
            budget -= n
        return out
