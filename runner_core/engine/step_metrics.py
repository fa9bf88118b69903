"""The step's observer: once per step, after the step's work, it records what the step did (a
`StepMetrics` in a bounded deque the workbench reads). The KV waste diagnostics (the pool's
utilization and internal fragmentation, and what the contiguous allocators it is compared with would
waste for the same live requests: a static max_model_len reservation and a first-fit simulation) are
off the step's path unless asked for: `memory_figures()` computes them on demand (`memory_stats()`,
which the workbench samples), and `waste_per_step` (`record_waste_per_step()`) puts them in every
record. The first-fit simulation sees every admission and release, in order, when it is next asked
(or every PENDING_LIMIT of them).

A record's times: `schedule_s` (the scheduler), `prepare_s` (building the step's input tensors),
`forward_s` (the model, without `prepare_s`, until the device has finished it: on CUDA the worker
synchronises before the engine stamps it), `sample_s` (sampling and handing the tokens out),
`observe_s` (this observer making the record, up to the moment it is stored, the waste figures
included when recorded) and `total_s`, their sum: from the step's start until its record is stored.
So the share of a step outside the forward, 1 - forward_s / total_s, counts the recording too. The
observer also keeps `seconds`, its own time over all steps (a benchmark figure,
benchmarks/throughput.py).

For an MoE model each record also holds the step's tokens per expert (`expert_counts`, [MoE
layers, experts], pad rows of decode programs excluded), and the observer keeps their running
total: `moe_stats()`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runner_core.engine.clock import WallClock
from runner_core.engine.step_detail import StepDetailRecorder
from runner_core.errors import InvalidRequestError
from runner_core.memory import FragmentationTracker, MemoryManager
from runner_core.memory.fragmentation import static_reservation_waste
from runner_core.spec_decode.metrics import SpecDecodingStats

PENDING_LIMIT = 4096  # admissions and releases the first-fit simulation is left behind by, at most

if TYPE_CHECKING:
    from runner_core.engine.input_batch import StepBatch
    from runner_core.engine.scheduler import Scheduler, SchedulerOutput
    from runner_core.models.moe_spec import MoESpec


@dataclass(slots=True)
class StepMetrics:
    """What one step did and how long its phases took (seconds)."""

    step: int
    time: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int
    num_preempted: int
    num_admitted: int  # taken from the waiting queue this step (a preempted request counts again on its return)
    num_finished: int  # requests that ended this step: stopped, reached their length, or failed
    num_waiting: int
    num_running: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    observe_s: float  # the observer's own time for this record
    total_s: float  # from the step's start until its record was stored: the five above together
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_cache_hit_rate: float
    expert_counts: torch.Tensor | None = None  # MoE: tokens per expert [MoE layers, experts] (int64, CPU)
    # the KV waste figures of the live requests, with StepObserver.waste_per_step (else None)
    kv_utilization: float | None = None
    internal_fragmentation: float | None = None
    static_reservation_waste: float | None = None  # what a max_model_len reservation per request would waste
    firstfit_reserved_waste: float | None = None  # a contiguous worst-case reservation per request ...
    firstfit_external_fragmentation: float | None = None  # ... and the holes between those reservations
    # the step's shape, decodes first: tokens already in the pool and tokens run, per sequence (the cost model's input)
    batch_shape: tuple[list[int], list[int]] = ((), ())
    # speculative decoding: the drafts the step verified and what was accepted (None: it verified none); a verified
    # decode counts in num_decode_tokens for its last token, its drafts in num_spec_tokens, not as prefill
    num_spec_tokens: int = 0
    spec_decoding: SpecDecodingStats | None = None


@dataclass(slots=True)
class StepTimes:
    """perf_counter stamps of a step's phases and the forward's own share of preparing inputs;
    `end`: the step's work done, just before the observer runs."""

    start: float
    scheduled: float
    executed: float
    end: float
    prepare_s: float


