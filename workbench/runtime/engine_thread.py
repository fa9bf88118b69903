"""The session's engine thread: the one thread that calls into runner_core (which is not
thread-safe). Other threads post commands with `call(fn) -> Future`; the loop runs them in
order and, between commands, advances the models. An exception in the loop is logged, never
fatal to the thread.

Its pace is a teaching mode: a wait between steps (`pace`), or no step at all until asked
(`pause`, then `step` one at a time, `resume`). Commands still run while it waits, and the
steps compute what they would unpaced; every request through the session, the API's too, is
paced alike.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from workbench.runtime.handles import SessionError

logger = logging.getLogger("workbench")


class EngineThread:
    """A daemon thread with a command queue. `advance()` is called after each batch of commands;
    while `has_work()` is false the loop waits for the next command instead (polling 4 times a second)."""

    def __init__(self, advance: Callable[[], None], has_work: Callable[[], bool], name: str = "workbench-engine"):
        self._advance = advance
        self._has_work = has_work
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.interval = 0.0  # seconds between two steps (0: as fast as they run)
        self.paused = False
        self._next_step = 0.0  # perf_counter time before which no step starts
        self._step_waiters: list[Future] = []  # step() calls, one step each, while paused

    def start(self) -> None:
        self._thread.start()
        atexit.register(_stop_ref, weakref.ref(self))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread; its result or exception lands in the Future. On the
        engine thread itself `fn` runs at once."""
        if self.closed:
            raise SessionError("the session is closed; use Session.current() for a new one")
        fut: Future = Future()
        if threading.current_thread() is self._thread:
            run_into(fut, fn)
        else:
            self._commands.put((fn, fut))
        return fut

    def set_pace(self, interval: float) -> None:
        """Wait `interval` seconds between steps from now on (0: none)."""
        self.interval = float(interval)
        self._next_step = min(self._next_step, time.perf_counter() + self.interval)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def step(self) -> Future:
        """While paused: let one step run; the Future completes once it has (with True), or with False if
        there was nothing to run. Unpaused, the engine steps on its own: a Future already done (True)."""
        fut: Future = Future()
        if not self.paused:
            fut.set_result(True)
        else:
            self.call(lambda: self._step_waiters.append(fut))
        return fut

    def _wait(self) -> float | None:
        """Seconds the loop may wait for a command before it advances again (None: advance now)."""
        if self.paused and not self._step_waiters:
            return 0.25
        if not self._has_work():
            for fut in self._step_waiters:
                fut.set_result(False)
            self._step_waiters.clear()
            return 0.25
        ahead = self._next_step - time.perf_counter()
        return ahead if ahead > 0 else None

    def _loop(self) -> None:
        while not self.closed:
            try:
                wait = self._wait()
                self._drain(wait)
                if wait is None:
                    self._advance()
                    self._next_step = time.perf_counter() + self.interval
                    if self.paused and self._step_waiters:
                        self._step_waiters.pop(0).set_result(True)
            except Exception:  # never let the engine thread die
                logger.exception("workbench engine loop error")
                time.sleep(0.05)

    def _drain(self, wait: float | None) -> None:
        """Run the queued commands; with none queued, wait up to `wait` seconds for one (None: do not wait)."""
        try:
            item = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            run_into(fut, fn)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop, wait for it, and fail the commands that arrived too late (rather than
        leave their callers waiting)."""
        self.closed = True
        self._thread.join(timeout=timeout)
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if not fut.done():
                fut.set_exception(SessionError("the session was closed"))


def run_into(fut: Future, fn: Callable[[], Any]) -> None:
    """Run `fn`, delivering its result or exception to `fut` (unless it is already done)."""
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
        if not fut.done():
            fut.set_exception(exc)
    else:
        if not fut.done():
            fut.set_result(result)


def _stop_ref(ref: weakref.ref[EngineThread]) -> None:
    thread = ref()
    if thread is not None:
        thread.closed = True  # at interpreter exit: just stop the loop
