"""The staged sweep: `tune` walks layout -> concurrency -> scheduler knobs -> engine settings, each
stage on top of the best point so far, measuring every point after a warm-up with repeats, and returns
the rows, the per-point aggregates, the recommendation under the target and the Pareto frontier.
What it drives is a `TuneBackend`; `RunnerBackend` is one over a ModelRunner in this process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from runner_core.config import RECONFIGURABLE
from runner_core.host import machine_name, source_commit
from runner_core.model_runner import ModelRunner
from runner_core.tuning.driver import run_workload
from runner_core.tuning.request_metrics import RunResult, Target
from runner_core.tuning.results import (
    ResultsFile,
    best_point,
    judge,
    pareto_frontier,
    point_key,
    point_summary,
    recommend,
    settings_label,
)
from runner_core.tuning.space import SweepSpace, knob_groups, propose_space, with_concurrency
from runner_core.tuning.workload import Workload

WARMUP_REQUESTS = 8
WARMUP_SEED_OFFSET = 10_000  # warm-up prompts differ from the measured ones (no prefix-cache hits on them)


@runtime_checkable
class TuneBackend(Protocol):
    """What a sweep drives: apply settings (live where it can, reloading otherwise), run a workload."""

    def apply(self, settings: dict) -> dict:
        """Make these the current settings; returns {"seconds": float, "rebuilt": str}."""

    def run(self, workload: Workload, target: Target) -> RunResult:
        """Run the workload once and return its RunResult."""

    def capacity(self) -> dict:
        """{"kv_tokens", "max_model_len", "max_num_seqs", "block_size", ...} of the current settings."""

    def settings(self) -> dict:
        """The current value of every field a sweep may set."""


class RunnerBackend:
    """A TuneBackend over a ModelRunner it owns (built and loaded from `config`). `apply` changes the
    fields of runner_core.config.RECONFIGURABLE through `runner.reconfigure` (the same runner, no weight
    read again) and any other field by shutting the runner down and loading a new one."""

    def __init__(self, config) -> None:
        self.runner = ModelRunner(config).load_model()

    def apply(self, settings: dict) -> dict:
        current = self.runner.config.to_dict()
        unknown = sorted(set(settings) - set(current))
        if unknown:
            raise ValueError(f"unknown runner settings {unknown}: a sweep sets RunnerConfig fields")
        changes = {k: v for k, v in settings.items() if current[k] != v}
        if not changes:
            return {"seconds": 0.0, "rebuilt": "none"}
        live = {f for fields in RECONFIGURABLE.values() for f in fields}
        if set(changes) <= live:
            out = self.runner.reconfigure(**changes)
            return {"seconds": out["seconds"], "rebuilt": out["rebuilt"]}
        t0 = time.perf_counter()
        config = self.runner.config.replace(**changes)  # validated before the old runner goes
        self.runner.shutdown()
        self.runner = ModelRunner(config).load_model()
        return {"seconds": time.perf_counter() - t0, "rebuilt": "reload"}

    def run(self, workload: Workload, target: Target) -> RunResult:
        return run_workload(self.runner, workload, target=target)

    def capacity(self) -> dict:
        stats, config = self.runner.memory_stats(), self.runner.config
        return {"kv_tokens": stats["blocks_total"] * stats["block_size"], "block_size": stats["block_size"],
                "max_model_len": stats["max_model_len"], "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.effective_max_num_batched_tokens,
                "kv_bytes_per_token": stats["kv_bytes_per_token"]}

    def settings(self) -> dict:
        return self.runner.config.to_dict()

    def close(self) -> None:
        self.runner.shutdown()

    def __enter__(self) -> RunnerBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class TuneProgress:
    """Where a sweep stands, after each repeat: `points_done` counts finished points (resumed ones
    included), `eta_s` is the measured repeats' mean time x the repeats left (None before the first)."""

    stage: str
    point_index: int
    points_total: int
    repeat: int
    elapsed_s: float
    eta_s: float | None
    last_row: dict
    points_done: int = 0
    overhead: float | None = None


