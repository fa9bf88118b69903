"""The lessons' measurement charts (workbench/views/perf_charts.py): each draws the figures it is given,
in the units its axis names, and says what is missing when given nothing."""

from __future__ import annotations

import pytest

from runner_core import suggest_parallel_config
from workbench.views import perf_charts
from workbench.views.charts import PALETTE


def _note(fig) -> str:
    return " ".join(a.text for a in fig.layout.annotations)


@pytest.mark.parametrize("fn, args, words", [
    (perf_charts.engine_throughput, ([],), "no engine"),
    (perf_charts.time_by_kind, ({},), "no profiled case"),
    (perf_charts.comm_per_step, ({"TP=1": {}},), "one-process runner has none"),
    (perf_charts.parallel_layouts, ([{"tp": 3, "pp": 1, "need_bytes": None, "fits": False, "why": "x"}], 1),
     "no layout"),
])
def test_empty_input_gives_a_figure_with_a_note(fn, args, words):
    fig = fn(*args)
    assert not fig.data and words in _note(fig)


def test_engine_throughput_bars_and_mfu_labels():
    rows = [{"engine": "ours", "tok_s": 412.3, "mfu": 0.315}, {"engine": "transformers", "tok_s": 150.0}]
    fig = perf_charts.engine_throughput(rows)
    bar = fig.data[0]
    assert list(bar.x) == ["ours", "transformers"] and list(bar.y) == [412.3, 150.0]
    assert "MFU 31.5%" in bar.text[0] and "MFU" not in bar.text[1]
    assert fig.layout.yaxis.title.text == "useful tokens/s" and fig.layout.yaxis.range[1] > 412.3


def test_time_by_kind_stacks_shares_to_100_percent_per_case():
    cases = {"decode 1": {"matmul": 0.8, "sampling": 0.05, "other": 0.15, "step_ms": 21.96, "outside_forward": 0.04},
             "prefill": {"matmul": 0.7, "sampling": 0.0, "other": 0.3, "step_ms": 300.0, "outside_forward": 0.01}}
    fig = perf_charts.time_by_kind(cases)
    assert [t.name for t in fig.data] == ["matmul", "sampling", "other"]  # step_ms, outside_forward: not op kinds
    assert fig.layout.barmode == "stack"
    assert list(fig.data[0].y) == ["decode 1 (22.0 ms/step)", "prefill (300.0 ms/step)"]
    for row in range(2):
        assert sum(t.x[row] for t in fig.data) == pytest.approx(100.0)
    assert fig.data[0].marker.color == PALETTE[0]


def test_comm_per_step_in_kib_per_kind_with_calls():
    tp = {"all_reduce": {"calls": 9, "bytes": 9 * 2048}, "send": {"calls": 0, "bytes": 0}}
    pp = {"send": {"calls": 1, "bytes": 1024}}
    fig = perf_charts.comm_per_step({"TP=2": tp, "PP=2": pp})
    assert [t.name for t in fig.data] == ["TP=2", "PP=2"]
    assert list(fig.data[0].x) == ["all_reduce", "send"]  # kinds with calls in some layout, in order
    assert list(fig.data[0].y) == [18.0, 0.0] and list(fig.data[1].y) == [0.0, 1.0]
    assert list(fig.data[0].text) == ["9 calls", ""] and fig.data[1].text[1] == "1 call"


def test_parallel_layouts_from_a_real_suggestion(tiny_llama_path):
    kw = dict(gpu_memory_utilization=1.0, dtype="float32", max_model_len=256)
    roomy = suggest_parallel_config(tiny_llama_path, 4, device_memory=1 << 40, **kw)
    one_device = next(c["need_bytes"] for c in roomy.candidates if (c["tp"], c["pp"]) == (1, 1))
    plan = suggest_parallel_config(tiny_llama_path, 4, device_memory=one_device - 1, **kw)  # 1 device: too small
    assert {c["fits"] for c in plan.candidates if c["need_bytes"]} == {True, False}
    chosen = (plan.tensor_parallel_size, plan.pipeline_parallel_size)
    fig = perf_charts.parallel_layouts(plan.candidates, plan.device_bytes, chosen=chosen)
    sized = [c for c in plan.candidates if c["need_bytes"] is not None]
    bar = fig.data[0]
    assert len(bar.x) == len(sized) and list(bar.y) == [c["need_bytes"] / 2**30 for c in sized]
    assert list(bar.marker.color) == [PALETTE[2] if c["fits"] else PALETTE[3] for c in sized]
    widths = list(bar.marker.line.width)
    picked = [i for i, c in enumerate(sized) if (c["tp"], c["pp"]) == chosen]
    assert [i for i, w in enumerate(widths) if w] == picked and "chosen" in bar.text[picked[0]]
    assert fig.layout.shapes[0].y0 == pytest.approx(plan.device_bytes / 2**30)  # the usable-memory line
