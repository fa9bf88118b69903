"""RequestMetrics' figures and the run summary on hand-built records (expected figures by explicit
arithmetic), latency targets, and the in-process driver on tiny-llama: the engine's records (one time per
token), exact output lengths, sends no earlier than due, a concurrency cap that holds, a refused request that
fails alone."""

from __future__ import annotations

import json
import math
import time

import pytest

from runner_core import ModelRunner, RequestMetrics
from runner_core.tuning import Arrivals, Lengths, Target, Workload, run_workload, summarize


def _record(arrival: float, prompt_tokens: int, token_times: list[float], end: float | None,
            error: str | None = None) -> RequestMetrics:
    return RequestMetrics(arrival, prompt_tokens, token_times=token_times, finished_time=end, error=error)


def _records() -> list[RequestMetrics]:
    return [
        # TTFT 0.1, E2E 0.6, TPOT (0.6 - 0.1) / 2 = 0.25, ITLs 0.2 and 0.3
        _record(0.0, 10, [0.1, 0.3, 0.6], 0.6),
        # a chunk of two tokens at 0.35: TTFT 0.05, E2E 0.35, TPOT 0.3 / 3 = 0.1, ITLs 0.1 and 0.2 (one per chunk)
        _record(0.2, 20, [0.25, 0.35, 0.35, 0.55], 0.55),
        _record(0.5, 7, [], 0.5, error="refused"),
        # one token: TTFT = E2E = 0.05, no TPOT, no ITL
        _record(0.4, 5, [0.45], 0.45),
    ]


def test_record_properties():
    a, b, failed, single = _records()
    assert (a.ttft, a.e2e, a.tpot, *a.itls) == pytest.approx((0.1, 0.6, 0.25, 0.2, 0.3))
    assert (b.ttft, b.e2e, b.tpot, *b.itls) == pytest.approx((0.05, 0.35, 0.1, 0.1, 0.2))
    assert b.num_output_tokens == 4 and not failed.ok and single.tpot is None and single.itls == []
    assert not _record(0.0, 1, [0.1], None).ok  # never ended
    # a stream closing after its last token (a client's record): E2E runs to the close, TPOT to the last token
    late = RequestMetrics(1.0, 3, token_times=[1.1, 1.3, 1.5], side="client")
    late.finish(1.9, "length")
    assert late.ok and (late.ttft, late.tpot, late.e2e) == pytest.approx((0.1, 0.2, 0.9))
    assert (late.first_token_time, late.last_token_time) == (1.1, 1.5)


def test_summary_figures_by_hand():
    s = summarize(_records(), duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert (s["input_tokens"], s["output_tokens"]) == (35, 8)  # completed requests only
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == pytest.approx(
        (1.5, 4.0, 21.5))
    # TTFTs 100, 50, 50 ms; linear interpolation at rank q/100 x (n - 1) over the sorted values
    assert [s[f"ttft_{k}_ms"] for k in ("mean", "p50", "p90", "p99")] == pytest.approx([200 / 3, 50, 90, 99])
    # TPOTs 250 and 100 ms (the one-token request has none)
    assert [s[f"tpot_{k}_ms"] for k in ("mean", "p50", "p90", "p99")] == pytest.approx([175, 175, 235, 248.5])
    # ITLs 200, 300, 100, 200 ms
    assert [s[f"itl_{k}_ms"] for k in ("mean", "p50", "p90")] == pytest.approx([200, 200, 270])
    assert [s[f"e2e_{k}_ms"] for k in ("mean", "p50")] == pytest.approx([1000 / 3, 350])
    assert s["tokens_per_s_per_user"] == pytest.approx((4 + 10) / 2)  # median of 1/TPOT: 4 and 10 tok/s
    assert s["goodput"] is None and s["target_met"] is None


def test_goodput_and_target_on_tpot():
    target = Target("tpot_p99_ms", 200)
    assert target.slo == {"tpot_ms": 200}
    s = summarize(_records(), duration_s=2.0, target=target)
    # good: request 1 (TPOT 100) and the one-token request 3 (no TPOT counts as 0, as in vLLM); 0 has 250
    assert (s["goodput"], s["goodput_fraction"]) == pytest.approx((1.0, 0.5))
    assert s["target_met"] is False and target.margin(s) == pytest.approx((200 - 248.5) / 200)


def test_goodput_and_target_on_ttft_and_explicit_slo():
    s = summarize(_records(), duration_s=1.0, target=Target("ttft_p50_ms", 60))
    assert s["target_met"] is True and s["goodput"] == pytest.approx(2.0)  # TTFTs 100 (no), 50, 50
    assert Target("ttft_p50_ms", 60).margin(s) == pytest.approx(1 / 6)
    explicit = Target("ttft_p50_ms", 60, slo={"ttft_ms": 80, "e2e_ms": 300})
    assert summarize(_records(), 1.0, explicit)["goodput"] == pytest.approx(1.0)  # request 1's E2E is 350


def test_a_run_with_nothing_completed_has_no_latencies_and_misses_its_target():
    s = summarize([_record(0.0, 3, [], 0.1, error="refused")], 1.0, Target())
    assert s["completed"] == 0 and s["ttft_p99_ms"] is None and s["tokens_per_s_per_user"] is None
    assert s["target_met"] is False and Target().margin(s) == -math.inf and s["goodput"] == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"metric": "tpot_p95_ms"}, "Target.metric 'tpot_p95_ms' is unknown; use one of ttft_mean_ms"),
    ({"limit": 0}, "Target.limit must be a number of milliseconds > 0"),
    ({"slo": {"itl_ms": 5}}, "Target.slo key 'itl_ms' is unknown; use ttft_ms, tpot_ms, e2e_ms"),
])
def test_bad_targets_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Target(**kwargs)


