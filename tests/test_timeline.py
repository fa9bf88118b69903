"""The per-step record of admissions and finishes (StepMetrics.num_admitted / num_finished) and the
timeline chart drawn from those records (workbench/views/timeline.py)."""

from __future__ import annotations

import pytest

from runner_core import ModelRunner, SamplingParams
from workbench.views.timeline import step_timeline, step_waste

BYTES_PER_BLOCK = 16 * 4 * 2 * 2 * 32 * 4  # tiny-llama: 16 tokens x 4 layers x K,V x 2 KV heads x 32 dims x fp32


def _run(path, prompts, max_tokens, waste: bool = False, **config):
    runner = ModelRunner({"model": str(path), "dtype": "float32", **config}).load_model()
    runner.record_waste_per_step(waste)
    ids = [runner.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(prompts, max_tokens)]
    finished_at = {}
    while runner.has_unfinished_requests():
        for out in runner.step():
            if out.finished:
                finished_at[out.request_id] = runner.step_metrics[-1].step
    return runner, ids, finished_at


def test_steps_count_admissions_and_finishes_where_they_happen(tiny_llama_path):
    prompts = [list(range(3, 3 + k)) for k in (30, 5, 12)]
    runner, ids, finished_at = _run(tiny_llama_path, prompts, [4, 9, 2], max_num_batched_tokens=16, max_num_seqs=4,
                                    kv_cache_memory=1 << 22)
    steps = list(runner.step_metrics)
    assert sum(m.num_preempted for m in steps) == 0
    assert sum(m.num_admitted for m in steps) == 3
    assert steps[0].num_admitted == 1  # the 30-token prompt fills the 16-token budget alone
    per_step = {}
    for step in finished_at.values():
        per_step[step] = per_step.get(step, 0) + 1
    assert {m.step: m.num_finished for m in steps if m.num_finished} == per_step
    assert sorted(finished_at) == sorted(ids)


def test_a_preempted_request_is_admitted_again(tiny_llama_path):
    prompts = [list(range(3, 3 + k)) for k in (40, 35, 30, 25)]
    # 8 blocks of 16 tokens: each request needs 4-5 blocks by its end, so they cannot all stay
    runner, ids, finished_at = _run(tiny_llama_path, prompts, [40] * 4, kv_cache_memory=8 * BYTES_PER_BLOCK,
                                    max_model_len=128)
    steps = list(runner.step_metrics)
    preempted = sum(m.num_preempted for m in steps)
    assert preempted > 0
    assert sum(m.num_admitted for m in steps) == len(ids) + preempted
    assert sum(m.num_finished for m in steps) == len(ids) == len(finished_at)


def test_timeline_draws_the_records(tiny_llama_path):
    prompts = [list(range(3, 43)), [5, 6, 7]]
    runner, _, _ = _run(tiny_llama_path, prompts, [6, 6], max_num_batched_tokens=16, max_num_seqs=4,
                        kv_cache_memory=1 << 22)
    steps = list(runner.step_metrics)
    fig = step_timeline(steps, max_num_batched_tokens=16)
    traces = {t.name: t for t in fig.data}
    assert list(traces["prefill tokens"].y) == [m.num_prefill_tokens for m in steps]
    assert list(traces["decode tokens"].y) == [m.num_decode_tokens for m in steps]
    assert list(traces["prefill tokens"].x) == [m.step for m in steps]
    # chunked prefill: the 40-token prompt runs 16 + 16 + 8 over the first steps, the budget line at 16
    assert list(traces["prefill tokens"].y)[:2] == [16, 16]
    assert set(traces["token budget (16)"].y) == {16}
    assert sum(traces["admitted"].y) == 2 and sum(traces["finished"].y) == 2
    assert len(traces["preempted"].x) == 0
    as_dicts = step_timeline([{k: getattr(m, k) for k in m.__slots__} for m in steps], max_num_batched_tokens=16)
    assert [list(t.y) for t in as_dicts.data] == [list(t.y) for t in fig.data]


