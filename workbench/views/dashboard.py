"""`Dashboard`: what both views are beyond their toolkit. It builds workbench.views.layout's tabs with the view's
toolkit (Panel's in panel_app, ipywidgets' in widgets) and refreshes them: one `view_state` computes every text
and chart from the session and the controller (workbench.views.controller, whatif_view), and the toolkit sets them
(`set_text`, `set_figure`, within its `hold`). A view supplies the toolkit, its messages (`show_error`,
`show_info`, `clear_messages`), `on_image` and how its refresh is scheduled.
"""

from __future__ import annotations

import html
import logging
from time import monotonic

from runner_core.models import preset_names
from workbench.runtime import workload
from workbench.runtime.loaded_models import ModelEntry
from workbench.runtime.model_roots import ModelRoots
from workbench.session import Session
from workbench.views import layout
from workbench.views.controller import ViewController, default_device
from workbench.views.spec_view import SpecControls
from workbench.views.step_view import StepControls
from workbench.views.whatif_view import WhatifControls

logger = logging.getLogger("workbench")


class Dashboard(ViewController, WhatifControls, StepControls, SpecControls):
    """The layout and its refresh over `session`, made with `toolkit` (see workbench.views.panel_app.PanelToolkit
    for what a toolkit does); `live_charts`: the Live tab's charts shown (layout.CHART_NAMES: all)."""

    def __init__(self, session: Session | None, model_roots: ModelRoots | None, toolkit,
                 live_charts: tuple[str, ...] = layout.CHART_NAMES):
        ViewController.__init__(self, session, model_roots)
        self.toolkit = toolkit
        self.charts, self.tune_charts, self.whatif_charts = {}, {}, {}  # name -> the toolkit's chart
        self.text_slots: dict[str, layout.Text] = {}
        self._chart_version = -1  # the metrics' version and active model the live charts show
        self._chart_model = None
        self._status = ("", monotonic())  # the session's status line and since when it reads so
        device_options = ["cpu"] + (["cuda"] if default_device() == "cuda" else [])
        options = {"model_select": preset_names(), "device": device_options, "active_select": [],
                   "whatif_model": self.whatif_models()}
        self.root = layout.build(toolkit, self, layout.DASHBOARD, options, live_charts)
        self.device.value = default_device()
        self.wire_buttons()
        self.wire_whatif()
        self.wire_steps()
        self.wire_spec()
        toolkit.on_change(self.active_select, self.on_active)
        toolkit.on_change(self.image_input, self.on_image)
        toolkit.on_change(self.window_select, self.on_chart_window)

    def show_generating(self) -> None:
        self.set_texts({"answer": "", "answer_stats": "<i>generating…</i>"})

    def redraw_charts(self) -> None:
        """Redraw the live charts now (a control they depend on changed)."""
        self._chart_version = -1
        self.refresh()

    def set_texts(self, texts: dict[str, str]) -> None:
        for attr, value in texts.items():
            self.toolkit.set_text(getattr(self, attr), self.text_slots[attr], value)

    # ---- the refresh ------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Copy the session's state into the texts; redraw the charts whose data changed. Never raises (a view
        bug must not stop the periodic refresh): the error is shown."""
        try:
            with self.toolkit.hold():  # one batched update per refresh
                texts, figures = self.view_state()
                self.set_texts(texts)
                for group, drawn in figures.items():
                    shown = getattr(self, group)
                    for name, fig in (drawn or {}).items():
                        if name in shown:
                            self.toolkit.set_figure(shown[name], fig)
                self.toolkit.set_busy(self.spinner, self.session.busy)
                self.refreshed()
        except Exception as exc:
            logger.exception("dashboard refresh failed")
            self.show_error(f"dashboard refresh failed: {exc}")

    def refreshed(self) -> None:
        """After each refresh, within the toolkit's hold (Panel: the charts stop saying they are coming)."""

    def view_state(self) -> tuple[dict[str, str], dict[str, dict | None]]:
        """(each text slot's new value by attr, each chart group's new figures by name or None when unchanged);
        finished background jobs become messages on the way."""
        s = self.session
        for label, exc, result in self.finished_jobs():
            if exc is None:
                self.show_info(f"{label}: done" + describe(result))
        self.sync_active(self.active_select)
        texts = {"status": f"<b>{html.escape(self.status_line())}</b>", "models_text": models_html(s.models)}
        if self.handle is not None:
            texts["answer"], stats = self.answer_view()
            texts["answer_stats"] = html.escape(stats)
        plan = {**workload.DEMO, "n": self.workload_n.value or workload.DEMO["n"]}
        texts["workload_plan"] = html.escape(workload.describe(**plan))
        if self.workload:
            texts["workload_status"] = html.escape(self.workload_summary())
        tune_status, tune_figures, recommendation = self.refresh_tuning()
        whatif_status, whatif_figures = self.refresh_whatif()
        texts.update(tune_status=html.escape(tune_status), tune_recommendation=markdown_bold(recommendation),
                     whatif_status=html.escape(whatif_status))
        live = None
        if s.metrics.version != self._chart_version or s.active != self._chart_model:
            self._chart_version, self._chart_model = s.metrics.version, s.active
            live = {**self.chart_figures(), **self.step_figures()}
        return texts, {"charts": live, "tune_charts": tune_figures, "whatif_charts": whatif_figures}

    def status_line(self) -> str:
        """The session's status; while it is busy on one thing (loading, compiling), for how long."""
        s = self.session
        status, since = self._status
        if s.status != status:
            status, since = self._status = (s.status, monotonic())
        elapsed = monotonic() - since
        return f"{status} ({elapsed:.0f} s)" if s.busy and elapsed >= 1 else status


def models_html(models: dict[str, ModelEntry]) -> str:
    """The loaded models, one item each: weights, KV pool, compile mode and the engine's lines (CPU kernels...)."""
    items = [f"<li><b>{html.escape(e.name)}</b> ({e.status}): weights {e.weights_bytes / 2**20:.1f} MiB"
             f"{' ' + e.config.quantization if e.config.quantization else ''}, "
             f"KV {e.kv_pool_bytes / 2**20:.1f} MiB, "
             f"{'compiled ' + html.escape(str(e.compile.get('backend'))) if e.compile.get('enabled') else 'eager'}"
             + "".join(f"<br>{html.escape(line)}" for line in e.engine_lines()) + "</li>"
             for e in models.values()]
    return f"<ul>{''.join(items)}</ul>" if items else "<i>no model loaded</i>"


def markdown_bold(text: str) -> str:
    """`text` escaped, its **bold** parts (tuning_charts' recommendation) in <b>."""
    parts = html.escape(text).split("**")
    return "".join(f"<b>{part}</b>" if i % 2 else part for i, part in enumerate(parts))


def describe(result) -> str:
    """What a finished background job did, for its message."""
    if isinstance(result, dict) and "freed_bytes" in result:
        return f" ({result['name']} unloaded, {result['freed_bytes'] / 2**20:.1f} MiB freed)"
    if isinstance(result, dict) and "enabled" in result:
        if not result["enabled"]:
            return f" (eager{': ' + str(result['reason']) if result.get('reason') else ''})"
        return (f" ({result.get('backend')}/{result.get('mode')}, scope {result.get('scope')}, "
                f"cache {result.get('cache')})")
    if isinstance(result, ModelEntry) and result.load_seconds is not None:
        return f" ({result.name} in {result.load_seconds:.1f} s)"
    return ""