@dataclass
class TuneResult:
    """A sweep's outcome. `rows`: one per point x repeat (settings, summary, stage, repeat, apply_seconds,
    rebuilt, run_seconds); `points`: per point, median and [min, max] over repeats; `recommendation`:
    the best point under the target (or the closest when none meets it; None when nothing was
    measured, `why` says so); `frontier`: the Pareto points; `overhead`: the fraction of this call's
    wall time spent outside backend.run (`timings` breaks it down)."""

    rows: list[dict]
    points: list[dict]
    recommendation: dict | None
    why: str
    frontier: list[dict]
    overhead: float
    timings: dict
    plan: dict
    target: Target
    skipped: list[dict] = field(default_factory=list)
    cancelled: bool = False

    def dataframe(self):
        """The rows as a pandas DataFrame (one row per point x repeat)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def points_dataframe(self):
        """One row per point: its settings label and stage, then the median of every numeric column."""
        import pandas as pd

        return pd.DataFrame([{"label": p["label"], "stage": p["stage"], "met": p["met"], "margin": p["margin"],
                              **p["median"]} for p in self.points])


class _Cancelled(Exception):
    pass


class _Sweep:
    def __init__(self, space: SweepSpace, workload: Workload, target: Target, backend: TuneBackend, *,
                 repeats: int, warmup: int, results, on_progress, stop) -> None:
        self.space, self.workload, self.target, self.backend = space, workload, target, backend
        self.repeats, self.warmup, self.on_progress, self.stop = repeats, warmup, on_progress, stop
        self.file = None if results is None else ResultsFile(results)
        # a stored row names the machine and code it was measured on; a file of others' rows is refused
        self.provenance = {} if self.file is None else {"machine": machine_name(), "commit": source_commit()}
        self.stored = {} if self.file is None else self.file.load(self.provenance)
        self.fields = space.fields()
        current = self.initial = dict(backend.settings())
        missing = [f for f in self.fields if f not in current]
        if missing:
            raise ValueError(f"the backend has no settings {missing}; it offers {sorted(current)}")
        self.baseline = {f: current[f] for f in self.fields}
        self.baseline["concurrency"] = workload.arrivals.concurrency
        self.rows: list[dict] = []
        self.points: list[dict] = []
        self.seen: dict[str, dict] = {}
        self.skipped: list[dict] = []
        self.points_total = ((len(space.layout) if len(space.layout) > 1 else 0) + len(space.concurrency)
                             + sum(len(g) for s in ("scheduler", "engine") for g in knob_groups(getattr(space, s))))
        self.start = time.perf_counter()
        self.times = {"run_s": 0.0, "warmup_s": 0.0, "apply_s": 0.0}
        self.measured = 0

    # ---- the stages -------------------------------------------------------------------------------
    def search(self) -> None:
        layouts = self.space.layout
        best = None if len(layouts) == 1 else best_point([p for p in map(self.layout_point, layouts) if p])
        incumbent = dict(layouts[0]) if best is None else best["settings"]
        stage = [self.point("concurrency", {**incumbent, "concurrency": c}) for c in self.space.concurrency]
        best = best_point([p for p in stage if p]) or best
        for name in ("scheduler", "engine"):
            for group in knob_groups(getattr(self.space, name)):
                incumbent = best["settings"] if best else {}
                tried = [self.point(name, {**incumbent, **candidate}) for candidate in group]
                best = best_point([p for p in (best, *tried) if p])

    def layout_point(self, layout: dict) -> dict | None:
        return self.point("layout", dict(layout))

    def full(self, settings: dict) -> dict:
        return {**self.baseline, **settings}

    def point(self, stage: str, settings: dict) -> dict | None:
        """Measure one point (or reuse it: the same full settings seen before, or rows in the results
        file); None when the backend refused its settings."""
        full = self.full(settings)
        same = json.dumps(full, sort_keys=True, default=str)
        if same in self.seen:
            self.points_total -= 1
            return self.seen[same]
        key, label = point_key(settings, self.initial, self.workload, self.target), settings_label(settings)
        workload = with_concurrency(self.workload, full["concurrency"])
        applied, rows = None, []
        for repeat in range(self.repeats):
            row = self.stored.get((key, repeat))
            if row is None:
                if self.stop is not None and self.stop.is_set():
                    raise _Cancelled
                if applied is None:
                    applied = self.apply(stage, settings, full)
                    if applied is None:
                        return None
                    self.warm(workload)
                row = self.measure(stage, key, label, repeat, workload, applied)
            rows.append(row)
            self.rows.append(row)
            self.report(stage, repeat, row, len(rows) == self.repeats)
        point = point_summary(rows, settings, self.fields)
        judge(point, self.target)
        self.points.append(point)
        self.seen[same] = point
        return point

    # ---- one point's steps ------------------------------------------------------------------------
    def apply(self, stage: str, settings: dict, full: dict) -> dict | None:
        t0 = time.perf_counter()
        try:
            applied = self.backend.apply({f: full[f] for f in self.fields})
        except ValueError as e:  # ConfigError is one: a combination the engine does not allow
            self.skipped.append({"stage": stage, "settings": dict(settings), "why": str(e)})
            self.points_total -= 1
            return None
        seconds = time.perf_counter() - t0
        self.times["apply_s"] += seconds
        return {"seconds": float(applied.get("seconds", seconds)), "rebuilt": applied.get("rebuilt", "none")}

    def warm(self, workload: Workload) -> None:
        short = workload.replace(num_requests=min(WARMUP_REQUESTS, workload.num_requests),
                                 seed=workload.seed + WARMUP_SEED_OFFSET)
        for _ in range(self.warmup):
            t0 = time.perf_counter()
            self.backend.run(short, self.target)
            self.times["warmup_s"] += time.perf_counter() - t0

    def measure(self, stage, key, label, repeat, workload, applied) -> dict:
        """One recorded repeat; each repeat draws its own prompts (seed + repeat) with the same lengths'
        distribution, so prefix caching cannot reuse an earlier repeat's."""
        t0 = time.perf_counter()
        result = self.backend.run(workload.replace(seed=workload.seed + repeat), self.target)
        seconds = time.perf_counter() - t0
        self.times["run_s"] += seconds
        if self.stop is not None and self.stop.is_set():  # cut short: not a measurement (nor a row to resume)
            raise _Cancelled
        self.measured += 1
        current = self.backend.settings()
        row = {"key": key, "stage": stage, "label": label, "repeat": repeat,
               **{f: current.get(f) for f in self.fields}, "concurrency": workload.arrivals.concurrency,
               **result.summary, "apply_seconds": applied["seconds"], "rebuilt": applied["rebuilt"],
               "run_seconds": seconds, **self.provenance}
        if self.file is not None:
            self.file.append(row)
        return row

    def report(self, stage: str, repeat: int, row: dict, point_done: bool) -> None:
        if self.on_progress is None:
            return
        elapsed = time.perf_counter() - self.start
        done = len(self.points) + point_done
        left = (self.points_total - len(self.points)) * self.repeats - (repeat + 1)
        eta = None if not self.measured else elapsed / self.measured * max(0, left)
        self.on_progress(TuneProgress(stage, len(self.points), self.points_total, repeat, elapsed, eta, row,
                                      points_done=done, overhead=self.overhead(elapsed)))

    def overhead(self, wall: float) -> float:
        return 0.0 if wall <= 0 else max(0.0, wall - self.times["run_s"] - self.times["warmup_s"]) / wall

    def restore(self) -> None:
        """Puts the swept fields back as the sweep found them (the next sweep starts from the same place)."""
        if any(self.backend.settings().get(f) != self.initial[f] for f in self.fields):
            t0 = time.perf_counter()
            self.backend.apply({f: self.initial[f] for f in self.fields})
            self.times["apply_s"] += time.perf_counter() - t0

    def result(self, cancelled: bool) -> TuneResult:
        self.restore()
        wall = time.perf_counter() - self.start
        rec, why = recommend(self.points, self.target)
        timings = {"wall_s": wall, **self.times, "other_s": max(0.0, wall - sum(self.times.values())),
                   "measured_repeats": self.measured, "resumed_repeats": len(self.rows) - self.measured}
        return TuneResult(self.rows, self.points, rec, why, pareto_frontier(self.points), self.overhead(wall),
                          timings, self.space.describe(), self.target, self.skipped, cancelled)


