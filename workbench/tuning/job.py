"""`TuneJob`: a sweep (runner_core.tuning.tune) over a session's model, run in a background thread (not the
engine thread: the sweep submits requests and waits, the engine thread runs them), with thread-safe progress
for notebooks and dashboards, and cancel. One job per session at a time. `SweepJob` is what it shares with
workbench.whatif.job.WhatifJob (a simulated sweep: the same thread, progress, rows, points and cancel).

While a job runs its model is marked `sweeping`: the compile switch (session.set_compile_mode, the
dashboards' compile buttons) and session.reconfigure are refused with SessionBusyError. Other requests sent
to the model (the dashboards' workload button, the API) are served but share the engine with the sweep and
skew its figures, and a change between points waits for them (up to a minute, then the job fails saying
they run); unloading the model fails the job ("not loaded"); loading another model beside it is allowed.
The session's telemetry gets a "tune" event at the start, "load_start"/"load_end" around each run and
"tune_end" with the final status.
"""

from __future__ import annotations

import threading
import time

from runner_core.tuning import Target, tune
from runner_core.tuning.results import judge, point_summary
from workbench.tuning.backend import DEFAULT_WORKLOAD, SessionBackend


class SweepJob:
    """A sweep running in the background (the base of TuneJob and workbench.whatif.job.WhatifJob; a subclass
    says what it runs: `_sweep()` on the job's thread, returning the TuneResult, and `_finish()` after it).
    Read from any thread: `progress`, `rows`, `points`, `status`, `version` (bumped on every change, so a view
    redraws only when it moved), `done`, `cancelled`, `error`; `result(timeout)` waits for the TuneResult;
    `cancel()` stops it (the run in progress is cancelled too). One job of a kind per session at a time."""

    noun = "sweep"  # in status lines and messages; the session keeps its latest job of each noun

    def __init__(self, session, workload, target, *, thread_name: str, repeats: int):
        self.session, self.workload, self.target, self.repeats = session, workload, target, repeats
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._progress = None
        self._rows: list[dict] = []
        self._result = None
        self._error: BaseException | None = None
        self.started = time.monotonic()
        self.version = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def launch(self):
        """Start the sweep's thread; the job."""
        self._thread.start()
        return self

    @classmethod
    def latest(cls, session):
        """The session's latest job of this kind (running or finished), or None."""
        return session.latest_job(cls.noun)

    # ---- the sweep's thread --------------------------------------------------------------------------
    def _sweep(self):
        raise NotImplementedError

    def _finish(self) -> None:
        """After the sweep ended (any way), before `done` is set."""

    def _fields(self) -> list[str]:
        """The settings a row of this sweep holds (what `points` groups by)."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            result = self._sweep()
        except BaseException as exc:  # noqa: BLE001 - delivered by result()
            self._error = exc
        else:
            with self._lock:
                self._result = result
                self._rows = [dict(row) for row in result.rows]
        finally:
            self._finish()
            self._done.set()
            self._bump()

    def _on_progress(self, progress) -> None:
        with self._lock:
            self._progress = progress
            self._rows.append(dict(progress.last_row))  # one report per row measured (or resumed)
            self.version += 1

    def _bump(self) -> None:
        with self._lock:
            self.version += 1

    # ---- read from anywhere ----------------------------------------------------------------------------
    @property
    def progress(self):
        return self._progress

    @property
    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(row) for row in self._rows]

    @property
    def points(self) -> list[dict]:
        """The points measured so far (all their repeats), each aggregated over its repeats (median, min,
        max) and judged against the target, as the sweep's result lists them."""
        if self._result is not None:
            return list(self._result.points)
        groups: dict[str, list[dict]] = {}
        for row in self.rows:
            groups.setdefault(row["key"], []).append(row)
        config_fields = set(self._fields())
        points = []
        for rows in groups.values():
            if len(rows) < self.repeats:
                continue  # still measuring it
            fields = [k for k in rows[0] if k in config_fields]
            point = point_summary(rows, {k: rows[0][k] for k in (*fields, "concurrency")}, fields)
            judge(point, self.target)
            points.append(point)
        return points

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def status(self) -> str:
        """One line: what the sweep is doing and how long is left, or how it ended."""
        if self._error is not None:
            return f"failed: {type(self._error).__name__}: {self._error}"
        if self.done:
            n = len(self._rows)
            if self.cancelled:
                return f"cancelled after {n} run{'s' * (n != 1)}"
            return f"done: {_best_line(self._result, self.target)}"
        p = self._progress
        if p is None:
            return "starting: applying the first point and warming up"
        eta = "" if p.eta_s is None else f", about {_duration(p.eta_s)} left"
        return (f"sweeping: stage {p.stage}, point {p.point_index + 1}/{p.points_total}, "
                f"repeat {p.repeat + 1}/{self.repeats}{eta}")

    def result(self, timeout: float | None = None):
        """The TuneResult (a cancelled sweep's covers the points it finished); raises the sweep's error, or
        TimeoutError while it still runs."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the {self.noun} is still running ({self.status}); wait again or cancel() it")
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop the sweep: the run in progress has its requests cancelled; no further point starts."""
        self._stop.set()
        self._bump()

    def dataframe(self):
        """The rows so far as a pandas DataFrame (one row per point and repeat)."""
        if self._result is not None:
            return self._result.dataframe()
        import pandas as pd

        return pd.DataFrame(self.rows)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.status}>"


