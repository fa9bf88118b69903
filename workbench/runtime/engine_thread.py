"""The session's engine thread: the one thread that calls into runner_core (which is not
thread-safe). Other threads post commands with `call(fn) -> Future`; the loop runs them in
order and, between commands, advances the models. An exception in the loop is logged, never
fatal to the thread.
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

    def _loop(self) -> None:
        while not self.closed:
            try:
                self._drain(block=not self._has_work())
                self._advance()
            except Exception:  # never let the engine thread die
                logger.exception("workbench engine loop error")
                time.sleep(0.05)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.25) if block else self._commands.get_nowait()
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
