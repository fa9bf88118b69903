"""Tuning from the session: per-token times on handles, run_load (arrivals honoured, records and summary
consistent, a bad request failing alone, the in-process driver's definitions), live reconfiguration through
the engine thread, and TuneJob (a small sweep to a recommendation, live progress, cancel, one per session)."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from runner_core import ConfigError, InvalidRequestError, ModelRunner
from runner_core.tuning import Arrivals, Lengths, SweepSpace, Target, Workload, propose_space, run_workload
from tests.sessions import TINY, slow_steps, tiny_session
from workbench import SessionBusyError
from workbench.tuning import SessionBackend, TuneJob, run_load


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


SMALL = Workload(num_requests=6, prompt_len=Lengths.uniform(4, 16), output_len=Lengths.uniform(4, 10), seed=3)


def _percentile(values, q):
    """Linear interpolation between closest ranks (numpy's default), written out."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def test_handle_holds_the_engines_record_one_time_per_token(session):
    before = time.perf_counter()
    h = session.submit("Once upon a time", max_tokens=12, ignore_eos=True, temperature=0.0)
    out = h.result(timeout=60)
    m = h.metrics
    assert len(m.token_times) == len(h.token_ids) == m.num_output_tokens == 12
    assert m.token_times == sorted(m.token_times) and len(set(m.token_times)) == 12  # one step each
    assert before <= m.arrival_time <= m.first_scheduled_time <= m.token_times[0]  # arrival: the submit
    assert m.token_times[-1] == m.finished_time and (m.finish_reason, m.error, m.ok) == ("length", None, True)
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.side == "engine"
    assert out.metrics["time_to_first_token_s"] == m.ttft and h.tokens_per_s == pytest.approx(1 / m.tpot)


def test_handle_of_a_refused_request_ends_its_record(session):
    h = session.submit("word " * 600, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        h.result(timeout=60)
    m = h.metrics
    assert not m.ok and "max_model_len" in m.error and m.finish_reason == "error"
    assert m.arrival_time <= m.finished_time and m.token_times == []


def test_run_load_poisson_honours_arrivals_and_summarizes_its_records(session):
    workload = SMALL.replace(num_requests=8, arrivals=Arrivals.poisson(40.0))
    due = [r.arrival_s for r in workload.requests(512)]
    assert due[-1] > 0.05  # the arrivals are spread, so sending them all at once would show
    before = time.perf_counter()
    result = run_load(session, workload, target=Target("ttft_p99_ms", 60_000.0))
    records, summary = result.records, result.summary
    assert len(records) == 8 and all(r.ok for r in records)
    assert [r.num_prompt_tokens for r in records] == [len(r.prompt) for r in workload.requests(512)]  # in order
    for record, offset in zip(records, due):
        assert record.arrival_time >= before + offset  # never sent before it was due
        assert len(record.token_times) == record.num_output_tokens > 0
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(len(r.token_times) for r in records)
    ttfts_ms = [1e3 * (r.token_times[0] - r.arrival_time) for r in records]
    assert summary["ttft_p90_ms"] == pytest.approx(_percentile(ttfts_ms, 90))
    assert summary["goodput"] == pytest.approx(8 / summary["duration_s"]) and summary["target_met"] is True
    events = [e for e in session.metrics.events() if e["kind"] in ("load_start", "load_end")]
    assert [e["kind"] for e in events[-2:]] == ["load_start", "load_end"]
    assert events[-1]["workload"] == workload.label and events[-1]["completed"] == 8
    assert not session.inflight()


def test_run_load_bad_request_fails_alone(session, tmp_path):
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Once upon a time", "output_len": 6}, {"prompt": "word " * 600, "output_len": 6},
             {"prompt": "The cat sat", "output_len": 6}]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_load(session, Workload(num_requests=3, dataset=str(data)))
    errors = [r.error for r in result.records]
    assert errors[0] is None and errors[2] is None
    assert "max_model_len" in errors[1]
    assert result.summary["completed"] == 2 and result.summary["failed"] == 1


def test_run_load_matches_the_in_process_driver(session):
    workload = SMALL.replace(arrivals=Arrivals.fixed_concurrency(3))
    ours = run_load(session, workload)
    with ModelRunner({"model": "tiny-llama", **TINY}) as runner:
        runner.load_model()
        reference = run_workload(runner, workload)
    assert len(ours.records) == len(reference.records) == workload.num_requests
    for a, b in zip(ours.records, reference.records):
        assert (a.num_prompt_tokens, a.num_output_tokens, a.ok, a.side) == (b.num_prompt_tokens, b.num_output_tokens,
                                                                            b.ok, b.side)
    for key in ("num_requests", "completed", "input_tokens", "output_tokens"):
        assert ours.summary[key] == reference.summary[key]


def test_reconfigure_changes_max_num_seqs_live(session):
    backend = SessionBackend(session)
    runner = session.models["tiny-llama"].runner
    loads = len(session.metrics.events("load"))
    try:
        assert session.reconfigure(max_num_seqs=3)["rebuilt"] == "scheduler"
        assert session.models["tiny-llama"].runner is runner and runner.config.max_num_seqs == 3
        assert backend.settings()["max_num_seqs"] == 3
        assert session.metrics.events("reconfigure")[-1]["changed"]["max_num_seqs"][1] == 3
        assert len(session.metrics.events("load")) == loads
        with slow_steps(session, delay=0.01):
            h = session.submit("a long story", max_tokens=40, ignore_eos=True)
            next(h.stream(timeout=60))
            with pytest.raises(SessionBusyError, match="running"):
                session.reconfigure(max_num_seqs=5)
            # a sweep's change waits for requests others sent, then applies
            assert backend.apply({"max_num_seqs": 4})["rebuilt"] == "scheduler"
            assert h.done and h.num_tokens == 40 and runner.config.max_num_seqs == 4
    finally:
        session.wait_idle(30)
        backend.apply({"max_num_seqs": TINY.get("max_num_seqs", 256)})


def test_backend_reloads_for_a_dtype_and_keeps_the_model_on_a_bad_value(session):
    backend = SessionBackend(session)
    before = session.models["tiny-llama"].runner
    with pytest.raises(ConfigError, match="dtype"):
        backend.apply({"dtype": "float7"})
    assert session.models["tiny-llama"].runner is before  # validated before anything was unloaded
    try:
        assert backend.apply({"dtype": "bfloat16"})["rebuilt"] == "reload"
        entry = session.models["tiny-llama"]
        assert entry.runner is not before and entry.config.dtype == "bfloat16" and session.active == "tiny-llama"
        assert session.generate("Once upon a time", max_tokens=4, timeout=60).token_ids
    finally:
        backend.apply({"dtype": "float32"})


def test_backend_capacity_is_the_kv_pool_and_proposes_a_space(session):
    capacity = SessionBackend(session).capacity()
    memory = session.memory_stats()
    assert capacity["kv_tokens"] == memory["blocks_total"] * memory["block_size"] > 0
    assert capacity["max_model_len"] == 256 and capacity["block_size"] == memory["block_size"]
    assert propose_space(capacity, SMALL).concurrency


def test_tune_job_with_a_bad_space_fails_naming_the_field(session):
    job = session.tune(SweepSpace(concurrency=[1], scheduler={"max_num_seq": [4]}), SMALL)
    with pytest.raises(ValueError, match="max_num_seq"):
        job.result(timeout=60)
    assert job.status.startswith("failed:") and "max_num_seq" in job.status
    assert not session.models["tiny-llama"].sweeping


def _sweep_space(concurrency):
    return SweepSpace(concurrency=concurrency)


def test_tune_job_finishes_with_rows_and_a_recommendation(session, monkeypatch):
    seen, holder = [], []
    real_run = SessionBackend.run

    def run(self, workload, target):  # runs on the sweep's thread: what would a view read now?
        if holder:
            seen.append((holder[0].version, holder[0].status, len(holder[0].rows)))
        return real_run(self, workload, target)

    monkeypatch.setattr(SessionBackend, "run", run)
    job = session.tune(_sweep_space([1, 2]), SMALL, target=Target("tpot_p99_ms", 60_000.0), repeats=3, warmup=1)
    holder.append(job)
    result = job.result(timeout=120)
    assert job.done and not job.cancelled and job.error is None
    assert len(result.rows) == len(job.rows) == 6
    assert result.recommendation and result.recommendation["settings"] is not None
    assert job.status.startswith("done: best")
    assert any(status.startswith("sweeping: stage concurrency") for _, status, _ in seen)
    versions, counts = [v for v, _, _ in seen], [n for _, _, n in seen]
    assert versions == sorted(versions) and versions[0] < versions[-1] and counts[-1] > counts[0]


def test_tune_job_cancel_stops_early_and_one_job_at_a_time(session, monkeypatch):
    calls, cancelled_handles, holder = [], [], []
    real_run = SessionBackend.run

    def cancel_mid_run():  # once a request of this run has produced a token: cancel the sweep
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(h.num_tokens for h in session.inflight()):
            time.sleep(0.005)
        cancelled_handles.extend(session.inflight())
        holder[0].cancel()

    def run(self, workload, target):  # call 1 warms up, 2 and 3 are repeats 0 and 1 of the first point
        calls.append(workload)
        if len(calls) == 3:
            threading.Thread(target=cancel_mid_run, daemon=True).start()
        return real_run(self, workload, target)

    monkeypatch.setattr(SessionBackend, "run", run)
    workload = SMALL.replace(num_requests=3, output_len=Lengths.fixed(30))
    with slow_steps(session, delay=0.01):
        job = session.tune(_sweep_space([2, 3, 4]), workload, target=Target("tpot_p99_ms", 60_000.0), repeats=3,
                           warmup=1)
        holder.append(job)
        with pytest.raises(SessionBusyError, match="already running"):
            session.tune(_sweep_space([1]), workload)
        with pytest.raises(SessionBusyError, match="sweep"):
            session.set_compile_mode(False)
        with pytest.raises(SessionBusyError, match="sweep"):
            session.reconfigure(max_num_seqs=4)
        result = job.result(timeout=120)
    assert job.done and job.cancelled and result.cancelled and job.status.startswith("cancelled")
    assert len(calls) == 3  # no run after the cancel
    assert cancelled_handles and all(h.finish_reason == "abort" for h in cancelled_handles)
    assert job.rows[0]["repeat"] == 0 and job.rows[0]["completed"] == 3
    assert len(job.rows) < 9
    assert session.wait_idle(30) and not session.inflight()
    assert not session.models["tiny-llama"].sweeping
    again = TuneJob.start(session, _sweep_space([1]), SMALL.replace(num_requests=2), repeats=1, warmup=0)
    assert again.result(60).rows
