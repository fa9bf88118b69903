"""The workbench's What-if: Session.whatif on a 70B config (points with their band, a layout that does not fit
skipped with its reason, the session's engine and models untouched, one at a time, cancel), the memory picture
(a layout over its device's memory marked, one that fits not), the Pareto chart of simulated points next to
measured ones, and the What-if tab of the ipywidgets view driven with .value and .click()."""

from __future__ import annotations

import html
import re
import threading

import pytest

from runner_core.simulator.backend import SimulatorBackend
from runner_core.tuning import Arrivals, Lengths, SweepSpace, Target, Workload
from workbench import Session, SessionBusyError
from workbench.views import whatif_charts as wc
from workbench.whatif.job import WhatifJob, memory_layouts

H100_TP8 = {"hardware": "h100-sxm", "tensor_parallel_size": 8}
L4 = {"hardware": "l4", "tensor_parallel_size": 1}
SMALL = Workload(num_requests=8, arrivals=Arrivals.fixed_concurrency(8), prompt_len=Lengths.fixed(256),
                 output_len=Lengths.fixed(32), seed=1)
TARGET = Target("tpot_p99_ms", 100.0)


@pytest.fixture
def session():
    s = Session()
    yield s
    s.close()


def test_session_whatif_on_a_70b_config(session):
    events = len(session.metrics.events())
    job = session.whatif("llama-3-70b", [H100_TP8, L4], SMALL, target=TARGET, space=SweepSpace(concurrency=[8]),
                         dtype="bfloat16")
    assert WhatifJob.latest(session) is job
    result = job.result(timeout=120)
    assert job.done and job.error is None and job.status.startswith("done")
    points = job.points
    assert points and all(p["settings"]["hardware"] == "h100-sxm" for p in points)
    for p in points:
        assert 0 < p["band_low"] <= p["median"]["output_throughput"] <= p["band_high"]
    assert 8 in {p["values"]["concurrency"] for p in points}
    [skipped] = job.skipped
    assert skipped["settings"] == L4 and skipped["why"].startswith("llama-3-70b does not fit")  # named as given
    assert [s["settings"] for s in result.skipped] == [L4] and len(job.rows) == len(result.rows) > 0
    # a simulation loads nothing into the session and sends nothing through its engine
    assert session.models == {} and len(session.metrics.events()) == events


