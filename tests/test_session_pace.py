"""A run step by step through the session: a paced engine computes what an unpaced one does, pause / step /
resume advance it one engine step at a time, the demo workload's requests reach the engine at their arrival
times, and the session publishes each step's record and detail (workbench/runtime/engine_thread.py,
routing.py, workload.py, metrics.py)."""

from __future__ import annotations

import time

import pytest

from tests.sessions import tiny_session
from workbench import SessionError
from workbench.runtime.workload import DEMO, describe, random_requests

GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


def _records(session) -> list:
    """The model's step records, read on the engine thread (which runs commands while paused)."""
    return session.on_engine_thread(lambda: list(session.models["tiny-llama"].runner.step_metrics)).result(10)


def test_a_paced_engine_gives_the_tokens_an_unpaced_one_does(session):
    prompts = ["the river", "a stone in the garden", "light"]
    unpaced = [session.generate(p, **GREEDY).token_ids for p in prompts]
    session.wait_idle(30)
    before = len(_records(session))
    session.pace(0.03)
    try:
        handles = [session.submit(p, **GREEDY) for p in prompts]
        paced = [h.result(60).token_ids for h in handles]
    finally:
        session.pace(0)
    assert paced == unpaced and session.wait_idle(30)
    times = [r.time for r in _records(session)[before:]]
    assert len(times) >= 12 and min(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.03


def test_pause_step_resume_advance_one_engine_step_at_a_time(session):
    assert session.step() is True  # unpaced: the engine steps on its own
    session.pause()
    try:
        assert session.paused and session.step(10) is False  # paused with nothing to run
        before = len(_records(session))
        handle = session.submit("the model reads a token", **GREEDY)
        time.sleep(0.3)
        assert handle.num_tokens == 0 and len(_records(session)) == before  # nothing runs while paused
        assert session.step(10) is True
        assert len(_records(session)) == before + 1 and handle.num_tokens == 1  # the prompt, its first token
        assert session.step(10) is True
        assert len(_records(session)) == before + 2 and handle.num_tokens == 2
    finally:
        session.resume()
    assert len(handle.result(30).token_ids) == GREEDY["max_tokens"] and not session.paused
    with pytest.raises(SessionError, match=r"pace must be a number of seconds in \[0, 10\]"):
        session.pace(-1)


def test_the_demo_workload_arrives_over_time_and_its_steps_are_published(session):
    requests = random_requests(seed=4, **{**DEMO, "max_tokens": (4, 8), "n": 8})
    start = time.perf_counter()
    handles = session.run_workload(8, seed=4, max_tokens=(4, 8))
    assert time.perf_counter() - start < requests[-1].arrival  # the handles come back before the last arrives
    for handle, request in zip(handles, requests, strict=True):
        handle.result(60)
        assert handle.metrics.arrival_time - start >= request.arrival  # handed in no sooner than its arrival
        assert handle.prompt.startswith("Write the next part of the story")
    assert requests[-1].arrival > 0.1
    records, details = session.steps()
    assert [d.step for d in details] == [r.step for r in records][-len(details):] and details
    assert {rid for d in details for rid in d.finished} >= {h.request_id for h in handles}
    assert describe(**DEMO).startswith("64 requests arriving at random")
