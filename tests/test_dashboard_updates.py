"""A served dashboard's updates reach the page: a patch Panel queues while an earlier one is still being
written to the websocket is written after it, not left queued (no browser: Panel's writer on a fake
connection, the interleaving forced)."""

from __future__ import annotations

import asyncio

from bokeh.document import Document


class _Socket:
    """A websocket whose first message's write completes only when the test says so."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.first_written = loop.create_future()
        self.messages: list[str] = []

    def write(self, msg: str) -> list[asyncio.Future]:
        self.messages.append(msg)
        if len(self.messages) == 1:
            return [self.first_written]
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return [done]


class _Protocol:
    def create(self, kind: str, events: list[str]) -> str:
        return "+".join(events)


class _Connection:
    def __init__(self, socket: _Socket):
        self._socket, self.protocol = socket, _Protocol()


def test_a_patch_queued_while_the_previous_one_is_written_reaches_the_page(monkeypatch):
    from panel.io import document

    import workbench.views.panel_app  # noqa: F401 - the dashboard's module sets up Panel's writer (workbench/views/panel_writer.py)

    monkeypatch.setitem(document.extra_socket_handlers, _Socket, lambda conn, msg: conn._socket.write(msg))

    async def scenario() -> list[str]:
        loop = asyncio.get_running_loop()
        doc, socket = Document(), _Socket(loop)
        conn = _Connection(socket)
        # a refresh while the socket is busy: its patch is queued, and a task writes it
        document.schedule_write_events(doc, [conn], ["3 tokens"])
        while not socket.messages:
            await asyncio.sleep(0)
        assert doc in document._WRITE_BLOCK  # that task waits for its write to complete
        # in one turn of the loop the websocket completes that write (the task wakes to end its run)
        # and the next refresh queues its patch, whose task starts after that end
        socket.first_written.set_result(None)
        document.schedule_write_events(doc, [conn], ["40 tokens, finished"])
        deadline = loop.time() + 1
        while (doc in document._WRITE_BLOCK or doc in document._WRITE_MSGS) and loop.time() < deadline:
            await asyncio.sleep(0.001)  # until nothing is queued or being written
        return socket.messages

    assert asyncio.run(scenario()) == ["3 tokens", "40 tokens, finished"]


class _FinishingHandle:
    """A generation whose engine thread delivers its last piece the moment a view reads the text."""

    def __init__(self):
        self.pieces, self.output, self.exception, self.tokens_per_s = ["It is"], None, None, 50.0
        self.spec_decoding = None  # no speculation

    @property
    def num_tokens(self) -> int:
        return len(self.pieces)

    @property
    def done(self) -> bool:
        return self.output is not None

    @property
    def finish_reason(self) -> str | None:
        return self.output

    @property
    def text(self) -> str:
        text = "".join(self.pieces)
        if self.output is None:  # the engine thread: the final piece, then the output, as handles.py orders them
            self.pieces.append(" done.")
            self.output = "length"
        return text


def test_a_view_never_shows_finished_beside_a_text_short_of_its_end():
    from workbench.views.controller import ViewController

    view = ViewController(session=object())
    for _ in range(3):  # refreshes
        view.handle = view.handle or _FinishingHandle()
        text, stats = view.answer_view()
        if "finished" in stats:
            assert text == "It is done.", (text, stats)
    assert "finished" in stats  # the generation's end was shown, with its whole text
