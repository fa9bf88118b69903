"""SessionWidgets(session): drive the ipywidgets controls with .value and .click() and check the session."""

from __future__ import annotations

import html

import plotly.graph_objects as go
import pytest

import workbench
from runner_core.kernels import kernel_tier, use_kernel_tier
from workbench import Session
from workbench.views.step_view import STEP_POINTS
from workbench.views.timeline import last_run, thin
from workbench.views.widgets import SessionWidgets


@pytest.fixture(scope="module")
def ui(tiny_llama_path):
    s = Session()
    w = SessionWidgets(s, auto_refresh=False)
    yield w
    w.close()
    s.close()


def test_widgets_drive_the_session(ui):
    s = ui.session
    assert workbench.SessionWidgets is SessionWidgets  # what the notebook imports
    assert all(isinstance(f, go.FigureWidget) for f in ui.figures.values())

    ui.generate_button.click()  # nothing loaded yet: a message, not an exception
    assert "no model is loaded" in ui.error.value

    ui.model_select.value = "tiny-llama"
    ui.load_button.click()
    ui.load_button.click()  # pressing load twice
    assert "still loading" in ui.error.value
    ui.wait(120)
    assert list(s.models) == ["tiny-llama"] and s.active == "tiny-llama"
    assert ui.active_select.options == ("tiny-llama",) and ui.active_select.value == "tiny-llama"
    assert "idle" in ui.status.value
    assert f"CPU kernels: {kernel_tier()} (" in ui.models_text.value

    ui.max_tokens.value = 0
    ui.generate_button.click()
    assert "max_tokens got 0" in ui.error.value and not s.inflight()

    ui.prompt.value = "Once upon a time"
    ui.max_tokens.value = 16
    ui.temperature.value = 0.0
    ui.generate_button.click()
    assert ui.error.value == ""
    ui.wait(60)
    expected = s.generate("Once upon a time", max_tokens=16, temperature=0.0, timeout=60)
    assert ui.output.value == expected.text and "finished" in ui.stats.value

    points_before = len(ui.figures["throughput"].data[0].x or ())
    ui.workload_n.value = 6
    ui.workload_button.click()
    assert len(ui.workload) == 6
    ui.wait(120)
    assert all(h.done for h in ui.workload)
    # the last run drawn by engine step ("auto"): one bar per step the session recorded (per k past STEP_POINTS)
    points, _ = thin(last_run(s.steps()[0]), STEP_POINTS)
    run = [r["step"] for r in points]
    assert list(ui.figures["throughput"].data[0].x) == run and len(run) > points_before
    ui.axis_select.value = "wall clock"  # the session's time series: prompt and generated tokens/s
    throughput = ui.figures["throughput"]
    assert len(throughput.data) == 2 and [t.name for t in throughput.data][1].startswith("generated")
    ui.axis_select.value = "auto"
    assert len(ui.figures["memory"].data) >= 4 and ui.figures["block_map"].data[0].type == "heatmap"

    ui.model_path.value = "/nonexistent/model/dir"
    ui.load_button.click()
    ui.wait(30)
    assert "(no such directory)" in ui.error.value and list(s.models) == ["tiny-llama"]
    ui.model_path.value = ""

    ui.unload_button.click()
    ui.wait(30)
    assert s.models == {} and ui.active_select.options == () and "no model loaded" in ui.status.value


def test_both_dashboards_show_the_kernel_tier_the_model_runs_on(ui, tiny_llama_path):
    """A model loaded on a lower tier than this CPU's highest: both dashboards name that tier and why."""
    from workbench.views.panel_app import SessionDashboard

    with use_kernel_tier("plain"):
        ui.session.load_model(str(tiny_llama_path), name="on-plain", kv_cache_memory=4 << 20)
    try:
        ui.refresh()
        panel = SessionDashboard(ui.session)
        panel.refresh()
        line = html.escape("CPU kernels: plain (set_kernel_tier('plain'))")
        assert line in ui.models_text.value and line in panel.models_text.object
    finally:
        ui.session.unload("on-plain")


def test_an_uploaded_image_goes_with_the_prompt(tmp_path):
    """The upload box: an image file reaches a multimodal model with the prompt (its placeholder first),
    the preview shows it, a file that is not an image is refused with a message, and the same image
    and prompt through the session give the same tokens."""
    import io

    from tests.helpers import make_tiny_llava, random_image

    path = make_tiny_llava(tmp_path)
    s = Session()
    w = SessionWidgets(s, auto_refresh=False)
    try:
        s.load_model(str(path), dtype="float32", kv_cache_memory=4 << 20)
        png = io.BytesIO()
        random_image(5).save(png, format="PNG")
        w.on_image(({"name": "x.png", "type": "image/png", "content": memoryview(b"not a picture")},))
        assert "Image: the uploaded file is not an image that can be read" in w.error.value and w.image is None
        w.on_image(({"name": "x.png", "type": "image/png", "content": memoryview(png.getvalue())},))
        assert w.error.value == "" and bytes(w.image_view.value).startswith(b"\x89PNG")
        w.prompt.value, w.max_tokens.value, w.temperature.value = "what is this?", 8, 0.0
        w.generate_button.click()
        w.wait(60)
        expected = s.generate({"prompt": "<image>\nwhat is this?", "multi_modal_data": {"image": random_image(5)}},
                              max_tokens=8, temperature=0.0, timeout=60)
        assert w.handle.output.token_ids == expected.token_ids and len(expected.token_ids) == 8
        from workbench.views.panel_app import SessionDashboard

        dashboard = SessionDashboard(s)  # the Panel view shows the same preview beside its answer
        dashboard.on_image(png.getvalue())
        assert dashboard.image_view.object.startswith('<img alt="the uploaded image" src="data:image/png;base64,')
    finally:
        w.close()
        s.close()


def test_both_load_forms_pass_the_storage_format_and_chart_what_it_saved(ui):
    """The storage controls (format, int4 group, LM head) of both views reach the session's load, and the
    weights chart then shows the stored bytes beside the compute dtype's (model_info's "quantization")."""
    from workbench.views.panel_app import SessionDashboard

    s = ui.session
    ui.model_select.value, ui.model_path.value = "tiny-llama", ""
    ui.storage.value, ui.group_size.value, ui.quantize_lm_head.value = "int4", 32, True
    ui.load_button.click()
    ui.wait(120)
    try:
        config = s.models["tiny-llama"].config
        assert (config.quantization, config.quantization_group_size, config.quantize_lm_head) == ("int4", 32, True)
        info = s.models["tiny-llama"].runner.model_info()["quantization"]
        bars = ui.figures["weights"].data[0]
        assert list(bars.x) == [info["weights_bytes"] / 2**20, info["dense_bytes"] / 2**20]
        assert info["weights_bytes"] < info["dense_bytes"] / 3
        assert list(bars.y) == ["stored (int4 g32 + LM head)", "in float32"]
    finally:
        s.unload("tiny-llama")
    panel = SessionDashboard(s)
    panel.model_select.value, panel.storage.value = "tiny-llama", "int8"
    panel.load_button.clicks += 1
    ui.wait(120)
    try:
        config = s.models["tiny-llama"].config
        assert (config.quantization, config.quantize_lm_head) == ("int8", False)
        panel.refresh()
        assert list(panel.charts["weights"].object.data[0].y) == ["stored (int8)", "in float32"]
        assert "int8" in panel.models_text.object
    finally:
        s.unload("tiny-llama")
