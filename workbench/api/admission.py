"""The gate in front of the API's routes (an ASGI middleware): a body over `ApiLimits.max_body_bytes` is a
413 (by its Content-Length before anything is read, else as it arrives), and a generation request beyond
`max_concurrent_requests` waits for a slot, its body unread, in a queue of `max_queued_requests`, past which
it is a 429 with Retry-After. A request holds its slot until its response is sent: a stream to its end, or
until its client leaves."""

from __future__ import annotations

import asyncio
import collections
import contextlib

from workbench.api.errors import ApiError
from workbench.api.limits import ApiLimits

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Slots:
    """The generation requests being served (`running`) and those waiting for a slot (`queued`); used from
    the server's event loop alone. A slot freed goes to the longest waiting request."""

    def __init__(self, size: int, queue: int):
        self.size, self.queue = size, queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> bool:
        """Take a slot, waiting for one in the queue; False at once when the queue is full too."""
        if self.running < self.size and not self._waiters:
            self.running += 1
            return True
        if len(self._waiters) >= self.queue:
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over
        except asyncio.CancelledError:
            if fut.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            else:  # handed a slot just as it was cancelled
                self.release()
            raise
        return True

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class LimitsMiddleware:
    """Body size and admission before the routes (Starlette's `add_middleware(LimitsMiddleware, ...)`)."""

    def __init__(self, app, *, limits: ApiLimits, slots: Slots):
        self.app, self.limits, self.slots = app, limits, slots

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cap = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > cap:
            return await _too_large(f"{declared} bytes", cap).response()(scope, receive, send)
        gated = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if gated and not await self.slots.acquire():
            return await self._busy().response()(scope, receive, send)
        try:
            body = await _read_body(receive, cap)
            if body is None:  # the client left while it waited
                return
            if isinstance(body, int):
                return await _too_large(f"over {cap} bytes", cap).response()(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            if gated:
                self.slots.release()

    def _busy(self) -> ApiError:
        lim = self.limits
        return ApiError(429, f"the server is busy: {self.slots.running} requests are being served and "
                             f"{self.slots.queued} wait for a slot (max_concurrent_requests="
                             f"{lim.max_concurrent_requests}, max_queued_requests={lim.max_queued_requests}); "
                             "retry later", type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive, cap: int) -> bytes | int | None:
    """The whole body; its size so far once past `cap` (the rest is left unread); None if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return size
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the connection's own messages (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


def _too_large(size: str, cap: int) -> ApiError:
    return ApiError(413, f"the request body is {size}, over the server's max_body_bytes ({cap} bytes, "
                         f"{cap / 2**20:.3g} MiB); send a shorter prompt, or start the server with a larger limit",
                    code="request_too_large")
