"""The API under one bad client: a wait past the disconnect poll on Python 3.10's asyncio; bodies over the
limit are 413s, requests beyond the slots and the queue 429s, too many stop strings or messages 400s, all in
OpenAI's error shape; prompts are tokenized and templated off the engine thread and the event loop; a model
loaded from a directory is served, and labelled in /metrics, by its name, not its path; and a flood from many
clients at once leaves a well-behaved client served, every refused client answered, and no KV block held."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import types
from pathlib import Path

import httpx
import pytest

from runner_core.errors import ConfigError
from tests.sessions import TINY, slow_steps, tiny_session, wait_until
from workbench import Session
from workbench.api import ApiLimits, bridge, serve_api
from workbench.api.admission import Slots

PROMPT = "Once upon a time"
LIMITS = {"max_body_bytes": 64 << 10, "max_concurrent_requests": 6, "max_queued_requests": 4,
          "max_stop_sequences": 4, "max_stop_chars": 16, "max_messages": 8}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


@pytest.fixture(scope="module")
def server(session):
    srv = serve_api(session, limits=LIMITS)
    yield srv
    srv.stop()


def _error(resp: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of `resp`, asserting its status and the shape's four fields."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# ---- 7: Python 3.10 ------------------------------------------------------------------------------------------

class _FakeHandle:
    """A request handle whose text is "hello" once the job is woken."""

    def add_update_callback(self, fn):
        pass

    def add_done_callback(self, fn):
        pass

    def text_since(self, read: int, index: int = 0):
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


# ---- 8: limits -----------------------------------------------------------------------------------------------

def test_limits_refuse_a_bad_value_naming_the_field():
    with pytest.raises(ConfigError, match=r"ApiLimits\.max_body_bytes got 0; allowed: an int >= 1"):
        ApiLimits(max_body_bytes=0)
    with pytest.raises(ConfigError, match=r"ApiLimits has no field 'max_body'; allowed: max_body_bytes, "):
        ApiLimits.coerce({"max_body": 1})
    assert ApiLimits.coerce({"max_queued_requests": 0}).max_queued_requests == 0  # no queue: 429 once all busy


def test_slots_queue_in_order_refuse_past_the_queue_and_forget_a_waiter_that_left():
    async def main():
        slots = Slots(1, 2)
        assert await slots.acquire()
        second = asyncio.ensure_future(slots.acquire())
        third = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert (slots.running, slots.queued) == (1, 2)
        assert not await slots.acquire()  # the queue is full
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert slots.queued == 1
        slots.release()  # to the third, the second having left
        assert await third and (slots.running, slots.queued) == (1, 0)
        slots.release()
        assert slots.running == 0

    asyncio.run(main())


def test_session_serve_api_passes_its_limits_on(session):
    srv = session.serve_api(limits={"max_stop_sequences": 1})
    try:
        assert srv.limits == ApiLimits(max_stop_sequences=1)
        error = _error(httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "stop": ["a", "b"]},
                                  timeout=60), 400)
        assert error["param"] == "stop" and "maximum length 1, but got an array with length 2" in error["message"]
    finally:
        srv.stop()


def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed(server):
    body = json.dumps({"model": "tiny-llama", "prompt": "x" * (70 << 10), "max_tokens": 4}).encode()
    error = _error(httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                              headers={"Content-Type": "application/json"}), 413)
    assert error["code"] == "request_too_large" and "max_body_bytes (65536 bytes" in error["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    error = _error(httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60,
                              headers={"Content-Type": "application/json"}), 413)
    assert "over 65536 bytes" in error["message"]
    good = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert good.status_code == 200  # the server goes on


def test_too_many_or_too_long_stop_strings_and_too_many_messages_are_400s_naming_the_field(server):
    url = server.url
    error = _error(httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "stop": list("abcde")}, timeout=60),
                   400)
    assert error["param"] == "stop" and error["code"] == "array_above_max_length"
    assert "maximum length 4, but got an array with length 5" in error["message"]
    error = _error(httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "stop": "x" * 17}, timeout=60), 400)
    assert error["param"] == "stop" and "max_stop_chars (16)" in error["message"]
    messages = [{"role": "user", "content": "hi"}] * 9
    error = _error(httpx.post(url + "/v1/chat/completions", json={"messages": messages}, timeout=60), 400)
    assert error["param"] == "messages" and error["code"] == "array_above_max_length"
    assert "maximum length 8, but got an array with length 9" in error["message"]


def test_prompts_are_tokenized_and_templated_off_the_engine_thread_and_the_event_loop(session, server,
                                                                                      monkeypatch):
    tokenizer = session.models["tiny-llama"].runner.tokenizer
    hf = tokenizer.hf
    threads: list[tuple[str, str]] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            threads.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(tokenizer, "encode", recorded("encode", tokenizer.encode))
    monkeypatch.setattr(hf, "encode", recorded("hf.encode", hf.encode))
    monkeypatch.setattr(hf, "apply_chat_template", recorded("chat template", hf.apply_chat_template))
    monkeypatch.setattr(hf, "chat_template", TEMPLATE)
    base = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0}
    stream = {**base, "prompt": PROMPT * 5, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=stream, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    chat = httpx.post(server.url + "/v1/chat/completions", json={**base, "messages": [{"role": "user",
                                                                                      "content": "hi"}]}, timeout=60)
    assert chat.status_code == 200, chat.text
    assert {name for name, _ in threads} == {"encode", "hf.encode", "chat template"}
    assert all(thread.startswith("workbench-api-prompt") for _, thread in threads), threads


def test_a_model_loaded_from_a_directory_is_served_and_counted_by_its_name_not_its_path(tiny_llama_path):
    path = str(tiny_llama_path)
    s = Session()
    try:
        s.load_model(path, **TINY)
        srv = s.serve_api()
        listed = httpx.get(srv.url + "/v1/models").json()
        health = httpx.get(srv.url + "/health").json()
        assert [(m["id"], m["root"]) for m in listed["data"]] == [(Path(path).name, Path(path).name)]
        assert path not in json.dumps(listed) and path not in json.dumps(health)
        for model in (Path(path).name, path):  # the served name, or the session's
            got = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2},
                             timeout=60)
            assert got.status_code == 200 and got.json()["model"] == Path(path).name
        missing = httpx.post(srv.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=60)
        assert path not in missing.text and Path(path).name in _error(missing, 404)["message"]
        metrics = httpx.get(srv.url + "/metrics").text  # gauges read at the scrape, counters of the two requests
        assert path not in metrics
        label = f'{{model_name="{Path(path).name}"}}'
        assert f"runner_workbench:kv_cache_blocks_total{label}" in metrics
        assert re.search(rf"^runner_workbench:generation_tokens_total{re.escape(label)} [1-9]", metrics, re.M)
    finally:
        s.close()


# ---- the flood -----------------------------------------------------------------------------------------------

HEAVY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 230, "temperature": 0, "ignore_eos": True,
         "stream": True}
KINDS = {  # what each flooding client sends, and the answers it may get
    "oversized": ({"model": "tiny-llama", "prompt": "x" * (70 << 10)}, {413}),
    "over-context": ({"model": "tiny-llama", "prompt": "word " * 2400}, {400, 429}),
    "many-stops": ({"model": "tiny-llama", "prompt": PROMPT, "stop": list("abcdefghij")}, {400, 429}),
    "heavy": (HEAVY, {200, 429}),
}


async def _flood(url: str, slots, expected: str) -> tuple[str, list[tuple[str, int, dict | None]]]:
    """The well-behaved client's stream, started first, and 40 clients at once: 8 oversized bodies, 8 prompts
    over the context, 8 stop lists over the limit, 16 long streams (held open until every flooding client is
    answered or queued). Returns the good client's text and each flooding client's (kind, status, error)."""
    kinds = ["oversized"] * 8 + ["over-context"] * 8 + ["many-stops"] * 8 + ["heavy"] * 16
    random.Random(0).shuffle(kinds)
    answers: dict[int, tuple[str, int, dict | None]] = {}
    release, started = asyncio.Event(), asyncio.Event()
    good = {**HEAVY, "max_tokens": 24}

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        async def good_client() -> str:
            text = []
            async with http.stream("POST", "/v1/completions", json=good) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(json.loads(line[6:])["choices"][0]["text"])
                        started.set()
            return "".join(text)

        async def flooding_client(i: int, kind: str) -> None:
            async with http.stream("POST", "/v1/completions", json=KINDS[kind][0]) as resp:
                if resp.status_code == 200:
                    answers[i] = (kind, 200, None)
                    await release.wait()  # holds its slot until then
                    return
                await resp.aread()
                assert resp.status_code != 429 or resp.headers["retry-after"] == "1"
                answers[i] = (kind, resp.status_code, _error(resp, resp.status_code))

        good_task = asyncio.ensure_future(good_client())
        await asyncio.wait_for(started.wait(), 120)
        tasks = [asyncio.ensure_future(flooding_client(i, kind)) for i, kind in enumerate(kinds)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        while len(answers) + slots.queued < len(kinds) and loop.time() < deadline:  # answered or waiting
            await asyncio.sleep(0.02)
        settled = sorted(answers.values(), key=str)
        release.set()
        for task in tasks:  # the queued ones leave too
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        text = await asyncio.wait_for(good_task, 120)
    assert len(settled) + 4 >= len(kinds), f"the flood did not settle: {settled}"
    return text, settled


def test_a_flood_from_many_clients_leaves_a_good_client_served_and_no_blocks_held(session, server):
    idle = session.memory_stats()["blocks_used"]
    expected = session.generate(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True).text
    slots = server.app.state.slots
    with slow_steps(session, delay=0.1):  # a step as long as a larger model's: the long streams stay
        text, answers = asyncio.run(_flood(server.url, slots, expected))
    assert text == expected  # the good client got its whole answer, the same as alone

    for kind, status, error in answers:
        assert status in KINDS[kind][1], (kind, status, error)
        if status == 413:
            assert error["code"] == "request_too_large"
        elif status == 429:
            assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
            assert "max_concurrent_requests=6, max_queued_requests=4" in error["message"]
        elif status == 400:
            assert error["param"] == ("prompt" if kind == "over-context" else "stop"), error
    statuses = [status for _, status, _ in answers]
    assert statuses.count(413) == 8
    # 16 long streams for 6 slots (one the good client's) and 4 places in the queue: at least 6 turned away
    assert sum(1 for kind, status, _ in answers if kind == "heavy" and status == 429) >= 6

    assert wait_until(lambda: not session.inflight(), 60)
    assert wait_until(lambda: (slots.running, slots.queued) == (0, 0), 60)
    assert wait_until(lambda: session.memory_stats()["blocks_used"] == idle, 60)
    after = httpx.post(server.url + "/v1/completions", json={**HEAVY, "max_tokens": 24, "stream": False}, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
