"""workbench.views.charts: valid plotly figures from empty and from full histories (pure functions);
time since the model was loaded, idle gaps as gaps, titles and units, one palette; the rows'
time origin is the model's load and its history goes with an unload."""

from __future__ import annotations

import json
import time

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from workbench import Session
from workbench.runtime.metrics import MetricsSeries, StepAccumulator
from workbench.views import charts


def _full_rows(n: int = 3000) -> list[dict]:
    rows = []
    for i in range(n):
        used = (i * 7) % 200
        rows.append({
            "t": i * 0.1, "dt": 0.1, "model": "m", "steps": 5, "prefill_tokens": (i % 3) * 100,
            "decode_tokens": 40, "sampled_tokens": 40, "preempted": i % 50 == 0, "num_seqs": 8, "num_running": 8,
            "num_waiting": 2, "tokens_per_s": 400.0, "step_ms": 20.0, "forward_ms": 15.0,
            "weights_bytes": 3_478_016, "kv_pool_bytes": 16 << 20, "blocks_total": 512, "blocks_used": used,
            "blocks_cached": 10, "blocks_free": 512 - used, "block_size": 16, "kv_utilization": 0.9,  # free: cached too
            "internal_fragmentation": 0.1, "static_reservation_waste": 0.85, "prefix_cache_hit_rate": 0.0,
            "activation_peak_bytes": 1 << 20,
        })
    return rows


def _valid(fig: go.Figure) -> dict:
    assert isinstance(fig, go.Figure)
    go.Figure(fig.to_dict())  # re-validates every property
    spec = json.loads(pio.to_json(fig))
    assert "data" in spec and "layout" in spec
    return spec


EMPTY_BLOCK_MAP = {"num_blocks": 0, "owners": {}}
# model_info()["quantization"] of an int4 model, with its compute dtype (what ModelEntry.weights_storage gives)
INT4 = {"format": "int4", "group_size": 64, "lm_head": False, "quantized_layers": 8, "kept_layers": [],
        "weights_bytes": 30 << 20, "dense_bytes": 120 << 20, "dtype": "float32"}


@pytest.mark.parametrize("name", ["memory", "weights", "blocks", "waste", "throughput", "block_map", "compile"])
def test_empty_history_gives_a_valid_figure_with_a_note(name):
    fig = charts.all_figures([], [], None)[name]
    spec = _valid(fig)
    assert spec["data"] == [] and spec["layout"]["annotations"], "an empty chart says what will appear"
    assert _valid(charts.all_figures([], [], EMPTY_BLOCK_MAP)[name])


def test_full_history_figures():
    rows = _full_rows()
    events = [{"kind": "load", "t": 0.0}, {"kind": "compile", "t": 1.0, "enabled": True, "backend": "inductor",
                                           "mode": "default", "seconds": 12.5, "ok": True,
                                           "stats": {"compile_seconds_per_size": {"1": 2.0, "8": 3.5},
                                                     "decode_programs": {"build_seconds": {"4": 1.5, "1": 0.5}}}},
              {"kind": "compile", "t": 2.0, "enabled": False, "seconds": 0.1, "ok": True},
              {"kind": "compile", "t": 3.0, "enabled": True, "backend": "bogus", "seconds": 0.0, "ok": False,
               "error": "unknown backend"}]
    owners = {f"wb-{i}": list(range(i * 6, i * 6 + 5)) for i in range(30)}
    snapshot = {"num_blocks": 512, "block_size": 16, "owners": owners, "cached_block_ids": [500, 501]}
    figs = charts.all_figures(rows, events, snapshot)
    for fig in figs.values():
        _valid(fig)

    mem = figs["memory"]
    assert [t.name for t in mem.data] == ["weights", "activations (peak)", "KV in use", "KV cached", "KV free"]
    assert all(len(t.x) == len(rows) for t in mem.data)
    top = sum(t.y[-1] for t in mem.data if t.name.startswith("KV"))
    assert top == pytest.approx(16.0)  # the KV bands add up to the pool (MiB)
    assert [t.name for t in figs["blocks"].data] == ["used", "cached", "free"]
    waste = figs["waste"]
    assert waste.data[0].y[-1] == pytest.approx(85.0) and waste.data[1].y[-1] == pytest.approx(10.0)
    thr = figs["throughput"]
    assert [t.name for t in thr.data] == ["prompt tokens/s (prefill)", "generated tokens/s (decode)"]
    assert thr.data[1].y[-1] == pytest.approx(400.0)  # 40 tokens per 0.1 s
    assert thr.data[0].y[-1] == pytest.approx(charts.rolling_rate(rows, "prefill_tokens")[-1])
    bars = figs["compile"].data
    assert list(bars[0].x) == ["#1 inductor/default", "#2 eager", "#3 bogus"]
    assert list(bars[1].y) == [2.0, 3.5]
    assert (list(bars[2].x), list(bars[2].y)) == (["decode 1", "decode 4"], [0.5, 1.5])

    heat = figs["block_map"].data[0]
    z = [v for row in heat.z for v in row]
    assert len(z) == 512
    assert z[0] != 0 and z[5] == 0 and z[500] == 1  # owned, free, cached
    assert z[0] != z[6]  # two requests, two colours
    assert "30 requests hold 150 of 512 blocks" in figs["block_map"].layout.title.text
    assert "wb-0" in heat.hovertext[0][0]


