"""`RequestHandle`: what `Session.submit` returns — stream, result, cancel, its timing — and the session's
errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from runner_core import RequestMetrics, RunnerError


class SessionError(RunnerError):
    """A session operation cannot be done in the session's current state (the message says why)."""


class SessionBusyError(SessionError):
    """The operation conflicts with work in progress (a load, a generation); retry when it is done."""


class NoModelError(SessionError):
    """No model is loaded (or the named one is not)."""


class GenerationError(RunnerError):
    """A generation failed inside the engine; the session and other requests are unaffected."""


WAIT_SLICE_S = 0.1  # the longest a waiting reader goes without running pending signal handlers


class CompletionStream:
    """What a handle received of one completion (`SamplingParams.n` of them): text pieces, token ids, their
    logprobs (with SamplingParams.logprobs) and its finish reason once it ended."""

    __slots__ = ("pieces", "token_ids", "logprobs", "finish_reason")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.finish_reason: str | None = None


class RequestHandle:
    """One submitted generation. Filled by the engine thread; read from any thread.

    `stream()` yields text pieces as they are produced (several readers may stream the same
    handle, and a late reader gets the whole text); `result(timeout)` waits for the final
    `RequestOutput`; `cancel()` aborts it. A request that failed raises from both. With SamplingParams.n > 1
    `completions` holds each completion's pieces by index (`text_since`, `tokens_since` take an index; `stream`,
    `token_ids`, `logprobs` are completion 0's). `metrics` is its
    RequestMetrics: arriving when submitted, then filled by the engine (its tokens' times, its end), or
    ended here when it never ran (refused, failed, cancelled before it reached the engine).
    """

    def __init__(self, request_id: str, model: str, prompt: Any, params: Any,
                 canceller: Callable[[RequestHandle], None]):
        self.request_id, self.model, self.prompt, self.params = request_id, model, prompt, params
        self._canceller = canceller
        self._cond = threading.Condition()
        self.completions = [CompletionStream() for _ in range(getattr(params, "n", 1))]
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # with SamplingParams.prompt_logprobs
        self.output = None  # the final RequestOutput
        self.exception: BaseException | None = None
        self.metrics = RequestMetrics(time.perf_counter(), len(prompt) if isinstance(prompt, list) else 0)
        self._done_callbacks: list[Callable[[RequestHandle], None]] = []
        self._update_callbacks: list[Callable[[RequestHandle], None]] = []

    # ---- written by the engine thread (workbench.runtime.routing) -----------------------------------
    def deliver(self, out) -> None:
        """Take the engine's next RequestOutput of this request."""
        with self._cond:
            for c in out.outputs:
                done = self.completions[c.index]
                done.token_ids.extend(c.delta_token_ids)
                if c.logprobs is not None:  # the engine's list grows on: copy the tokens' entries delivered
                    done.logprobs = done.logprobs or []
                    done.logprobs.extend(c.logprobs[len(done.logprobs):len(done.token_ids)])
                if c.delta_text:
                    done.pieces.append(c.delta_text)
                if c.finished:
                    done.finish_reason = c.finish_reason
            if out.prompt_logprobs is not None:  # complete before the first output
                self.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                self.output = out
                if self.metrics.finished_time is None:  # an output the engine did not make (cancelled before it ran)
                    self.metrics.finish(time.perf_counter(), out.finish_reason, out.error)
                if out.finish_reason == "error":
                    self.exception = GenerationError(out.error or "the generation failed")
            self._cond.notify_all()
        for fn in self._update_callbacks:
            fn(self)
        if out.finished:
            self._run_done_callbacks()

    def fail(self, exc: BaseException) -> None:
        """End the request with `exc` (it never reached the engine, or its model went away)."""
        with self._cond:
            if self.output is None and self.exception is None:
                self.exception = exc
                if self.metrics.finished_time is None:
                    self.metrics.finish(time.perf_counter(), "error", str(exc))
            self._cond.notify_all()
        self._run_done_callbacks()

    def _run_done_callbacks(self) -> None:
        with self._cond:
            callbacks, self._done_callbacks = self._done_callbacks, []
        for fn in callbacks:
            fn(self)

    def _wait(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """`self._cond.wait_for` (the caller holds the condition) in slices of at most WAIT_SLICE_S: a
        thread blocked in one long lock wait does not run Python's signal handlers, so Jupyter's stop
        button (a KeyboardInterrupt in the waiting main thread) would only act once the request ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            if self._cond.wait_for(predicate, max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    # ---- read from anywhere -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.output is not None or self.exception is not None

    def add_done_callback(self, fn: Callable[[RequestHandle], None]) -> None:
        """Call `fn(handle)` once the request has finished or failed: at once if it has, else on the engine
        thread as it finishes (so `fn` must be quick and must not wait on the engine)."""
        with self._cond:
            if not self.done:
                self._done_callbacks.append(fn)
                return
        fn(self)

    def add_update_callback(self, fn: Callable[[RequestHandle], None]) -> None:
        """Call `fn(handle)` on the engine thread after each output it receives (new tokens, new text, the
        end): a reader woken this way needs no thread of its own. `fn` must be quick and must not raise."""
        self._update_callbacks.append(fn)

    def text_since(self, start: int, index: int = 0) -> tuple[str, int]:
        """Completion `index`'s text pieces from the `start`-th on, joined, and the index to read from next time."""
        with self._cond:
            pieces = self.completions[index].pieces[start:]
        return "".join(pieces), start + len(pieces)

    def tokens_since(self, start: int, index: int = 0) -> tuple[list[int], list[dict[int, float]] | None]:
        """Completion `index`'s token ids from the `start`-th on and their logprobs (None when none were asked)."""
        with self._cond:
            done = self.completions[index]
            ids = done.token_ids[start:]
            return ids, None if done.logprobs is None else done.logprobs[start:start + len(ids)]

    def finish_reasons(self) -> list[str | None]:
        """Each completion's finish reason, None while it runs."""
        with self._cond:
            return [c.finish_reason for c in self.completions]

    @property
    def token_ids(self) -> list[int]:
        """Completion 0's token ids so far."""
        return self.completions[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Completion 0's tokens' logprobs (with SamplingParams.logprobs)."""
        return self.completions[0].logprobs

    @property
    def text(self) -> str:
        """The text so far (the final text once done)."""
        if self.output is not None and self.output.finish_reason != "error":
            return self.output.text
        with self._cond:
            return "".join(self.completions[0].pieces)

    @property
    def finish_reason(self) -> str | None:
        if self.output is not None:
            return self.output.finish_reason
        return "error" if self.exception is not None else None

    @property
    def error(self) -> str | None:
        return None if self.exception is None else str(self.exception)

    @property
    def num_tokens(self) -> int:
        """Tokens received, every completion's."""
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token (1 / TPOT), live while it streams."""
        tpot = self.metrics.tpot
        return 1 / tpot if tpot else None

    @property
    def spec_decoding(self) -> dict | None:
        """Speculative decoding's figures of the finished request (SpecDecodingStats as a dict: drafts, draft and
        accepted tokens, by position, acceptance rate, mean acceptance length); None without speculation."""
        return None if self.output is None else (self.output.metrics or {}).get("spec_decoding")

    def stream(self, timeout: float | None = None, index: int = 0) -> Iterator[str]:
        """Yield completion `index`'s text pieces until the request finishes; raises its error if it failed.
        `timeout` bounds the wait for each next piece (TimeoutError)."""
        i, all_pieces = 0, self.completions[index].pieces
        while True:
            with self._cond:
                if not self._wait(lambda i=i: len(all_pieces) > i or self.done, timeout):
                    raise TimeoutError(f"no new text from {self.request_id} within {timeout} s")
                pieces, finished = all_pieces[i:], self.done
            i += len(pieces)
            yield from pieces
            if finished and i >= len(all_pieces):
                break
        if self.exception is not None:
            raise self.exception

    def result(self, timeout: float | None = None):
        """The final RequestOutput (finish_reason "stop", "length" or "abort"); raises the
        request's error (InvalidRequestError, GenerationError, ...) or TimeoutError."""
        with self._cond:
            if not self._wait(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s "
                                   f"({len(self.token_ids)} tokens so far); it is still running — "
                                   "wait again or cancel() it")
        if self.exception is not None:
            raise self.exception
        return self.output

    def cancel(self) -> None:
        """Abort the request; its result has finish_reason "abort" (no-op once finished)."""
        if not self.done:
            self._canceller(self)

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._wait(lambda: self.done, timeout)

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"<RequestHandle {self.request_id} on {self.model}: {state}, {len(self.token_ids)} tokens>"
