"""The API under one bad client: a wait past the disconnect poll on Python 3.10's asyncio."""

from __future__ import annotations

import asyncio
import types

from workbench.api import bridge

# ---- 7: Python 3.10 ------------------------------------------------------------------------------------------

class _FakeHandle:
    """A request handle whose text is "hello" once the job is woken."""

    def add_update_callback(self, fn):
        pass

    def add_done_callback(self, fn):
        pass

    def text_since(self, read: int):
        return "hello", 1


def test_a_wait_past_the_poll_on_python_3_10s_asyncio_keeps_watching_the_client(monkeypatch):
    class AsyncioTimeoutError310(Exception):
        """What asyncio.wait_for raises on Python 3.10: asyncio.exceptions.TimeoutError, not the builtin."""

    async def wait_for_310(aw, timeout):
        try:
            return await asyncio.wait_for(aw, timeout)
        except TimeoutError:
            raise AsyncioTimeoutError310 from None

    monkeypatch.setattr(bridge, "asyncio", types.SimpleNamespace(
        wait_for=wait_for_310, TimeoutError=AsyncioTimeoutError310, Queue=asyncio.Queue,
        get_running_loop=asyncio.get_running_loop))

    class Client:  # stays connected; the output arrives at the third poll
        polls = 0

        async def is_disconnected(self):
            self.polls += 1
            if self.polls == 3:
                job._wake(True)
            return False

    client = Client()

    async def main():
        nonlocal job
        job = bridge.Job(_FakeHandle(), metrics=None, prompt_tokens=1, stream=True)
        return await job.next(client, poll_s=0.01)

    job = None
    assert asyncio.run(main()) == "hello" and client.polls == 3
