"""workbench.Session: handles (stream, result, cancel), error isolation, several models,
unload freeing memory, compile switches refused or queued while busy, the metrics series."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from runner_core import ConfigError, InvalidRequestError, ModelLoadError
from tests.sessions import TINY, slow_steps, tiny_session
from workbench import GenerationError, NoModelError, Session, SessionBusyError, SessionError


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


def _long(session, **kw):
    """A request that runs until cancelled (or ~200 tokens)."""
    return session.submit("a long story", max_tokens=200, ignore_eos=True, temperature=0.0, **kw)


def test_current_is_one_per_process():
    a = Session.current()
    assert Session.current() is a
    a.close()
    b = Session.current()
    assert b is not a and not b.closed and a.closed
    b.close()


def test_stream_matches_result_and_greedy_is_deterministic(session):
    h = session.submit("Once upon a time", max_tokens=24, temperature=0.0)
    pieces = list(h.stream(timeout=60))
    out = h.result(timeout=60)
    assert out.finish_reason in ("stop", "length") and 0 < len(out.token_ids) <= 24
    assert "".join(pieces) == out.text == h.text
    assert h.token_ids == out.token_ids
    again = session.generate("Once upon a time", max_tokens=24, temperature=0.0, timeout=60)
    assert again.token_ids == out.token_ids
    assert not session.inflight()


def test_n_completions_stream_by_index_and_match_the_result(session):
    h = session.submit("Once upon a time", n=3, max_tokens=12, seed=8, ignore_eos=True)
    streams = [list(h.stream(timeout=60, index=i)) for i in range(3)]
    out = h.result(timeout=60)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert ["".join(p) for p in streams] == [c.text for c in out.outputs]
    assert [c.token_ids for c in h.completions] == [c.token_ids for c in out.outputs] and h.num_tokens == 36
    assert h.metrics.num_output_tokens == 36 and h.metrics.ok


def test_cancel_aborts_only_that_request(session):
    with slow_steps(session):
        long, short = _long(session), session.submit("hello", max_tokens=8)
        first = next(long.stream(timeout=60))  # it is running
        assert isinstance(first, str)
        long.cancel()
    out = long.result(timeout=30)
    assert out.finish_reason == "abort" and len(out.token_ids) < 200
    assert short.result(timeout=60).finish_reason in ("stop", "length")
    long.cancel()  # a no-op once finished


def test_bad_request_fails_alone(session):
    good = [session.submit(f"prompt {i}", max_tokens=12, seed=i) for i in range(3)]
    bad = session.submit([99999, 1, 2], max_tokens=4)  # a token id outside the vocabulary
    too_long = session.submit(list(range(1, 300)), max_tokens=4)  # more tokens than max_model_len
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        bad.result(timeout=30)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        too_long.result(timeout=30)
    with pytest.raises(InvalidRequestError):
        list(bad.stream(timeout=5))
    assert bad.finish_reason == "error" and "outside the vocabulary" in bad.error
    assert [h.result(timeout=60).finish_reason in ("stop", "length") for h in good] == [True] * 3
    assert session.generate("still works", max_tokens=4, timeout=60).token_ids


def test_bad_sampling_values_raise_at_submit(session):
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
                          ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")]:
        with pytest.raises(InvalidRequestError, match=field):
            session.submit("hi", **kwargs)
    assert not session.inflight()


def test_engine_exception_reaches_the_handle_and_the_session_goes_on(session):
    runner = session.models["tiny-llama"].runner
    real_step = runner.step
    calls = []

    def failing_step():
        if not calls:
            calls.append(1)
            raise RuntimeError("injected failure")
        return real_step()

    runner.step = failing_step
    try:
        h = session.submit("boom", max_tokens=8)
        with pytest.raises(GenerationError, match="injected failure"):
            h.result(timeout=30)
    finally:
        del runner.step  # back to the class method
    assert "injected failure" in session.last_error
    assert session.generate("after the failure", max_tokens=6, timeout=60).finish_reason in ("stop", "length")
    assert any(e["kind"] == "error" for e in session.metrics.events())


def test_no_model_and_bad_model_are_clear_errors(tmp_path):
    s = Session()
    try:
        with pytest.raises(NoModelError, match="no model is loaded"):
            s.submit("hello")
        with pytest.raises(NoModelError):
            s.unload()
        with pytest.raises(ModelLoadError, match=r"does-not-exist.*\(no such directory\)"):
            s.load_model(str(tmp_path / "does-not-exist"))
        with pytest.raises(ConfigError, match="dtype"):
            s.load_model("tiny-llama", dtype="float64")
        assert s.models == {} and s.loading is None and "no such directory" in s.last_error
        assert s.status == "no model loaded"
    finally:
        s.close()


def test_two_models_and_unload_frees_memory(session):
    fut = session.load_model("tiny-llama", name="tiny-b", activate=False, wait=False, **{**TINY, "dtype": "bfloat16"})
    with pytest.raises(SessionBusyError, match="still loading"):  # pressing load twice
        session.load_model("tiny-llama", name="tiny-c", **TINY)
    entry = fut.result(timeout=120)
    assert set(session.models) == {"tiny-llama", "tiny-b"} and session.active == "tiny-llama"
    with pytest.raises(SessionError, match="already loaded with"):
        session.load_model("tiny-llama", name="tiny-b", **TINY)  # same name, other settings
    assert session.load_model("tiny-llama", **TINY) is session.models["tiny-llama"]  # a re-run cell

    a = session.submit("on the first", max_tokens=6, temperature=0.0)
    b = session.submit("on the second", model="tiny-b", max_tokens=6, temperature=0.0)
    assert a.result(timeout=60).token_ids and b.result(timeout=60).token_ids
    assert b.model == "tiny-b" and entry.weights_bytes * 2 == session.models["tiny-llama"].weights_bytes

    module = weakref.ref(entry.runner.model)
    with slow_steps(session, "tiny-b"):
        running = _long(session, model="tiny-b")
        next(running.stream(timeout=60))
        result = session.unload("tiny-b")
    assert result["freed_bytes"] == entry.weights_bytes + entry.kv_pool_bytes > 0
    assert running.result(timeout=30).finish_reason == "abort"  # its request was aborted, not left hanging
    gc.collect()
    assert module() is None, "the unloaded model's weights are still referenced"
    assert list(session.models) == ["tiny-llama"] and entry.runner is None
    with pytest.raises(NoModelError, match="not loaded"):
        session.submit("x", model="tiny-b")
    assert session.generate("the first still works", max_tokens=4, timeout=60).token_ids


def test_compile_switch_idle_and_busy(session):
    before = session.generate("compile me", max_tokens=12, temperature=0.0, timeout=60)
    stats = session.set_compile_mode(True, backend="eager", mode="default")
    assert isinstance(stats, dict)
    assert session.models["tiny-llama"].compile["enabled"] is True
    after = session.generate("compile me", max_tokens=12, temperature=0.0, timeout=120)
    assert after.token_ids == before.token_ids

    with slow_steps(session):
        long = _long(session)
        next(long.stream(timeout=60))
        with pytest.raises(SessionBusyError, match="while 1 generation is running"):
            session.set_compile_mode(False)
        pending = session.set_compile_mode(False, when_idle=True, wait=False)
        held = session.submit("waits for the switch", max_tokens=4)
        time.sleep(0.3)
        assert not pending.done() and not held.done and not long.done
        assert session.models["tiny-llama"].compile["enabled"] is True
        long.cancel()
    pending.result(timeout=120)
    assert held.result(timeout=60).finish_reason in ("stop", "length")
    assert session.models["tiny-llama"].compile["enabled"] is False
    kinds = [e["kind"] for e in session.metrics.events()]
    assert kinds.count("compile") >= 2 and "compile_queued" in kinds


def test_metrics_series_is_bounded_and_pollable(tiny_llama_path):
    s = Session(history=20, sample_interval=0.0)
    try:
        s.load_model("tiny-llama", **TINY)
        rows, cursor = s.metrics.poll(0)
        assert len(rows) == 1 and rows[0]["steps"] == 0 and rows[0]["weights_bytes"] > 0
        handles = s.run_workload(6, max_tokens=(8, 16), seed=3)
        assert [h.result(timeout=60).finish_reason in ("stop", "length") for h in handles] == [True] * 6
        rows, cursor2 = s.metrics.poll(cursor)
        assert cursor2 > cursor and len(s.metrics) <= 20 and 0 < len(rows) <= 20
        assert s.metrics.poll(cursor2) == ([], cursor2)
        last = s.metrics.rows()[-1]
        for key in ("t", "dt", "steps", "prefill_tokens", "decode_tokens", "tokens_per_s", "num_running",
                    "blocks_total", "blocks_used", "blocks_free", "kv_utilization", "internal_fragmentation",
                    "static_reservation_waste"):
            assert key in last, key
        assert sum(r["prefill_tokens"] for r in s.metrics.rows()) > 0 or cursor2 > 20
        assert s.block_map()["num_blocks"] == last["blocks_total"]
    finally:
        s.close()


def test_workload_size_is_checked(session):
    with pytest.raises(SessionError, match="workload size"):
        session.run_workload(0)


def test_the_session_does_not_know_its_views():
    import subprocess
    import sys

    code = ("import sys, workbench; s = workbench.Session(); s.close(); "
            "print(sorted(m for m in ('panel', 'plotly', 'ipywidgets', 'bokeh') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert not hasattr(Session, "dashboard") and not hasattr(Session, "widgets")
