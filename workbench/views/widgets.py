"""ipywidgets controls with live plotly FigureWidgets (through anywidget) for a notebook cell: workbench.views.layout's
tabs made with ipywidgets (`WidgetsToolkit`) over a `Session`, refreshed by workbench.views.dashboard, as the Panel
dashboard is.

    w = SessionWidgets(session)      # display it: the last expression of a cell
    w.prompt.value = "Hello"; w.generate_button.click(); w.wait(); w.answer.value

Refreshing runs as a task on the kernel's event loop (between cell executions), or on a
daemon thread outside a kernel; `refresh()` can also be called directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import threading
import weakref

import ipywidgets as W
import plotly.graph_objects as go

from workbench.session import Session
from workbench.views import charts
from workbench.views.dashboard import Dashboard
from workbench.views.fields import widgets_control

FIGURES = ("throughput", "blocks", "block_map", "batch", "spec_decoding", "memory", "weights", "expert_load")
# the charts two by two, each column half of the cell's width (plotly autosizes into it)
GRID = dict(grid_template_columns="repeat(2, minmax(0, 1fr))", grid_gap="4px 12px", width="100%")


class WidgetsToolkit:
    """workbench.views.layout's slots in ipywidgets (what panel_app.PanelToolkit does in Panel); the Live tab's
    controls above its generation, not beside it."""

    control = staticmethod(widgets_control)

    def text(self, slot):
        if slot.pre:
            return W.Textarea(value="", disabled=True, layout=W.Layout(width="98%", height="6em"))
        return _classed(W.HTML(""), slot.css)

    def set_text(self, widget, slot, value: str) -> None:
        if widget.value != value:
            widget.value = value

    def chart(self, slot):
        return go.FigureWidget(layout={"template": charts.TEMPLATE, "height": charts.HEIGHT})

    def set_figure(self, widget, fig) -> None:
        _update_figure(widget, fig)

    def note(self, text: str):
        return W.HTML(text)

    def element(self, element):
        if element.kind == "progress":
            return W.IntProgress(value=0, min=0, max=100)
        if element.kind == "image_input":
            return W.FileUpload(accept="image/*", multiple=False, description="image")
        if element.kind == "image_view":
            return W.Image(format="png", layout=W.Layout(display="none"))
        if element.kind == "divider":
            return W.HTML("<hr>")
        return _classed(W.HTML(""), element.css)  # the spinner, the messages

    def box(self, box, children: list):
        if box.kind == "tabs":
            return W.Tab(children=children, titles=box.titles)
        if box.kind == "grid":
            return W.GridBox(children, layout=W.Layout(**GRID))
        return (W.HBox if box.kind == "row" else W.VBox)(children)

    def set_busy(self, spinner, busy: bool) -> None:
        self.set_text(spinner, None, "<i>busy…</i>" if busy else "")

    def set_end(self, slider, end: int) -> None:
        end = max(end, slider.min + 1)
        if slider.max != end:
            slider.max = end  # ipywidgets keeps the value within it

    def on_change(self, widget, callback) -> None:
        widget.observe(lambda change: callback(change["new"]), names="value")

    def hold(self):
        return contextlib.nullcontext()


class SessionWidgets(Dashboard, W.VBox):
    """Load/unload, compile mode, prompt and sampling, workload, status and live charts; the Tuning and What-if
    tabs. `figures`: the Live tab's charts shown (workbench.views.layout.CHART_NAMES)."""

    def __init__(self, session: Session | None = None, *, auto_refresh: bool = True, interval: float = 0.5,
                 figures: tuple[str, ...] = FIGURES):
        Dashboard.__init__(self, session, None, WidgetsToolkit(), live_charts=figures)
        self.interval = interval
        self._closed = False
        W.VBox.__init__(self, [self.root], layout=W.Layout(width="auto"))
        self.refresh()
        if auto_refresh:
            self._start_auto_refresh()

    # ---- messages -----------------------------------------------------------------------------
    def show_error(self, message: str) -> None:
        self.info.value = ""
        self.error.value = f'<div style="color:#b00020"><b>Error:</b> {html.escape(message)}</div>'

    def show_info(self, message: str) -> None:
        self.info.value = f'<div style="color:#555">{html.escape(message)}</div>'

    def clear_messages(self) -> None:
        self.error.value = self.info.value = ""

    def on_image(self, uploads) -> None:
        """FileUpload's value: a tuple of {"content": memoryview, "name", "type", ...} (the first is used)."""
        self.set_image(bytes(uploads[0]["content"]) if uploads else None)
        preview = self.image_preview()
        self.image_view.value = preview or b""
        self.image_view.layout.display = None if preview else "none"

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
                    w.refresh()
                    interval = w.interval
                    del w
                    await asyncio.sleep(interval)

            self._task = loop.create_task(tick())
        else:
            def run():
                while (w := ref()) is not None and not w._closed:
                    w.refresh()
                    interval = w.interval
                    del w
                    threading.Event().wait(interval)

            threading.Thread(target=run, name="workbench-widgets", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        super().close()

    # ---- the names this view had before both views were one layout ------------------------------------------
    output = property(lambda self: self.answer, doc="the answer (`answer`)")
    stats = property(lambda self: self.answer_stats, doc="the answer's statistics (`answer_stats`)")
    figures = property(lambda self: self.charts, doc="the Live tab's charts (`charts`)")
    tune_figures = property(lambda self: self.tune_charts, doc="the Tuning tab's charts (`tune_charts`)")
    whatif_figures = property(lambda self: self.whatif_charts, doc="the What-if tab's charts (`whatif_charts`)")


def _classed(widget: W.DOMWidget, css: str) -> W.DOMWidget:
    """`widget` with the css class `css` (the one the Panel dashboard's element has), if any."""
    if css:
        widget.add_class(css)
    return widget


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