def test_block_map_of_a_huge_pool_shows_its_low_end():
    snap = {"num_blocks": 65536, "owners": {"a": [0, 1, 2], "b": [700]}}
    fig = charts.kv_block_map(snap, columns=64, max_blocks=4096)
    heat = fig.data[0]
    assert len(heat.z) * 64 <= 4096 and len(heat.z) * 64 > 700
    assert "first" in fig.layout.title.text


def test_block_map_marks_a_shared_block_and_names_its_holders():
    snap = {"num_blocks": 64, "owners": {"req-0": [0, 1, 2], "req-0#1": [0, 1, 3]}}  # a fork: 0, 1 shared
    fig = charts.kv_block_map(snap, columns=8)
    heat = fig.data[0]
    assert heat.z[0][0] == heat.z[0][1] == 2 and heat.z[0][2] != 2 and heat.z[0][3] != 2
    assert heat.hovertext[0][0] == "block 0: shared by req-0, req-0#1"
    assert "2 requests hold 4 of 64 blocks, 2 shared" in fig.layout.title.text


def test_rolling_rate_averages_busy_time():
    rows = [{"t": 0.0, "dt": 0.1, "n": 10}, {"t": 0.1, "dt": 0.1, "n": 30}, {"t": 5.0, "dt": 0.05, "n": 5}]
    assert charts.rolling_rate(rows, "n", window=1.0) == pytest.approx([100.0, 200.0, 100.0])


def test_accumulator_folds_steps_into_rows():
    class M:  # a StepMetrics stand-in
        def __init__(self, step):
            self.step, self.num_prefill_tokens, self.num_decode_tokens, self.num_sampled = step, 16, 4, 5
            self.num_preempted, self.num_seqs, self.num_running, self.num_waiting = 0, 5, 5, 1
            self.total_s, self.forward_s = 0.01, 0.008

    acc = StepAccumulator("m", t0=0.0)
    for step in (1, 2, 2, 3):  # a repeated record is counted once
        acc.add(M(step))
    row = acc.flush(acc.start + 0.5, {"blocks_used": 3, "unrelated": 1})
    assert row["steps"] == 3 and row["prefill_tokens"] == 48 and row["tokens_per_s"] == pytest.approx(30.0)
    assert row["blocks_used"] == 3 and "unrelated" not in row and row["step_ms"] == pytest.approx(10.0)
    series = MetricsSeries(maxlen=2)
    for i in range(5):
        series.append({"t": i, "model": "a" if i % 2 else "b"})
    assert len(series) == 2 and [r["t"] for r in series.rows()] == [3, 4]
    assert series.poll(3) == (series.rows(), 5) and series.rows(model="a") == [{"t": 3, "model": "a"}]
    series.drop("a")  # its model was unloaded
    assert series.rows() == [{"t": 4, "model": "b"}] and series.poll(3) == ([{"t": 4, "model": "b"}], 5)
    series.append({"t": 0, "model": "a"})
    assert series.poll(5) == ([{"t": 0, "model": "a"}], 6)