def _hold_runs(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(started, release): each simulated run sets `started`, then waits for `release` (until the test has looked)."""
    started, release = threading.Event(), threading.Event()
    real_run = SimulatorBackend.run

    def run(self, workload, target):
        started.set()
        release.wait(30)
        return real_run(self, workload, target)

    monkeypatch.setattr(SimulatorBackend, "run", run)
    return started, release


def test_whatif_one_at_a_time_and_cancel(session, monkeypatch):
    started, release = _hold_runs(monkeypatch)
    job = session.whatif("llama-3-70b", [H100_TP8], SMALL, space=SweepSpace(concurrency=[1, 2, 4]))
    assert started.wait(60)
    with pytest.raises(SessionBusyError, match="what-if is already running"):
        session.whatif("llama-3-70b", [H100_TP8], SMALL)
    job.cancel()
    release.set()
    result = job.result(timeout=60)
    assert result.cancelled and job.status.startswith("cancelled") and len(result.rows) <= 1
    assert session.whatif("llama-3-70b", [H100_TP8], SMALL.replace(num_requests=2), band=False,
                          space=SweepSpace(concurrency=[1])).result(60).points


def test_the_session_keeps_its_jobs_and_cancels_a_running_one_at_close(monkeypatch):
    started, release = _hold_runs(monkeypatch)
    s = Session()
    job = s.whatif("llama-3-70b", [H100_TP8], SMALL, space=SweepSpace(concurrency=[1, 2, 4]))
    assert s.latest_job("what-if") is job and WhatifJob.latest(s) is job and s.latest_job("sweep") is None
    assert started.wait(60) and not job.done
    release.set()
    s.close()
    assert job.done and job.cancelled and job.status.startswith("cancelled") and s.closed


def test_bad_layouts_are_refused_with_the_fix(session):
    with pytest.raises(ValueError, match="layouts must be a non-empty list of dicts"):
        session.whatif("llama-3-70b", {"hardware": "h100-sxm"})
    with pytest.raises(ValueError, match="h100-sxm"):  # the unknown device's error lists the known ones
        memory_layouts("llama-3-70b", [{"hardware": "h100"}])
    with pytest.raises(ValueError, match="llama-3-70b"):  # an unknown model: the names there are
        session.whatif("llama-9-70b", [H100_TP8])


def test_memory_picture_marks_the_layout_that_does_not_fit():
    one, eight = memory_layouts("llama-3-70b", [{"hardware": "h100-sxm"}, H100_TP8], dtype="bfloat16")
    assert not one["fits"] and "tensor_parallel_size=" in one["why"]  # says which layout would fit
    assert eight["fits"] and eight["weights_bytes"] < one["weights_bytes"] / 7
    used = sum(eight[k] for k, _, _ in wc.MEMORY_PARTS)
    assert eight["kv_pool_bytes"] > 0 and used <= eight["usable_bytes"] < eight["device_memory_bytes"]
    fig = wc.memory_picture([one, eight])
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == [name for _, name, _ in wc.MEMORY_PARTS]
    assert list(bars[0].x) == ["h100-sxm", "h100-sxm tp=8"]
    [outline] = fig.layout.shapes  # only the layout over its line is outlined, in the warning colour
    assert outline.line.color == wc.WARNING and (outline.x0, outline.x1) == (-0.4, 0.4)
    notes = {a.x: a for a in fig.layout.annotations}
    assert notes["h100-sxm"].text.startswith("does not fit: needs ") and notes["h100-sxm"].font.color == wc.WARNING
    assert notes["h100-sxm tp=8"].text == "fits"
    assert sum(t.y[0] for t in bars) > one["usable_bytes"] / wc.GIB  # drawn over the usable line
    line = next(t for t in fig.data if t.name == "device memory")
    assert line.y[0] == pytest.approx(one["device_memory_bytes"] / wc.GIB)
    assert wc.memory_picture([]).layout.annotations[0].text == wc.MEMORY_NOTE


def _point(hardware: str | None, tp: int, c: int, throughput: float, per_user: float, band=None) -> dict:
    settings = {"concurrency": c, **({"hardware": hardware, "tensor_parallel_size": tp} if hardware else {})}
    median = {"output_throughput": throughput, "tokens_per_s_per_user": per_user, "tpot_p99_ms": 1e3 / per_user}
    point = {"key": f"{hardware}{tp}{c}", "label": str(settings), "settings": settings, "values": dict(settings),
             "median": median, "min": median, "max": median, "met": median["tpot_p99_ms"] <= TARGET.limit}
    if band:
        point["band_low"], point["band_high"] = band
    return point


def test_pareto_draws_simulated_points_with_their_band_beside_measured_ones():
    simulated = [_point("h200", 8, 8, 2000.0, 40.0, (1500.0, 2600.0)),
                 _point("h200", 8, 32, 5000.0, 25.0, (4000.0, 6000.0)), _point("l4", 4, 8, 300.0, 5.0, (200.0, 400.0))]
    measured = [_point(None, 1, 2, 200.0, 60.0)]
    fig = wc.pareto(simulated, measured, target=TARGET, measured_label="measured on EPYC")
    traces = {t.name: t for t in fig.data}
    assert list(traces) == ["simulated h200 x8", "simulated l4 x4", "measured on EPYC"]
    h200 = traces["simulated h200 x8"]
    assert list(h200.error_x.arrayminus) == [500.0, 1000.0] and list(h200.error_x.array) == [600.0, 1000.0]
    assert list(h200.marker.symbol) == ["diamond", "diamond"]
    assert list(traces["simulated l4 x4"].marker.symbol) == ["diamond-open"]  # misses the target: open
    measured_trace = traces["measured on EPYC"]
    assert list(measured_trace.marker.symbol) == ["circle"] and measured_trace.error_x.array is None
    assert "band: 1500 .. 2600 tok/s" in h200.hovertext[0]
    assert wc.pareto([], target=TARGET).layout.annotations[0].text == wc.EMPTY_NOTE


def test_widgets_whatif_tab_runs_a_whatif_and_shows_its_figures(tiny_llama_path):
    """A measured sweep of tiny-llama first: the What-if's Pareto chart draws its points beside the simulated ones."""
    from runner_core.simulator.calibrate import cpu_model_name
    from workbench.views.widgets import SessionWidgets

    s = Session()
    w = SessionWidgets(s, auto_refresh=False)
    try:
        s.load_model("tiny-llama", dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
        s.tune(SweepSpace(concurrency=[1]), SMALL.replace(num_requests=2, prompt_len=Lengths.fixed(16)), repeats=1,
               warmup=0).result(60)
        w.refresh()
        assert w.tabs.titles[-1] == "What-if" and w.whatif_model.options[:2] == ("tiny-llama", "llama-3-70b")
        w.whatif_model.value, w.whatif_hardware.value = "llama-3-70b", "h100-sxm"
        w.whatif_tp.value, w.whatif_pp.value, w.whatif_requests.value = "1, 8", "1", 1  # one point: concurrency 1
        w.whatif_memory_button.click()
        w.refresh()
        memory = w.whatif_figures["memory"]
        assert [t.name for t in memory.data if t.type == "bar"][0] == "weights"
        assert [a.text.split(":")[0] for a in memory.layout.annotations] == ["does not fit", "fits"]

        w.whatif_tp.value = "two"
        w.whatif_start.click()
        assert html.escape("TP sizes: 'two' is not a whole number") in w.error.value and w.whatif_job is None
        w.whatif_tp.value = "8"
        w.whatif_start.click()
        assert w.error.value == "" and w.whatif_job is not None
        w.whatif_job.result(timeout=120)
        w.refresh()
        assert w.whatif_progress.value == 100 and "done" in w.whatif_status.value
        pareto = w.whatif_figures["pareto"]
        assert [t.name for t in pareto.data] == ["simulated h100-sxm x8", f"measured: tiny-llama on {cpu_model_name()}"]
        assert len(pareto.data[0].x) >= 1 and len(pareto.data[1].x) == 1
        assert w.whatif_figures["latency"].data
    finally:
        w.close()
        s.close()


def test_both_views_make_every_form_alike_and_a_served_one_checks_bounds_and_roots(session, tiny_llama_path, tmp_path):
    """Every form is one definition (workbench.views.forms): the Panel and ipywidgets views have each of its controls,
    with the same label, default and bounds; what a browser sends past a bound is refused by name, and a served
    dashboard simulates a model directory only inside its model roots (a notebook's own dashboard, any)."""
    import shutil

    from workbench import SessionDashboard, SessionWidgets
    from workbench.runtime.model_roots import ModelRoots
    from workbench.views import forms
    from workbench.views.fields import Field

    panel_view, widgets_view = SessionDashboard(session), SessionWidgets(session, auto_refresh=False)
    every = [c for form in (forms.LOAD_FORM, forms.COMPILE_FORM, forms.SPEC_FORM, forms.GENERATE_FORM,
                            forms.WORKLOAD_FORM, [[forms.WINDOW_FIELD]], forms.TUNE_FORM, forms.WHATIF_FORM)
             for row in form for c in row]
    for control in every:  # each view has every control, labelled and set alike
        p, w = getattr(panel_view, control.attr), getattr(widgets_view, control.attr)
        assert (p.label if isinstance(control, Field) else p.name) == w.description == control.label
        if isinstance(control, Field) and control.attr != "device":
            assert p.value == w.value == control.default, control.attr
            if control.kind in ("int", "float") and control.low is not None and control.high is not None:
                assert (p.start, p.end) == (w.min, w.max) == (control.low, control.high), control.attr
    assert panel_view.whatif_requests.end == 100_000 and panel_view.tune_requests.end == 4096

    served = SessionDashboard(session, model_roots=ModelRoots())
    assert served.start_whatif("llama-3-70b", "h100-sxm", "8", "1", "none", 100_001) is None
    assert "requests per run 100001: must be from 1 to 100000" in served.error.object
    outside = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama_path, outside)
    assert served.draw_memory(str(outside), "h100-sxm", "1", "1", "none") is None
    assert "is outside the folders this dashboard loads models from" in html.unescape(served.error.object)
    assert panel_view.draw_memory(str(outside), "h100-sxm", "1", "1", "none")  # the notebook's own: any path


def test_a_forms_field_refuses_what_a_view_sends_past_it_naming_the_field_and_its_bounds():
    from workbench.views.forms import TUNE_FIELDS, WHATIF_FIELDS

    requests, limit, metric = TUNE_FIELDS["requests"], TUNE_FIELDS["limit"], TUNE_FIELDS["metric"]
    assert requests.check("12") == 12 and limit.check(2) == 2.0 and metric.check("ttft_p99_ms") == "ttft_p99_ms"
    for field, value, message in ((requests, "many", "requests per run 'many': give a number from 1 to 4096"),
                                  (requests, 2.5, "requests per run 2.5: give a whole number from 1 to 4096"),
                                  (requests, 4097, "requests per run 4097: must be from 1 to 4096"),
                                  (limit, -1, "limit (ms) -1: must be of at least 0"),
                                  (WHATIF_FIELDS["hardware"], "abacus",
                                   "hardware 'abacus': choose one of a100-sxm-80g, h100-sxm")):
        with pytest.raises(ValueError, match=re.escape(message)):
            field.check(value)
