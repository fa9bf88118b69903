"""Shared pieces of the tests that drive a workbench Session over tiny-llama: its load settings, a
session for a module's fixture, steps slowed down so a request stays in flight, and a polled wait."""

from __future__ import annotations

import time
from contextlib import contextmanager

from workbench import Session

TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 4 << 20, "max_model_len": 256}


def tiny_session():
    """A Session with tiny-llama loaded (TINY), closed after: `yield from tiny_session()` in a fixture."""
    s = Session()
    s.load_model("tiny-llama", **TINY)
    yield s
    s.close()


def openai_client(session):
    """The official openai client on `session`'s API server, stopped after: `yield from openai_client(session)`."""
    import openai

    srv = session.serve_api()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


@contextmanager
def slow_steps(session, model: str = "tiny-llama", delay: float = 0.05):
    """Make every engine step of `model` take at least `delay` s, so a request stays busy for as long
    as a test needs (tiny-llama is otherwise done in a fraction of a second)."""
    runner = session.models[model].runner
    real_step = runner.step

    def step():
        time.sleep(delay)
        return real_step()

    runner.step = step
    try:
        yield
    finally:
        del runner.step


def wait_until(predicate, timeout: float = 30.0) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` passes (its last answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