def test_summarize_refuses_a_zero_duration():
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        summarize(_records(), 0.0)


# ---- the in-process driver -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    return ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()


def _workload(**kw) -> Workload:
    return Workload(**{"num_requests": 12, "prompt_len": Lengths.uniform(4, 24), "output_len": Lengths.uniform(2, 9),
                       **kw})


def test_every_request_completes_with_exactly_max_tokens(runner):
    w = _workload()
    result = run_workload(runner, w, target=Target("e2e_p99_ms", 60_000))
    reqs = w.requests(runner.engine.vocab_size)
    assert len(result.records) == 12  # in the workload's order, as the prompt lengths show
    assert [r.num_output_tokens for r in result.records] == [q.max_tokens for q in reqs]
    assert [r.num_prompt_tokens for r in result.records] == [len(q.prompt) for q in reqs]
    for r in result.records:  # the engine's record: scheduled after the send, one time per token, ended at the last
        assert r.ok and r.side == "engine" and r.finish_reason == "length" and r.num_preemptions == 0
        assert r.arrival_time <= r.first_scheduled_time <= r.token_times[0]
        assert r.token_times == sorted(r.token_times) and len(set(r.token_times)) == len(r.token_times)
        assert r.token_times[-1] == r.finished_time
    s = result.summary
    assert (s["completed"], s["output_tokens"], s["target_met"]) == (12, sum(q.max_tokens for q in reqs), True)
    assert result.workload is w and result.settings == {}


def test_poisson_arrivals_are_sent_no_earlier_than_due(runner):
    w = _workload(arrivals=Arrivals.poisson(40.0))
    due = [q.arrival_s for q in w.requests(runner.engine.vocab_size)]
    before = time.perf_counter()
    result = run_workload(runner, w)
    assert due[-1] > 0.1  # the arrivals spread out ...
    for r, t in zip(result.records, due):
        assert r.arrival_time - before >= t  # ... and no request went before its time
    assert result.summary["duration_s"] >= due[-1] and result.summary["completed"] == 12


def _max_running(runner, workload) -> int:
    runner.step_metrics.clear()
    run_workload(runner, workload)
    return max(m.num_running for m in runner.step_metrics)


def test_concurrency_mode_never_has_more_than_n_in_flight(runner):
    assert _max_running(runner, _workload(arrivals=Arrivals.fixed_concurrency(3))) == 3
    assert _max_running(runner, _workload(arrivals=Arrivals.poisson(1000.0, concurrency=2))) == 2
    assert _max_running(runner, _workload()) > 3  # a burst is not capped


def test_a_refused_request_is_a_failed_record_and_the_run_goes_on(runner, tmp_path):
    path = tmp_path / "prompts.jsonl"
    vocab = runner.engine.vocab_size
    path.write_text(f'{{"prompt": [5, 6, 7], "output_len": 4}}\n{{"prompt": [{vocab + 5}], "output_len": 4}}\n'
                    '{"prompt": [8, 9], "output_len": 3}\n')
    result = run_workload(runner, Workload(num_requests=3, dataset=str(path)))
    ok = [r.ok for r in result.records]
    assert ok == [True, False, True] and str(vocab + 5) in result.records[1].error
    assert [r.num_output_tokens for r in result.records] == [4, 0, 3] and result.summary["failed"] == 1
    assert not runner.has_unfinished_requests()


def test_a_sharegpt_file_runs_with_reply_lengths_counted_by_the_models_tokenizer(runner, tmp_path):
    replies = ["a short answer", "a somewhat longer answer than the other one"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question {i}"},
                                                   {"from": "gpt", "value": reply}]}
                                for i, reply in enumerate(replies)]))
    result = run_workload(runner, Workload(num_requests=2, dataset=str(path)))
    hf = runner.tokenizer.hf
    assert [r.num_output_tokens for r in result.records] == [len(hf(t, add_special_tokens=False).input_ids)
                                                         for t in replies]
    assert [r.num_prompt_tokens for r in result.records] == [len(hf(f"question {i}").input_ids) for i in range(2)]
