"""From a session's RequestHandle (filled by the engine thread) to the API's event loop, without blocking
it: a thread per request iterates `handle.stream()` and hands each text piece to an asyncio.Queue."""

from __future__ import annotations

import asyncio
import threading
import time


class Job:
    """One served request (`stream`: its text pieces are wanted as they come). `next()` waits for new
    text (every piece that arrived, joined; `finished` says whether the request ended); given the HTTP
    request, a client gone while it waits cancels the generation. When the request ends the pump thread
    counts it in the server's metrics; `close()` cancels it if it still runs (the client left)."""

    def __init__(self, handle, metrics, prompt_tokens: int | None = None, *, stream: bool = True):
        self.handle, self.metrics, self.stream = handle, metrics, stream
        self.prompt_tokens = prompt_tokens  # known up front for token ids; else from the final output
        self.sent_tokens = 0
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), daemon=True, name=f"api-{handle.request_id}").start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            if self.stream:
                for piece in self.handle.stream():
                    loop.call_soon_threadsafe(self._queue.put_nowait, piece)
            else:  # only the end matters: no wake-up per token
                self.handle.wait()
        except BaseException:  # noqa: BLE001 - the handle keeps its error; the reader looks there
            pass
        finally:
            self.metrics.observe(self.handle, self.usage_prompt_tokens(), time.perf_counter())
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, None)
            except RuntimeError:  # the server's loop is gone (it stopped): nobody reads any more
                pass

    async def next(self, request=None, poll_s: float = 0.5) -> str:
        """The text produced since the last call ("" when the request finished with no new text; with
        stream=False, "" once it finished)."""
        first = await (self._queue.get() if request is None else self._get_watching(request, poll_s))
        pieces = [first]
        while not self._queue.empty():
            pieces.append(self._queue.get_nowait())
        self.finished = self.finished or None in pieces
        return "".join(p for p in pieces if p is not None)

    async def _get_watching(self, request, poll_s: float):
        """The next queue item; every `poll_s` without one, a client gone cancels the generation."""
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), poll_s)
            except TimeoutError:
                if await request.is_disconnected():
                    self.handle.cancel()

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