def _with_idle_gap(idle: float) -> list[dict]:
    rows = _full_rows(20)
    for r in rows[10:]:
        r["t"] += idle
    return rows


def test_idle_time_is_a_gap_not_a_line_across_it():
    figs = charts.all_figures(_with_idle_gap(5.0))
    for name in ("waste", "throughput"):  # lines: a None break where the model was idle
        for trace in figs[name].data:
            assert trace.connectgaps is False
            breaks = [i for i, x in enumerate(trace.x) if x is None]
            assert breaks == [10] and trace.y[10] is None, name
    for name in ("memory", "blocks"):  # stacked areas: one stack per busy stretch, one legend entry each
        groups = {t.stackgroup for t in figs[name].data}
        assert len(groups) == 2, name
        assert [t.name for t in figs[name].data if t.showlegend] == [t.name for t in figs[name].data][:len(
            figs[name].data) // 2]
        assert max(figs[name].data[0].x) < 1.0 + 0.1 * 10 < min(figs[name].data[-1].x)

    busy = charts.all_figures(_with_idle_gap(0.2))  # a short pause is no gap
    assert None not in busy["waste"].data[0].x and len({t.stackgroup for t in busy["memory"].data}) == 1


def test_every_chart_has_a_title_axis_units_no_second_axis_and_a_legend_off_the_plot():
    events = [{"kind": "compile", "t": 1.0, "enabled": True, "backend": "inductor", "mode": "default",
               "seconds": 12.5, "ok": True, "stats": {"compile_seconds": {"1": 2.0}}}]
    rows = _full_rows(50)
    rows[-1]["expert_counts"], rows[-1]["moe_layers"] = [[3, 1], [0, 4]], [0, 1]
    figs = charts.all_figures(rows, events, {"num_blocks": 64, "owners": {"a": [0, 1]}}, weights=INT4)
    for name, fig in figs.items():
        layout = fig.layout
        assert layout.title.text, name
        assert layout.xaxis.title.text and layout.yaxis.title.text, name
        assert "yaxis2" not in layout.to_plotly_json(), f"{name}: one y axis"
        assert layout.legend.y < 0 and layout.legend.yanchor == "top", f"{name}: the legend sits under the plot"
        assert layout.autosize and layout.width is None, f"{name}: as wide as its container"
    for name in ("memory", "blocks", "waste", "throughput"):
        assert figs[name].layout.xaxis.title.text == charts.TIME_AXIS == "seconds since the model was loaded"
    assert {figs[n].layout.yaxis.title.text for n in ("memory", "blocks", "waste", "throughput", "compile")} == {
        "MiB", "blocks", "% of reserved slots", "tokens/s", "seconds"}


def _colors(fig: go.Figure) -> set[str]:
    found = set()
    for trace in fig.data:
        spec = trace.to_plotly_json()
        for part in ("line", "marker"):
            color = spec.get(part, {}).get("color")
            found |= set(color) if isinstance(color, (list, tuple)) else {color} if color else set()
        if spec.get("fillcolor"):
            found.add(spec["fillcolor"])
        found |= {c for _, c in spec.get("colorscale", ())}
    return found


def test_every_chart_takes_its_colours_from_the_shared_palette():
    rows = _full_rows(50)
    rows[-1]["expert_counts"], rows[-1]["moe_layers"] = [[3, 1], [0, 4]], [0, 1]
    events = [{"kind": "compile", "t": 1.0, "enabled": True, "seconds": 2.0, "ok": True,
               "stats": {"decode_programs": {"build_seconds": {"1": 0.5}}, "compile_seconds": {"1": 2.0}}},
              {"kind": "compile", "t": 2.0, "enabled": True, "seconds": 0.0, "ok": False, "error": "x"}]
    figs = charts.all_figures(rows, events, {"num_blocks": 64, "owners": {"a": [0, 1]}, "cached_block_ids": [5]},
                              weights=INT4)
    allowed = {c.lower() for c in (*charts.PALETTE, charts.FREE_COLOR, charts.CACHED_COLOR, charts.SHARED_COLOR,
                                   "#FFFFFF")}
    for name, fig in figs.items():
        colors = {c.lower() for c in _colors(fig)}
        assert colors, f"{name} names its colours"
        assert colors <= allowed, f"{name} uses colours outside charts.PALETTE: {colors - allowed}"
    # the same quantity has the same colour in every chart
    kv_used = {t.line.color for f in (figs["memory"], figs["blocks"]) for t in f.data
               if t.name in ("KV in use", "used")}
    assert kv_used == {charts.COLORS["kv_used"]}


def test_weights_chart_shows_the_stored_size_beside_the_compute_dtype():
    """The weights chart: one bar at the stored size, one at the compute dtype's, and the saving in its title;
    a model kept in its dtype gets two equal bars and says it has no storage format."""
    fig = charts.all_figures([], weights=INT4)["weights"]
    _valid(fig)
    bars = fig.data[0]
    assert list(bars.y) == ["stored (int4 g64)", "in float32"] and list(bars.x) == [30.0, 120.0]
    assert list(bars.marker.color) == [charts.COLORS["weights"], charts.COLORS["weights_dense"]]
    assert fig.layout.title.text == "Weights stored as int4 g64: 75% less than float32 (MiB)"
    int8 = {**INT4, "format": "int8", "lm_head": True, "weights_bytes": 60 << 20}
    assert charts.weights_storage(int8).data[0].y[0] == "stored (int8 + LM head)"
    plain = charts.weights_storage({**INT4, "format": None, "weights_bytes": 120 << 20})
    assert list(plain.data[0].x) == [120.0, 120.0] and "no storage format" in plain.layout.title.text


def test_rows_count_from_the_model_load_and_go_with_an_unload(tiny_llama_path):
    s = Session(sample_interval=0.0)
    try:
        load = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 4 << 20, "max_model_len": 256}
        s.load_model("tiny-llama", **load)
        s.generate("Hello there", max_tokens=8, temperature=0.0)
        assert s.metrics.rows(model="tiny-llama")
        s.unload()
        assert s.metrics.rows(model="tiny-llama") == [], "an unload drops the model's history"
        before_reload = time.time()
        s.load_model("tiny-llama", **load)
        s.generate("Hello there", max_tokens=8, temperature=0.0)
        rows = s.metrics.rows(model="tiny-llama")
        assert rows and rows[0]["steps"] == 0, "the first row is the load's"
        # counted from the reload, not from the session's start (seconds before `before_reload`)
        assert all(0 <= r["t"] <= time.time() - before_reload for r in rows)
        assert s.block_map()["t"] <= time.time() - before_reload
    finally:
        s.close()


