"""workbench.views.tuning_charts: the Tuning tab's figures from a sweep's points (hand-built here, in the shape
TuneJob.points and TuneResult.points give): valid and noted when empty, points labelled with the settings
that differ, the target drawn where it applies, pass and fail told apart, and the progress fraction; then the
Tuning tab of the ipywidgets view driven with .value and .click() through a tiny sweep on tiny-llama."""

from __future__ import annotations

import html
import json
from types import SimpleNamespace

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from runner_core.tuning import Target
from workbench import Session
from workbench.views import tuning_charts as tc

TARGET = Target("tpot_p99_ms", 100.0)


def _point(c: int, seqs: int, throughput: float, per_user: float, tpot: float, spread: float = 5.0) -> dict:
    settings = {"max_num_seqs": seqs, "block_size": 16, "concurrency": c}  # block_size: the same everywhere
    median = {"output_throughput": throughput, "tokens_per_s_per_user": per_user, "tpot_p99_ms": tpot,
              "ttft_p99_ms": 10.0 * c}
    return {"key": f"k{c}-{seqs}", "stage": "concurrency", "label": f"concurrency={c} max_num_seqs={seqs}",
            "settings": settings, "values": {"max_num_seqs": seqs, "concurrency": c}, "repeats": 3,
            "median": median, "min": {k: v - spread for k, v in median.items()},
            "max": {k: v + 2 * spread for k, v in median.items()}, "met": tpot <= TARGET.limit}


POINTS = [_point(8, 16, 400.0, 20.0, 120.0), _point(1, 16, 60.0, 60.0, 16.0), _point(4, 16, 200.0, 50.0, 20.0),
          _point(4, 8, 150.0, 30.0, 40.0)]  # the last is beaten on both axes by the third


def _spec(fig: go.Figure) -> dict:
    go.Figure(fig.to_dict())  # re-validates every property
    return json.loads(pio.to_json(fig))


@pytest.mark.parametrize("name", ["pareto", "latency", "pass_fail"])
def test_no_points_give_a_valid_figure_with_a_note(name):
    spec = _spec(tc.all_figures([], TARGET)[name])
    assert spec["data"] == [] and any("start a sweep" in a["text"] for a in spec["layout"]["annotations"])


def test_labels_name_only_the_settings_that_differ():
    assert tc.short_labels(POINTS) == ["c=8 seqs=16", "c=1 seqs=16", "c=4 seqs=16", "c=4 seqs=8"]
    staged = [{"settings": {"concurrency": 1}}, {"settings": {"concurrency": 16, "max_num_batched_tokens": 576}}]
    assert tc.short_labels(staged) == ["c=1", "c=16 tokens=576"], "a setting a point leaves alone is not None"
    assert tc.short_labels(POINTS[:1]) == ["concurrency=8 max_num_seqs=16"], "one point: its own label"


def test_pareto_labels_points_greys_misses_draws_the_frontier_and_rings_the_recommendation():
    rec = {"settings": POINTS[2]["settings"], "label": POINTS[2]["label"]}
    fig = tc.pareto(POINTS, recommendation=rec, target=TARGET)
    _spec(fig)
    traces = {t.name: t for t in fig.data}
    met, missed = traces["meets the target"], traces["misses the target"]
    # the frontier's points are labelled; the dominated one names its settings on hover only
    assert list(met.text) == ["c=1 seqs=16", "c=4 seqs=16", ""] and list(missed.text) == ["c=8 seqs=16"]
    assert "c=4 seqs=8" in met.hovertext[2]
    assert missed.marker.symbol == "x" and missed.marker.color == tc.MISSED != met.marker.color
    assert "misses tpot_p99_ms ≤ 100" in missed.hovertext[0]
    frontier = traces["Pareto frontier"]
    assert list(frontier.x) == [60.0, 200.0, 400.0], "the dominated point (150, 30) is off the frontier"
    ring = traces["recommended: c=4 seqs=16"]
    assert (ring.x[0], ring.y[0]) == (200.0, 50.0)
    assert fig.layout.xaxis.title.text == "output tokens/s (device)"
    given = tc.pareto(POINTS, frontier=[{"output_throughput": 1.0, "tokens_per_s_per_user": 2.0}])
    assert list(next(t for t in given.data if t.name == "Pareto frontier").x) == [1.0], "a result's frontier wins"


