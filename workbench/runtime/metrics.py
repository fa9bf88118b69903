"""The session's bounded metrics time series, filled by the engine thread and polled by views.

Steps are folded into rows of at most `sample_interval` seconds each (a fast model may run
hundreds of steps a second), so a bounded deque holds minutes of history and polling stays
cheap. Every row is a flat dict of numbers (see `StepAccumulator.flush`); its `t` is seconds
since that model was loaded, and a model's rows go when it is unloaded (a reload starts a
fresh history at 0). Events (loads,
unloads, compile switches, errors) go to a second, smaller deque. `Telemetry` is what the
engine thread publishes: the series, each model's latest KV block map and the last error.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

# Memory figures copied from `ModelRunner.memory_stats()` into each row when present.
MEMORY_FIELDS = (
    "weights_bytes", "kv_pool_bytes", "kv_bytes_per_token", "blocks_total", "blocks_used", "blocks_cached",
    "blocks_free", "block_size", "kv_utilization", "internal_fragmentation", "static_reservation_waste",
    "prefix_cache_hit_rate", "activation_peak_bytes", "activations_peak_bytes", "cuda_reserved_bytes",
    "cuda_allocated_bytes", "max_model_len",
)


class MetricsSeries:
    """A thread-safe, bounded list of rows with a monotonically increasing cursor.

    `poll(cursor)` returns the rows appended since `cursor` and the new cursor; `version`
    changes whenever a row or an event is added, so a view can skip redrawing when idle.
    """

    def __init__(self, maxlen: int = 3000, max_events: int = 500):
        self._rows: deque[tuple[int, dict]] = deque(maxlen=maxlen)  # (index of the row ever appended, row)
        self._events: deque[dict] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._count = 0  # rows ever appended
        self.version = 0
        self.t0 = time.time()

    def append(self, row: dict) -> None:
        with self._lock:
            self._rows.append((self._count, row))
            self._count += 1
            self.version += 1

    def add_event(self, kind: str, **fields: Any) -> dict:
        event = {"t": time.time() - self.t0, "kind": kind, **fields}
        with self._lock:
            self._events.append(event)
            self.version += 1
        return event

    def poll(self, cursor: int = 0) -> tuple[list[dict], int]:
        """Rows appended after `cursor` (rows that fell off the bounded history, or were dropped
        with their model, are skipped)."""
        with self._lock:
            if cursor >= self._count:
                return [], self._count
            return [row for i, row in self._rows if i >= cursor], self._count

    def rows(self, model: str | None = None, last: int | None = None) -> list[dict]:
        with self._lock:
            rows = [row for _, row in self._rows]
        if model is not None:
            rows = [r for r in rows if r.get("model") == model]
        return rows[-last:] if last else rows

    def events(self, kind: str | None = None) -> list[dict]:
        with self._lock:
            events = list(self._events)
        return [e for e in events if kind is None or e["kind"] == kind]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

    def drop(self, model: str) -> None:
        """Forget the rows of `model` (it was unloaded: a reload starts its history afresh)."""
        with self._lock:
            kept = [(i, row) for i, row in self._rows if row.get("model") != model]
            self._rows.clear()
            self._rows.extend(kept)
            self.version += 1

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._events.clear()
            self.version += 1


class StepAccumulator:
    """Sums the engine's StepMetrics of one model between flushes (engine thread only). `t0`:
    the wall time (time.time()) the model was loaded, the origin of its rows' `t`."""

    def __init__(self, model: str, t0: float):
        self.model, self.t0 = model, t0
        self.last_step = 0
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self.start = now
        self.steps = self.prefill = self.decode = self.sampled = self.preempted = 0
        self.num_seqs = self.num_running = self.num_waiting = 0
        self.step_s = self.forward_s = 0.0
        self.expert_counts = None  # MoE: tokens per expert [MoE layers, experts] summed over the steps

    def add(self, m: Any) -> None:
        """Fold one StepMetrics record in (read by attribute, so new fields cost nothing)."""
        if m.step <= self.last_step:
            return
        self.last_step = m.step
        self.steps += 1
        self.prefill += m.num_prefill_tokens
        self.decode += m.num_decode_tokens
        self.sampled += m.num_sampled
        self.preempted += m.num_preempted
        self.num_seqs = max(self.num_seqs, m.num_seqs)
        self.num_running, self.num_waiting = m.num_running, m.num_waiting
        self.step_s += m.total_s
        self.forward_s += m.forward_s
        counts = getattr(m, "expert_counts", None)
        if counts is not None:
            self.expert_counts = counts.clone() if self.expert_counts is None else self.expert_counts + counts

    def flush(self, now: float, memory: Mapping[str, Any]) -> dict:
        dt = max(now - self.start, 1e-9)
        row = {
            "t": time.time() - self.t0,
            "model": self.model,
            "dt": dt,  # wall seconds this row covers
            "steps": self.steps,
            "prefill_tokens": self.prefill,
            "decode_tokens": self.decode,
            "sampled_tokens": self.sampled,
            "preempted": self.preempted,
            "num_seqs": self.num_seqs,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "tokens_per_s": self.sampled / dt if self.steps else 0.0,
            "prefill_tokens_per_s": self.prefill / dt if self.steps else 0.0,
            "step_ms": 1e3 * self.step_s / self.steps if self.steps else 0.0,
            "forward_ms": 1e3 * self.forward_s / self.steps if self.steps else 0.0,
        }
        row.update({k: memory[k] for k in MEMORY_FIELDS if k in memory})
        if self.expert_counts is not None:
            row["expert_counts"] = self.expert_counts.tolist()
        self.reset(now)
        return row