def test_a_live_chart_drops_the_empty_note_once_data_comes():
    from workbench.views.widgets import _update_figure

    widget = go.FigureWidget(charts.all_figures([])["memory"])
    # laid out as it will be: its time axis and titles, an empty range, the y values hidden
    assert widget.layout.annotations and widget.layout.xaxis.title.text == charts.TIME_AXIS
    assert widget.layout.yaxis.range == (0, 1) and widget.layout.yaxis.showticklabels is False
    _update_figure(widget, charts.memory_breakdown(_full_rows(30)))
    assert widget.layout.annotations == () and widget.layout.yaxis.showticklabels is not False
    assert widget.layout.yaxis.range is None
    assert widget.layout.title.text == "Memory of the model (MiB)" and len(widget.data) == 5


def _run(start: float, seconds: float, model: str = "m") -> list[dict]:
    """Rows of a run of `seconds` busy seconds from `start` (a row per 0.1 s)."""
    return [{**row, "t": start + row["t"] + 0.1, "model": model} for row in _full_rows(round(seconds * 10))]


def test_the_window_shows_the_last_minutes_or_the_last_run():
    load_row = {**_full_rows(1)[0], "t": 8e-5, "dt": 1e-9, "steps": 0}
    rows = [load_row, *_run(0.2, 3.0), *_run(70.0, 2.0)]  # a run, a minute idle, another run
    assert charts.window(rows, "minutes", 2.0) == rows
    assert [r["t"] for r in charts.window(rows, "minutes", 0.5)] == [r["t"] for r in rows[31:]]
    last = charts.window(rows, "run")
    assert last == rows[31:] and last[0]["t"] == pytest.approx(70.1), "after the idle minute only"
    # a run that starts without an idle gap (a workload fired right after another) starts at its event
    assert charts.window(rows, "run", events=[{"kind": "workload", "t": 71.0}]) == [r for r in rows if r["t"] >= 71.0]
    assert charts.window(rows, "run", events=[{"kind": "workload", "t": 80.0}]) == last, "no rows of it yet"
    assert charts.window(rows, "run", events=[{"kind": "error", "t": 71.0}]) == last, "an error starts no run"
    assert charts.window([], "run") == [] and charts.window([load_row], "run") == [load_row]
    with pytest.raises(ValueError, match="use one of minutes, run"):
        charts.window(rows, "forever")
    with pytest.raises(ValueError, match="positive number of minutes"):
        charts.window(rows, "minutes", 0)


