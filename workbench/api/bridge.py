"""From a session's RequestHandle (filled by the engine thread) to the API's event loop, without blocking
it and without a thread per request: the handle's update callback wakes the loop, which reads the new
text from the handle."""

from __future__ import annotations

import asyncio


class Job:
    """One served request of `n` completions (`stream`: its text pieces are wanted as they come). `next()`
    waits for new text (every piece of completion 0 that arrived, joined, the others' by `new_text(i)`;
    `finished` says whether the request ended, `reasons` each completion's finish reason as of the wake, read
    before its text, with n > 1); given the HTTP request, a client gone while it waits cancels the generation.
    When the request ends it is counted in the server's metrics under `model` (the served name; default the
    handle's); `close()` cancels it if it still runs (the client left)."""

    def __init__(self, handle, metrics, prompt_tokens: int | None = None, *, stream: bool = True,
                 model: str | None = None, n: int = 1):
        self.handle, self.metrics, self.stream = handle, metrics, stream
        self.model, self.n = model, n
        self.prompt_tokens = prompt_tokens  # known up front for token ids; else from the final output
        self.sent = [0] * n  # tokens of each completion returned by new_tokens()
        self.finished = False
        self.reasons: list[str | None] = [None] * n
        self._read = [0] * n  # text pieces of each completion already returned
        self._queue: asyncio.Queue = asyncio.Queue()  # wake-ups: True (new output) or None (the end)
        self._loop = asyncio.get_running_loop()
        if stream:  # only the end matters otherwise: no wake-up per token
            handle.add_update_callback(lambda h: self._wake(True))
        handle.add_done_callback(self._done)

    def _wake(self, item) -> None:
        """On the engine thread: hand a wake-up to the server's loop (gone once the server stopped)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass

    def _done(self, handle) -> None:
        self.metrics.observe(handle.metrics, self.model or handle.model, handle.spec_decoding)
        self._wake(None)

    async def next(self, request=None, poll_s: float = 0.5) -> str:
        """The text produced since the last call ("" when the request finished with no new text; with
        stream=False, "" once it finished)."""
        wakes = [await (self._queue.get() if request is None else self._get_watching(request, poll_s))]
        while not self._queue.empty():
            wakes.append(self._queue.get_nowait())
        self.finished = self.finished or None in wakes
        if self.n > 1:
            self.reasons = self.handle.finish_reasons()
        return self.new_text(0)

    def new_text(self, index: int) -> str:
        """Completion `index`'s text produced since the last call."""
        text, self._read[index] = self.handle.text_since(self._read[index], index)
        return text

    async def _get_watching(self, request, poll_s: float):
        """The next queue item; every `poll_s` without one, a client gone cancels the generation."""
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), poll_s)
            except asyncio.TimeoutError:  # noqa: UP041 (not the builtin TimeoutError on 3.10; a test simulates it)
                if await request.is_disconnected():
                    self.handle.cancel()

    def new_tokens(self, index: int = 0) -> tuple[list[int], list[dict[int, float]] | None]:
        """Completion `index`'s tokens produced since the previous call, and their logprobs (None when none were
        asked)."""
        ids, logprobs = self.handle.tokens_since(self.sent[index], index)
        self.sent[index] += len(ids)
        return ids, logprobs

    @property
    def sent_tokens(self) -> int:
        """The tokens returned by new_tokens(), every completion's."""
        return sum(self.sent)

    def usage_prompt_tokens(self) -> int:
        out = self.handle.output
        if out is not None and out.prompt_token_ids:
            return len(out.prompt_token_ids)
        return self.prompt_tokens or 0

    def close(self) -> None:
        self.handle.cancel()