class TuneJob(SweepJob):
    """A sweep of a model loaded in the session (runner_core.tuning.tune over a SessionBackend)."""

    def __init__(self, session, space, workload, target, *, model: str | None, repeats: int, warmup: int, results):
        self.backend = SessionBackend(session, model)
        self.model = self.backend.model
        super().__init__(session, workload, target, thread_name=f"workbench-tune-{self.model}", repeats=repeats)
        self.backend.stop = self._stop
        self.space, self.warmup, self.results_path = space, warmup, results

    @classmethod
    def start(cls, session, space=None, workload=None, *, target=None, model: str | None = None, repeats: int = 3,
              warmup: int = 1, results=None) -> TuneJob:
        """Start a sweep of `space` (None, or concurrency=None: proposed from the model's KV capacity) with
        `workload` (None: the
        default run_load workload) under `target` (None: p99 TPOT <= 100 ms). Raises SessionBusyError while
        another sweep of the session runs."""
        def make():
            job = cls(session, space, DEFAULT_WORKLOAD if workload is None else workload,
                      Target() if target is None else target, model=model, repeats=repeats, warmup=warmup,
                      results=results)
            job.backend.entry().sweeping = True
            session.record_event("tune", model=job.model, workload=job.workload.label, target=job.target.label,
                                 repeats=repeats, warmup=warmup)
            return job.launch()

        return session.keep_job(cls.noun, make)

    def _sweep(self):
        return tune(self.space, self.workload, self.target, backend=self.backend, repeats=self.repeats,
                    warmup=self.warmup, results=self.results_path, on_progress=self._on_progress, stop=self._stop)

    def _finish(self) -> None:
        entry = self.session.models.get(self.model)
        if entry is not None:
            entry.sweeping = False
        self.session.record_event("tune_end", model=self.model, status=self.status)

    def _fields(self) -> list[str]:
        entry = self.session.models.get(self.model)
        return list(entry.config.to_dict()) if entry is not None else []

    def __repr__(self) -> str:
        return f"<TuneJob on {self.model}: {self.status}>"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _best_line(result, target) -> str:
    rec = None if result is None else result.recommendation
    if rec is None:
        return f"no recommendation ({result.why if result is not None else 'no result'})"
    if not rec["met"]:
        return f"no point met {target.label}; the closest, {rec['label']}, had {rec['value']:.1f} ms"
    return (f"best {rec['label']}: {target.metric} {rec['value']:.1f} ms (margin {rec['margin']:.0%}), "
            f"{rec['throughput']:.0f} tok/s")