def test_waste_per_step_compares_the_allocators(tiny_llama_path):
    prompts = [list(range(3, 3 + k)) for k in (40, 35, 30, 25)]
    runner, _, _ = _run(tiny_llama_path, prompts, [40] * 4, waste=True, kv_cache_memory=8 * BYTES_PER_BLOCK,
                        max_model_len=128)
    steps = [m for m in runner.step_metrics if m.num_running]
    traces = {t.name: list(t.y) for t in step_waste(runner.step_metrics).data}
    assert traces["paged pool"] == pytest.approx([100 * (1 - m.kv_utilization) for m in steps], abs=0.006)
    assert traces["static max_model_len reservation"] == pytest.approx(
        [100 * m.static_reservation_waste for m in steps], abs=0.006)
    # the paged pool wastes less than a block per request; a max_model_len reservation wastes more
    assert max(traces["paged pool"]) < 50 < max(traces["static max_model_len reservation"])
    assert len(traces["first fit: reserved, not filled"]) == len(steps)


def test_timeline_of_nothing_and_of_wrong_records():
    empty = step_timeline([])
    assert not empty.data and "one point per engine step appears here" in empty.layout.annotations[0].text
    with pytest.raises(ValueError, match="no num_admitted, num_finished; pass runner.step_metrics"):
        step_timeline([{"step": 1, "num_prefill_tokens": 4, "num_decode_tokens": 0, "num_running": 1,
                        "num_waiting": 0, "num_preempted": 0}])


def test_steps_without_their_waste_figures_say_how_to_record_them(tiny_llama_path):
    from workbench.views.timeline import WASTE_FIELDS, step_rows

    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 1 << 22}).load_model()
    runner.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(ValueError, match=r"only after runner\.record_waste_per_step\(\)"):
        step_rows(runner.step_metrics, WASTE_FIELDS)
    runner.shutdown()


def test_the_step_view_draws_one_point_per_step_and_a_steps_batch(tiny_llama_path):
    """Blocks and phase times per recorded step; a step's batch names its requests, preemptions and blocks; a long
    run thinned to a chart's points keeps its events and its last state."""
    from workbench.views.timeline import step_batch, step_blocks, step_times, thin

    runner = ModelRunner({"model": str(tiny_llama_path), "dtype": "float32", "kv_cache_memory": 6 * 16 * 4 * 2 * 2
                          * 32 * 4, "max_model_len": 96}).load_model()
    runner.record_step_detail()
    runner.generate([[5 + i] * (20 + 9 * i) for i in range(4)],
                    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    steps, details = list(runner.step_metrics), list(runner.step_details)
    blocks = {t.name: list(t.y) for t in step_blocks(steps).data}
    assert blocks["used"] == [s.blocks_used for s in steps] and len(blocks["free"]) == len(steps)
    total = {u + c + f for u, c, f in zip(blocks["used"], blocks["cached"], blocks["free"], strict=True)}
    assert total == {steps[0].blocks_used + steps[0].blocks_free}  # stacked to the pool, the cached ones once
    times = {t.name: list(t.x) for t in step_times(steps).data}
    assert times["model"] == [s.step for s in steps]
    k = next(i for i, d in enumerate(details) if d.preempted)
    fig = step_batch(details[k], details[k - 1])
    assert f"Step {details[k].step}:" in fig.layout.title.text and "no block for" in fig.layout.title.text
    assert sorted(y for t in fig.data for y in t.y) == sorted(rid for rid, _, _ in details[k].scheduled)
    assert "no step recorded yet" in step_batch(None).layout.annotations[0].text

    # a chart of at most 5 points: a point per k steps, the run's events all counted, its last state kept
    points, per = thin(steps, 5)
    assert per == -(-len(steps) // 5) and len(points) <= 5
    assert [r["step"] for r in thin(steps, len(steps))[0]] == [s.step for s in steps]
    assert [p["step"] for p in points] == [s.step for s in steps[per - 1::per]] + (
        [steps[-1].step] if len(steps) % per else [])
    for key in ("num_admitted", "num_finished", "num_preempted"):
        assert sum(p[key] for p in points) == sum(getattr(s, key) for s in steps)
    assert points[-1]["blocks_used"] == steps[-1].blocks_used and points[-1]["num_running"] == steps[-1].num_running
    first = steps[:per]
    assert points[0]["num_decode_tokens"] == pytest.approx(sum(s.num_decode_tokens for s in first) / per)
    assert points[0]["forward_s"] == pytest.approx(sum(s.forward_s for s in first) / per)
    assert [t.x[-1] for t in step_blocks(points).data] == [steps[-1].step] * 3