def tune(space: SweepSpace | None = None, workload: Workload | None = None, target: Target | None = None, *,
         backend: TuneBackend, repeats: int = 3, warmup: int = 1, results=None,
         on_progress: Callable[[TuneProgress], None] | None = None,
         stop: threading.Event | None = None) -> TuneResult:
    """Search `space` (None: `propose_space` from the backend's KV capacity) for the most output
    throughput whose median `target.metric` stays under `target.limit`.

    Stages run in order, each on top of the best point so far: layout, concurrency (the workload at
    fixed concurrency; a Poisson or gamma workload keeps its arrivals, capped), scheduler knobs and
    engine settings (a grid when the values' product is at most 8, else one knob at a time, each knob's
    best kept before the next). Best = highest median output_throughput among points meeting the
    target, else the closest to it. Each point: `backend.apply` (settings equal to an earlier point's
    reuse it), `warmup` unrecorded runs of min(8, n) requests, then `repeats` recorded runs. With
    `results` (a .csv, or a .json written as JSON Lines) each row is appended as measured, naming the machine
    and commit, and a re-run skips the points x repeats already there (a file of another machine's or
    commit's rows: ValueError). `on_progress` gets a TuneProgress after each repeat;
    `stop` (an Event) is checked before each repeat and ends the sweep with the partial result
    (`cancelled=True`). The backend is left with the settings it had (apply `recommendation["settings"]`
    to keep the best)."""
    workload = Workload() if workload is None else workload
    target = Target() if target is None else target
    if not isinstance(workload, Workload) or not isinstance(target, Target):
        raise ValueError("tune takes a runner_core.tuning Workload and Target; got "
                         f"{type(workload).__name__} and {type(target).__name__}")
    if not isinstance(backend, TuneBackend):
        raise ValueError(f"backend must implement TuneBackend (apply, run, capacity, settings); got {backend!r}")
    if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"repeats must be an int >= 1 and warmup an int >= 0; got {repeats!r}, {warmup!r}")
    if space is None or space.concurrency is None:
        proposed = propose_space(backend.capacity(), workload)
        space = proposed if space is None else replace(space, concurrency=proposed.concurrency)
    sweep = _Sweep(space, workload, target, backend, repeats=repeats, warmup=warmup, results=results,
                   on_progress=on_progress, stop=stop)
    try:
        sweep.search()
    except _Cancelled:
        return sweep.result(cancelled=True)
    return sweep.result(cancelled=False)
