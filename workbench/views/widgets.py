"""ipywidgets controls with live plotly FigureWidgets (through anywidget) for a notebook cell:
a thin view over a `Session`, like the Panel dashboard but compact.

    w = SessionWidgets(session)      # display it: the last expression of a cell
    w.prompt.value = "Hello"; w.generate_button.click(); w.wait(); w.output.value

Refreshing runs as a task on the kernel's event loop (between cell executions), or on a
daemon thread outside a kernel; `refresh()` can also be called directly.
"""

from __future__ import annotations

import asyncio
import html
import threading
import weakref

import ipywidgets as W
import plotly.graph_objects as go

from runner_core.models import preset_names
from runner_core.tuning import Target
from workbench.session import Session
from workbench.views import charts, tuning_charts, whatif_view
from workbench.views.controller import ViewController, default_device
from workbench.views.fields import widgets_form
from workbench.views.forms import COMPILE_FORM, GENERATE_FORM, LOAD_FORM, TUNE_FORM, WINDOW_FIELD, WORKLOAD_FORM

FIGURES = ("throughput", "memory", "weights", "blocks", "block_map", "expert_load")
# the charts two by two, each column half of the cell's width (plotly autosizes into it)
GRID = dict(grid_template_columns="repeat(2, minmax(0, 1fr))", grid_gap="4px 12px", width="100%")