def test_a_short_history_gets_a_time_axis_of_seconds_not_microseconds():
    load_row = {**_full_rows(1)[0], "t": 8e-5, "dt": 1e-9, "steps": 0}  # the only row after a load
    for name in ("memory", "blocks", "waste"):
        axis = charts.all_figures([load_row])[name].layout.xaxis
        assert list(axis.autorangeoptions.include) == [0.0, charts.MIN_SPAN_S], name
    axis = charts.throughput(_run(20.0, 0.3)).layout.xaxis  # a short run 20 s after the load
    assert list(axis.autorangeoptions.include) == pytest.approx([20.3 - charts.MIN_SPAN_S, 20.3])
    assert charts.throughput(_run(0.0, 30.0)).layout.xaxis.autorangeoptions.include is None, "a long run: autorange"


class _Session:
    """What ViewController.chart_figures reads of a Session: one model "m" loaded 10 s after the session began."""

    def __init__(self, rows, events=()):
        self.metrics = MetricsSeries()
        for row in rows:
            self.metrics.append(row)
        self.metrics._events.extend(events)
        self.active = "m"
        self.active_model = type("Entry", (), {"acc": type("Acc", (), {"t0": self.metrics.t0 + 10.0})(),
                                               "weights_storage": lambda self: None})()

    def block_map(self):
        return None


def test_the_views_draw_the_chosen_window_with_events_on_the_rows_clock():
    from workbench.views.controller import DEFAULT_WINDOW, ViewController

    rows = [*_run(0.0, 3.0), *_run(70.0, 2.0)]
    view = ViewController(_Session(rows, [{"kind": "load", "t": 10.0, "model": "m"},
                                          {"kind": "workload", "t": 81.0, "model": "m"},  # row clock: 71 s
                                          {"kind": "workload", "t": 85.0, "model": "other"}]))
    assert DEFAULT_WINDOW == "last 2 minutes"
    xs = [x for x in view.chart_figures()["throughput"].data[0].x if x is not None]
    assert min(xs) < 1 and max(xs) > 71, "two minutes: both runs"
    view.set_chart_window("last run")
    xs = [x for x in view.chart_figures()["throughput"].data[0].x if x is not None]
    assert min(xs) >= 71.0 and max(xs) == pytest.approx(72.0), "the last run: since the workload's event"
    with pytest.raises(ValueError, match="use one of last minute"):
        view.set_chart_window("all")