def test_latency_against_concurrency_has_range_bars_and_the_target_on_its_metric():
    fig = tc.latency_vs_concurrency(POINTS, TARGET)
    _spec(fig)
    ttft, tpot = fig.data
    assert list(tpot.x) == [1, 4, 4, 8] and tpot.mode == "markers", "two points at c=4: no line through them"
    assert list(tpot.error_y.array) == [10.0] * 4 and list(tpot.error_y.arrayminus) == [5.0] * 4
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 100.0 and line.yref == "y2", "the TPOT target on the TPOT panel"
    ttft_fig = tc.latency_vs_concurrency(POINTS[:3], Target("ttft_p99_ms", 50.0))
    assert ttft_fig.layout.shapes[0].yref == "y" and ttft_fig.data[0].mode == "lines+markers"
    assert tc.latency_vs_concurrency(POINTS, Target("e2e_p99_ms", 900.0)).layout.shapes == (), "no panel for e2e"


def test_pass_fail_colours_each_point_and_counts_the_passes():
    fig = tc.pass_fail(POINTS, TARGET)
    _spec(fig)
    (bars,) = fig.data
    assert list(bars.marker.color) == [tc.FAIL, tc.PASS, tc.PASS, tc.PASS]
    assert fig.layout.title.text == "Target tpot_p99_ms ≤ 100: 3 of 4 points pass"
    assert fig.layout.shapes[0].y0 == 100.0


def test_progress_fraction_and_the_recommendation_line():
    progress = SimpleNamespace(point_index=2, points_total=4, repeat=0)
    assert tc.progress_fraction(None, 3) == 0.0
    assert tc.progress_fraction(progress, 3) == pytest.approx(7 / 12)
    rec = {"settings": POINTS[2]["settings"], "label": "concurrency=4 max_num_seqs=16", "value": 20.0,
           "margin": 0.8, "throughput": 200.0, "met": True, "ties": [POINTS[3]["settings"]]}
    text = tc.recommendation_text(SimpleNamespace(recommendation=rec), TARGET)
    assert text.startswith("**Recommended: concurrency=4 max_num_seqs=16** — 200.0 output tokens/s")
    assert "margin 80%" in text and text.endswith("within noise of it: max_num_seqs=8")
    none = tc.recommendation_text(SimpleNamespace(recommendation=None, why="no point was measured"), TARGET)
    assert none == "**No recommendation**: no point was measured"


def test_the_widgets_tuning_tab_proposes_values_runs_a_sweep_and_recommends(tiny_llama_path):
    from runner_core.tuning import Workload, propose_space
    from workbench.tuning import SessionBackend
    from workbench.views.widgets import SessionWidgets

    s = Session()
    ui = SessionWidgets(s, auto_refresh=False)
    try:
        assert ui.tabs.titles[:2] == ("Live", "Tuning") and ui.tune_figures["pareto"].data == ()
        s.load_model("tiny-llama", dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
        ui.refresh()
        proposed = propose_space(SessionBackend(s).capacity(), Workload(num_requests=ui.tune_requests.value))
        assert ui.tune_concurrency.value == ", ".join(map(str, proposed.concurrency)), "from the KV capacity"
        ui.window_select.value = "last run"
        assert ui.chart_window == "last run"

        ui.tune_concurrency.value = "1, x"
        ui.tune_start.click()
        assert "concurrency values: 'x' is not a whole number" in html.unescape(ui.error.value) and ui.tune_job is None
        ui.tune_concurrency.value, ui.tune_seqs.value = "1, 2", ""
        ui.tune_repeats.value, ui.tune_requests.value, ui.tune_limit.value = 1, 4, 1000.0
        ui.tune_start.click()
        assert ui.error.value == "" and ui.tune_job is not None
        result = ui.tune_job.result(300)
        ui.refresh()
        assert ui.tune_progress.value == 100 and ui.tune_status.value.startswith("done")
        met = next(t for t in ui.tune_figures["pareto"].data if t.name == "meets the target")
        shown = sorted(t for t in met.text if t)  # which points are on the frontier depends on the machine's speed
        assert len(met.x) == 2, "both points on the Pareto chart"
        assert len(shown) == len(result.frontier) >= 1 and set(shown) <= {"c=1", "c=2"}, "the frontier's labelled"
        assert result.recommendation["label"] in ui.tune_recommendation.value
        assert ui.tune_recommendation.value.startswith("<b>Recommended: ")
    finally:
        ui.close()
        s.close()
