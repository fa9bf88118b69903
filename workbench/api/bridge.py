"""From a session's RequestHandle (filled by the engine thread) to the API's event loop, without blocking
it: a thread per request iterates `handle.stream()` and hands each text piece to an asyncio.Queue."""

from __future__ import annotations

import asyncio
import threading
import time


class Job:
    """One served request. `next()` waits for new text (every piece that arrived, joined) and says whether
    the request finished; given the HTTP request, a client gone while it waits cancels the generation.
    When the request ends the pump thread counts it in the server's metrics; `close()` cancels it if it
    still runs (the client left)."""

    def __init__(self, handle, metrics, prompt_tokens: int | None = None):
        self.handle, self.metrics = handle, metrics
        self.prompt_tokens = prompt_tokens  # known up front for token ids; else from the final output
        self.sent_tokens = 0
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), daemon=True, name=f"api-{handle.request_id}").start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for piece in self.handle.stream():
                loop.call_soon_threadsafe(self._queue.put_nowait, piece)
        except BaseException:  # noqa: BLE001 - the handle keeps its error; the reader looks there
            pass
        finally:
            self.metrics.observe(self.handle, self.usage_prompt_tokens(), time.perf_counter())
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, None)
            except RuntimeError:  # the server's loop is gone (it stopped): nobody reads any more
                pass

    async def next(self, request=None, poll_s: float = 0.5) -> str:
        """The text produced since the last call ("" when the request finished with no new text)."""
        while True:
            try:
                first = await asyncio.wait_for(self._queue.get(), poll_s)
                break
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.handle.cancel()
        pieces = [first]
        while not self._queue.empty():
            pieces.append(self._queue.get_nowait())
        self.finished = self.finished or None in pieces
        return "".join(p for p in pieces if p is not None)

    def new_tokens(self) -> int:
        """Tokens produced since the previous call."""
        n = len(self.handle.token_ids)
        delta, self.sent_tokens = n - self.sent_tokens, n
        return delta

    def usage_prompt_tokens(self) -> int:
        out = self.handle.output
        if out is not None and out.prompt_token_ids:
            return len(out.prompt_token_ids)
        return self.prompt_tokens or 0

    def close(self) -> None:
        self.handle.cancel()