class Telemetry:
    """The metrics series, the latest KV block map of each model and the last error message:
    written by the engine thread, read from any thread. The `entry` arguments are the session's
    `ModelEntry`s (a runner, a `StepAccumulator` `acc`, and `read_memory()`)."""

    def __init__(self, *, history: int = 3000, sample_interval: float = 0.1):
        self.series = MetricsSeries(maxlen=history)
        self.sample_interval = sample_interval
        self.last_error: str | None = None
        self._block_maps: dict[str, dict] = {}
        self._steps: dict[str, tuple[list, list]] = {}  # model -> (its step records, their details), as last copied

    def accumulator(self, model: str) -> StepAccumulator:
        """A fresh accumulator for a model loaded just now: its rows' time starts at 0."""
        return StepAccumulator(model, time.time())

    def event(self, kind: str, **fields: Any) -> dict:
        return self.series.add_event(kind, **fields)

    def note_error(self, message: str) -> None:
        self.last_error = message

    def block_map(self, model: str) -> dict | None:
        return self._block_maps.get(model)

    def steps(self, model: str) -> tuple[list, list]:
        """`model`'s step records (StepMetrics) and step details (StepDetail) as the engine thread last copied
        them, each run's last step included (a copy at every row and when the model goes idle)."""
        return self._steps.get(model, ([], []))

    def forget(self, model: str) -> None:
        """`model` was unloaded: its block map, steps and rows go."""
        self._block_maps.pop(model, None)
        self._steps.pop(model, None)
        self.series.drop(model)

    def begin_step(self, entry: Any) -> None:
        if entry.acc.steps == 0:  # a row covers busy time only, not the idle time before it
            entry.acc.start = time.perf_counter()

    def end_step(self, entry: Any, flush: bool = False) -> None:
        """Fold the step just run in; write a row once the interval is full, the model is idle or `flush`."""
        runner = entry.runner
        metrics = runner.step_metrics
        if metrics:
            entry.acc.add(metrics[-1])
        now = time.perf_counter()
        if flush or now - entry.acc.start >= self.sample_interval or not runner.has_unfinished_requests():
            self.record(entry, now)

    def record(self, entry: Any, now: float | None = None) -> None:
        """Flush the step accumulator into a metrics row, with fresh memory figures, and take a
        snapshot of the model's block map."""
        now = time.perf_counter() if now is None else now
        memory = entry.read_memory()
        row = entry.acc.flush(now, memory)
        if "expert_counts" in row:  # an MoE model: which layers the rows are
            row["moe_layers"] = entry.runner.moe_stats(recent_steps=1)["layers"]
        self.series.append(row)
        self._steps[entry.name] = (list(entry.runner.step_metrics), list(entry.runner.step_details))
        snap = entry.runner.kv_block_map()
        snap["blocks_cached"] = memory.get("blocks_cached", 0)
        snap["t"] = time.time() - entry.acc.t0
        snap["model"] = entry.name
        self._block_maps[entry.name] = snap