class SessionWidgets(ViewController, whatif_view.WhatifControls, W.VBox):
    """Load/unload, compile mode, prompt and sampling, workload, status and live charts."""

    def __init__(self, session: Session | None = None, *, auto_refresh: bool = True, interval: float = 0.5,
                 figures: tuple[str, ...] = FIGURES):
        ViewController.__init__(self, session)
        self.interval = interval
        self._chart_version = -1
        self._closed = False
        layout = W.Layout(width="auto")
        device_options = ["cpu"] + (["cuda"] if default_device() == "cuda" else [])
        load_rows = widgets_form(self, LOAD_FORM, {"model_select": preset_names(), "device": device_options,
                                                   "active_select": []})
        self.device.value = default_device()
        compile_rows = widgets_form(self, COMPILE_FORM)
        generate_rows = widgets_form(self, GENERATE_FORM)
        [workload] = widgets_form(self, WORKLOAD_FORM)
        [window] = widgets_form(self, [[WINDOW_FIELD]])
        self.output = W.Textarea(value="", disabled=True, layout=W.Layout(width="98%", height="6em"))
        self.image_upload = W.FileUpload(accept="image/*", multiple=False, description="image")
        self.image_view = W.Image(format="png", layout=W.Layout(display="none"))
        self.stats = W.HTML("")
        self.status = W.HTML("")
        self.error = W.HTML("")
        empty = charts.all_figures([])
        self.figures = {name: go.FigureWidget(empty[name]) for name in figures}
        tuning = self._build_tuning()
        whatif = whatif_view.widgets_tab(self, GRID)

        self.wire_buttons()
        self.active_select.observe(lambda change: self.on_active(change["new"]), names="value")
        self.image_upload.observe(lambda change: self.on_image(change["new"]), names="value")
        self.window_select.observe(lambda change: self.on_chart_window(change["new"]), names="value")

        prompt, sampling, buttons = generate_rows
        buttons.children = (*buttons.children, self.image_upload)
        controls = W.VBox([*load_rows, *compile_rows])
        generation = W.VBox([prompt, sampling, buttons, W.HBox([self.output, self.image_view]), self.stats, workload])
        grid = W.GridBox(list(self.figures.values()), layout=W.Layout(**GRID))
        self.tabs = W.Tab(children=[W.VBox([controls, generation, window, grid]), tuning, whatif],
                          titles=("Live", "Tuning", "What-if"))
        W.VBox.__init__(self, [self.status, self.error, self.tabs], layout=layout)
        self.refresh()
        if auto_refresh:
            self._start_auto_refresh()

    def _build_tuning(self) -> W.VBox:
        """The Tuning tab: the sweep's form, Start / Cancel, its progress and the three charts."""
        self.tune_progress = W.IntProgress(value=0, min=0, max=100)
        self.tune_status = W.HTML("")
        self.tune_recommendation = W.HTML("")
        self.tune_figures = {name: go.FigureWidget(fig)
                             for name, fig in tuning_charts.all_figures([], Target()).items()}
        *form, buttons = widgets_form(self, TUNE_FORM)
        buttons.children = (*buttons.children, self.tune_progress)
        return W.VBox([*form, buttons, self.tune_status,
                       self.tune_recommendation, W.GridBox(list(self.tune_figures.values()), layout=W.Layout(**GRID))])

    # ---- messages -----------------------------------------------------------------------------
    def show_error(self, message: str) -> None:
        self.error.value = f'<div style="color:#b00020"><b>Error:</b> {html.escape(message)}</div>'

    def show_info(self, message: str) -> None:
        self.error.value = f'<div style="color:#555">{html.escape(message)}</div>'

    def clear_messages(self) -> None:
        self.error.value = ""

    # ---- actions ----------------------------------------------------------------------------------
    def on_image(self, uploads) -> None:
        """FileUpload's value: a tuple of {"content": memoryview, "name", "type", ...} (the first is used)."""
        self.set_image(bytes(uploads[0]["content"]) if uploads else None)
        preview = self.image_preview()
        self.image_view.value = preview or b""
        self.image_view.layout.display = None if preview else "none"

    def show_generating(self) -> None:
        self.output.value = ""

    # ---- refresh --------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Copy the session's state into the widgets and charts."""
        s = self.session
        entry = s.models.get(s.active) if s.active else None
        lines = entry.engine_lines() if entry is not None else []
        self.status.value = f"<b>{html.escape(s.status)}</b>" + "".join(f" · {html.escape(line)}" for line in lines)
        self.finished_jobs()
        self.sync_active(self.active_select)
        if self.handle is not None:
            self.output.value, self.stats.value = self.answer_view()
        self._refresh_tuning()
        self._refresh_whatif()
        if s.metrics.version != self._chart_version:
            self._chart_version = s.metrics.version
            new = self.chart_figures()
            for name, widget in self.figures.items():
                _update_figure(widget, new[name])

    def _refresh_tuning(self) -> None:
        status, figures, recommendation = self.refresh_tuning()
        self.tune_status.value = html.escape(status)
        self.tune_recommendation.value = html.escape(recommendation.replace("**", ""))
        for name, fig in (figures or {}).items():
            _update_figure(self.tune_figures[name], fig)

    def _refresh_whatif(self) -> None:
        status, figures = self.refresh_whatif()
        self.whatif_status.value = html.escape(status)
        for name, fig in (figures or {}).items():
            _update_figure(self.whatif_figures[name], fig)

    def wait(self, timeout: float = 120.0) -> SessionWidgets:
        """Wait for pending loads/unloads/compiles and running requests, then refresh."""
        for _, fut in list(self.jobs):
            try:
                fut.result(timeout)
            except Exception:
                pass  # shown by refresh()
        self.session.wait_idle(timeout)
        self.refresh()
        return self

    def _start_auto_refresh(self) -> None:
        ref = weakref.ref(self)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:  # a kernel: refresh between cell executions, on the kernel's loop
            async def tick():
                while (w := ref()) is not None and not w._closed:
                    w._safe_refresh()
                    interval = w.interval
                    del w
                    await asyncio.sleep(interval)

            self._task = loop.create_task(tick())
        else:
            def run():
                while (w := ref()) is not None and not w._closed:
                    w._safe_refresh()
                    interval = w.interval
                    del w
                    threading.Event().wait(interval)

            threading.Thread(target=run, name="workbench-widgets", daemon=True).start()

    def _safe_refresh(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # keep refreshing
            self.show_error(f"refresh failed: {exc}")

    def close(self) -> None:
        self._closed = True
        super().close()


def _update_figure(widget: go.FigureWidget, fig: go.Figure) -> None:
    """Make `widget` show `fig`, updating traces in place when their number and types match."""
    same = len(widget.data) == len(fig.data) and all(a.type == b.type for a, b in zip(widget.data, fig.data))
    if not same:
        widget.data = []
        widget.add_traces(list(fig.data))
    with widget.batch_update():
        if same:
            for old, new in zip(widget.data, fig.data):
                props = new.to_plotly_json()
                props.pop("type", None)
                old.update(props, overwrite=True)
        layout = fig.layout.to_plotly_json()
        layout.pop("template", None)  # the same in every figure, and large
        layout.setdefault("annotations", [])  # an empty chart's note goes once data came
        widget.layout.update(layout, overwrite=True)  # titles, notes, axes
