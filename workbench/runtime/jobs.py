"""The session's background jobs (a tuning sweep, a what-if): the latest of each kind, one running at a time,
and their cancellation when the session closes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from workbench.runtime.handles import SessionBusyError

logger = logging.getLogger("workbench")


class Jobs:
    """The latest job of each kind (a TuneJob's "sweep", a WhatifJob's "what-if"), by that noun."""

    def __init__(self):
        self._latest: dict[str, object] = {}
        self._lock = threading.Lock()

    def keep(self, kind: str, start: Callable[[], object]):
        """Keep the job `start()` builds and launches as the latest of `kind`. SessionBusyError while the latest
        of that kind still runs."""
        with self._lock:
            running = self._latest.get(kind)
            if running is not None and not running.done:
                raise SessionBusyError(f"a {kind} is already running on this session ({running.status}); cancel it "
                                       "(job.cancel()) or wait for it (job.result()) before starting another")
            job = self._latest[kind] = start()
        return job

    def latest(self, kind: str):
        return self._latest.get(kind)

    def cancel_all(self, timeout: float) -> None:
        """Cancel the running jobs and wait for each up to `timeout` seconds."""
        jobs = [job for job in self._latest.values() if not job.done]
        for job in jobs:
            job.cancel()
        for job in jobs:
            try:
                job.result(timeout)
            except Exception:  # its error is the job's; a job still running after the timeout is a daemon thread
                logger.debug("a %s ended with an error at close", job.noun, exc_info=True)