class StepObserver:
    def __init__(self, memory: MemoryManager, scheduler: Scheduler, max_model_len: int, history: int = 4096,
                 moe_spec: MoESpec | None = None, clock=None):
        self.memory, self.scheduler, self.max_model_len = memory, scheduler, max_model_len
        self.clock = clock or WallClock()
        self.records: deque[StepMetrics] = deque(maxlen=history)
        self.moe_spec = moe_spec
        self.expert_totals = (torch.zeros(len(moe_spec.sparse_layers), moe_spec.num_experts, dtype=torch.int64)
                              if moe_spec is not None else None)  # since load: the one running total
        self.contiguous = FragmentationTracker(memory.num_blocks * memory.block_size)
        # what the first-fit simulation has not seen yet, in order: (request, reserve) admitted, (request, None)
        # released
        self._pending: list[tuple[str, int | None]] = []
        self.waste_per_step = False  # the waste figures in every record (record_waste_per_step)
        self.detail: StepDetailRecorder | None = None  # each step's requests and block map (record_step_detail)
        self.num_steps = 0
        self.seconds = 0.0  # spent in on_step, in all

    def on_step(self, sched: SchedulerOutput, batch: StepBatch, num_sampled: int, num_finished: int,
                times: StepTimes, expert_counts: torch.Tensor | None = None, requests: dict | None = None,
                spec_decoding: SpecDecodingStats | None = None) -> None:
        """Record the step just run; `requests` (the engine's live ones) feed the step detail, when it is on;
        `spec_decoding`: the drafts the step verified (engine/spec_decode.py)."""
        t = self.clock.now()
        if expert_counts is not None:
            expert_counts = expert_counts.cpu()
            self.expert_totals += expert_counts
        for seq in sched.admitted:  # idempotent: the contiguous comparison reserves once per request
            if not seq.is_finished:
                self._pending.append((seq.request_id,
                                      min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)))
        running = self.scheduler.running
        blocks = self.memory.block_counts()
        num_spec = batch.num_spec_tokens
        self.num_steps += 1
        record = StepMetrics(
            step=self.num_steps, time=times.end, num_seqs=len(sched.scheduled),
            num_prefill_tokens=batch.num_prefill_tokens - num_spec - len(batch.spec_rows),
            num_decode_tokens=batch.num_decodes + len(batch.spec_rows), num_sampled=num_sampled,
            num_preempted=len(sched.preempted), num_admitted=len(sched.admitted), num_finished=num_finished,
            num_waiting=len(self.scheduler.waiting), num_running=len(running),
            schedule_s=times.scheduled - times.start, prepare_s=times.prepare_s,
            forward_s=times.executed - times.scheduled - times.prepare_s, sample_s=times.end - times.executed,
            observe_s=0.0, total_s=0.0, blocks_used=blocks["blocks_used"], blocks_free=blocks["blocks_free"],
            blocks_cached=blocks["blocks_cached"], prefix_cache_hit_rate=blocks["prefix_cache_hit_rate"],
            expert_counts=expert_counts, batch_shape=(batch.starts, batch.num_new_tokens), num_spec_tokens=num_spec,
            spec_decoding=spec_decoding)
        if self.detail is not None:
            self.detail.record(self.num_steps, sched, self.scheduler.waiting, requests or {}, self.memory.pool)
        if self.waste_per_step:
            self._record_waste(record, running)
        elif len(self._pending) > PENDING_LIMIT:
            self._catch_up()
        self.records.append(record)
        done = self.clock.now()
        record.observe_s, record.total_s = done - times.end, done - times.start
        self.seconds += done - t

    def _record_waste(self, record: StepMetrics, running: list) -> None:
        self._catch_up()
        mem = self.memory.stats(running)
        tokens = {s.request_id: s.num_computed_tokens for s in running}
        alloc = self.contiguous.allocator
        record.kv_utilization, record.internal_fragmentation = mem["kv_utilization"], mem["internal_fragmentation"]
        record.static_reservation_waste = static_reservation_waste(list(tokens.values()), self.max_model_len)
        record.firstfit_reserved_waste = alloc.waste(tokens)
        record.firstfit_external_fragmentation = alloc.external_fragmentation()

    def _catch_up(self) -> None:
        """The first-fit simulation takes the admissions and releases it has not seen, in order."""
        for request_id, reserve in self._pending:
            if reserve is None:
                self.contiguous.on_release(request_id)
            else:
                self.contiguous.on_admit(request_id, reserve)
        self._pending.clear()

    def on_release(self, request_id: str) -> None:
        """A request finished, failed or was aborted: the contiguous allocators free its reservation."""
        self._pending.append((request_id, None))
        if self.detail is not None:
            self.detail.finished.append(request_id)

    def record_step_detail(self, enabled: bool = True) -> None:
        """Keep each step's detail from the next step on (a fresh, bounded record), or stop and drop it."""
        self.detail = StepDetailRecorder(self.memory.num_blocks) if enabled else None

    def on_pool_resized(self) -> None:
        """The pool shrank: the comparison allocators model the new capacity (live requests re-reserve
        at their next step)."""
        self.contiguous = FragmentationTracker(self.memory.num_blocks * self.memory.block_size)
        self._pending.clear()
        if self.detail is not None:  # block ids before and after the move name other blocks
            self.record_step_detail()

    def memory_figures(self) -> dict:
        """The pool's block counts and utilization with, for the same live requests, what a static
        reservation and a first-fit contiguous allocator would waste."""
        self._catch_up()
        running = self.scheduler.running
        tokens = {s.request_id: s.num_computed_tokens for s in running}
        return {**self.memory.stats(running), **self.contiguous.contiguous_figures(tokens, self.max_model_len)}

    def moe_stats(self, recent_steps: int = 64) -> dict:
        """Tokens routed to each expert (a token counts once per expert it picked, so a layer's row adds
        up to top_k x its tokens): {"layers": global indices of the MoE layers (the rows),
        "num_experts", "top_k", "steps": steps recorded since load, "cumulative": [layers][experts]
        since load, "recent": [layers][experts] over the last "recent_steps" steps (at most
        `recent_steps`, within the step history)}. Decode-program pad rows are never counted."""
        spec = self.moe_spec
        if spec is None:
            raise InvalidRequestError("moe_stats() needs a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE); "
                                      "this model has no experts")
        if not isinstance(recent_steps, int) or recent_steps < 1:
            raise InvalidRequestError(f"recent_steps must be an int >= 1, got {recent_steps!r}")
        window = [r.expert_counts for r in list(self.records)[-recent_steps:] if r.expert_counts is not None]
        recent = torch.stack(window).sum(0) if window else torch.zeros_like(self.expert_totals)
        return {"layers": list(spec.sparse_layers), "num_experts": spec.num_experts, "top_k": spec.top_k,
                "steps": self.num_steps, "cumulative": self.expert_totals.tolist(), "recent": recent.tolist(),
                "recent_steps": len(window)}
