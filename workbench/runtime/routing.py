"""Request routing: the in-flight `RequestHandle`s, submitting them to a model's runner (or to a
backlog while a compile switch is pending), at once or each at its arrival time (`submit_many`),
one engine step of a model with its `RequestOutput`s dispatched to their handles, cancelling, and
failing a model's requests. Everything but `submit`, `submit_many`, `inflight` and `cancel` runs on
the engine thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from runner_core import RequestOutput, SamplingParams
from workbench.runtime.engine_thread import EngineThread
from workbench.runtime.handles import GenerationError, RequestHandle, SessionError
from workbench.runtime.loaded_models import LoadedModels, ModelEntry
from workbench.runtime.metrics import Telemetry

logger = logging.getLogger("workbench")


class Router:
    """Owns the in-flight handles (keyed by model and request id) and the backlogs."""

    def __init__(self, thread: EngineThread, models: LoadedModels, telemetry: Telemetry):
        self._thread = thread
        self._models = models
        self._telemetry = telemetry
        self._inflight: dict[tuple[str, str], RequestHandle] = {}
        self._backlog: dict[str, list[RequestHandle]] = {}  # engine thread only
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # ---- any thread -----------------------------------------------------------------------
    def inflight(self, model: str | None = None) -> list[RequestHandle]:
        with self._lock:
            return [h for (m, _), h in self._inflight.items() if model is None or m == model]

    def submit(self, entry: ModelEntry, prompt, params: SamplingParams) -> RequestHandle:
        handle = self._register(entry, prompt, params)
        self._thread.call(lambda: self._add(entry, handle))
        return handle

    def submit_many(self, entry: ModelEntry, requests: list[tuple]) -> list[RequestHandle]:
        """`requests` as (prompt, SamplingParams, arrival: seconds from now), each handed to the runner at
        its arrival by a feeder thread of their own; the handles, registered now, come back at once (a
        request cancelled before it arrives never reaches the runner)."""
        handles = [self._register(entry, prompt, params) for prompt, params, _ in requests]
        start = time.perf_counter()
        due = sorted(zip([arrival for _, _, arrival in requests], range(len(handles)), strict=True))

        def feed() -> None:
            for arrival, i in due:
                time.sleep(max(0.0, start + arrival - time.perf_counter()))
                handle = handles[i]
                handle.metrics.arrival_time = time.perf_counter()
                try:
                    self._thread.call(lambda h=handle: self._add(entry, h))
                except SessionError:  # the session closed: the rest fail with it
                    return
        threading.Thread(target=feed, name="workbench-arrivals", daemon=True).start()
        return handles

    def _register(self, entry: ModelEntry, prompt, params: SamplingParams) -> RequestHandle:
        with self._lock:
            handle = RequestHandle(request_id=f"wb-{next(self._ids)}", model=entry.name, prompt=prompt, params=params,
                                   canceller=self.cancel)
            self._inflight[(entry.name, handle.request_id)] = handle
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        if not self._thread.closed:
            self._thread.call(lambda: self._abort(handle))

    # ---- engine thread --------------------------------------------------------------------
    def has_backlog(self, model: str) -> bool:
        return bool(self._backlog.get(model))

    def release_backlog(self, entry: ModelEntry) -> None:
        """Hand the requests held for a compile switch to the runner."""
        for handle in self._backlog.pop(entry.name, []):
            self._add(entry, handle)

    def step(self, entry: ModelEntry) -> bool:
        """One engine step of `entry`, its outputs dispatched; False when the step failed (its
        requests fail with a GenerationError, the session goes on)."""
        try:
            outputs = entry.runner.step()
        except Exception as exc:
            logger.exception("step of %s failed", entry.name)
            self.fail_model(entry, GenerationError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return False
        for out in outputs:
            self._dispatch(entry.name, out)
        return True

    def fail_model(self, entry: ModelEntry, exc: BaseException) -> None:
        for handle in self.inflight(entry.name):
            if entry.runner is not None and entry.runner.engine is not None:
                entry.runner.abort_request(handle.request_id)
            self._fail(handle, exc)
        self._backlog.pop(entry.name, None)
        self._telemetry.event("error", model=entry.name, message=str(exc))

    def drop_model(self, entry: ModelEntry) -> None:
        """Abort every request of a model about to be unloaded (the aborted result where the
        runner has one, else a SessionError)."""
        for handle in self._backlog.pop(entry.name, []):
            self._fail(handle, SessionError(f"model {entry.name!r} was unloaded"))
        for handle in self.inflight(entry.name):
            out = entry.runner.abort_request(handle.request_id)
            if out is not None:
                self._dispatch(entry.name, out)
            else:
                self._fail(handle, SessionError(f"model {entry.name!r} was unloaded"))

    def _add(self, entry: ModelEntry, handle: RequestHandle) -> None:
        if handle.done:  # cancelled before it arrived
            return
        if entry.runner is None:
            return self._fail(handle, SessionError(f"model {entry.name!r} was unloaded"))
        if entry.pending_compile or entry.status != "ready":
            self._backlog.setdefault(entry.name, []).append(handle)
            return
        try:
            entry.runner.add_request(handle.prompt, handle.params, request_id=handle.request_id, stream=True,
                                     metrics=handle.metrics)
        except Exception as exc:
            self._fail(handle, exc)

    def _abort(self, handle: RequestHandle) -> None:
        backlog = self._backlog.get(handle.model, [])
        if handle in backlog:
            backlog.remove(handle)
            return self._dispatch(handle.model, _aborted(handle))
        entry = self._models.get(handle.model)
        out = entry.runner.abort_request(handle.request_id) if entry and entry.runner else None
        self._dispatch(handle.model, out or _aborted(handle))
        if out is not None and entry.status == "ready":
            self._telemetry.record(entry)  # its blocks are free now: show it

    def _dispatch(self, model: str, out: RequestOutput) -> None:
        key = (model, out.request_id)
        handle = self._inflight.get(key)
        if handle is None:
            return
        if out.finished:
            with self._lock:
                self._inflight.pop(key, None)
            if out.finish_reason == "error":
                self._telemetry.note_error(out.error)
        handle.deliver(out)

    def _fail(self, handle: RequestHandle, exc: BaseException) -> None:
        with self._lock:
            self._inflight.pop((handle.model, handle.request_id), None)
        self._telemetry.note_error(str(exc))
        handle.fail(exc)


def _aborted(handle: RequestHandle) -> RequestOutput:
    return RequestOutput.aborted(handle.request_id, handle.prompt, handle.token_ids, handle.text)
