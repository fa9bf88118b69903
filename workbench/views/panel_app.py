"""The Panel dashboard: a thin view over a `Session` (load/unload, compile mode, generation,
a workload button, live charts). `python -m workbench serve` serves it;
`SessionDashboard(session).inline()` shows it in JupyterLab. Every action calls a Session
method; nothing here touches a runner.
"""

from __future__ import annotations

import base64
import html
import logging
import secrets
import socket
from time import monotonic

import panel as pn

from runner_core.models import preset_names
from runner_core.tuning import Target
from workbench.runtime.handles import SessionError
from workbench.runtime.loaded_models import ModelEntry
from workbench.runtime.model_roots import ModelRoots
from workbench.session import Session
from workbench.views import charts, tuning_charts, whatif_view
from workbench.views.controller import ViewController, default_device
from workbench.views.fields import panel_form
from workbench.views.forms import COMPILE_FORM, GENERATE_FORM, LOAD_FORM, TUNE_FORM, WINDOW_FIELD, WORKLOAD_FORM
from workbench.views.notebook_output import FieldsKeepEnter, load_extension_once_shown
from workbench.views.panel_writer import write_queued_patches

logger = logging.getLogger("workbench")

REFRESH_MS = 500
SIDEBAR_WIDTH = 300
CHART_NAMES = ("throughput", "memory", "weights", "blocks", "waste", "block_map", "compile", "expert_load")


class SessionDashboard(ViewController, whatif_view.WhatifControls):
    """One dashboard per browser session (or notebook cell) over a shared Session."""

    def __init__(self, session: Session | None = None, refresh_ms: int = REFRESH_MS,
                 model_roots: ModelRoots | None = None):
        super().__init__(session, model_roots)
        self.refresh_ms = refresh_ms
        self._chart_version = -1
        self._chart_model = None
        self._status = ("", monotonic())  # the session's status line and since when it reads so
        self._build()
        self.refresh()
        # until the browser runs the first periodic refresh, the charts say they are still coming
        for pane in self.charts.values():
            pane.loading = True

    # ---- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        w = pn.widgets
        device_options = ["cpu"] + (["cuda"] if default_device() == "cuda" else [])
        load_rows = panel_form(self, LOAD_FORM, {"model_select": preset_names(), "device": device_options,
                                                 "active_select": []})
        self.device.value = default_device()
        compile_rows = panel_form(self, COMPILE_FORM)
        self.spinner = pn.indicators.LoadingSpinner(value=False, size=22, name="")
        self.status = pn.pane.Markdown("", css_classes=["wb-status"], margin=(0, 10))
        self.models_md = pn.pane.Markdown("", css_classes=["wb-models"])

        prompt, sampling, buttons = panel_form(self, GENERATE_FORM)
        self.ignore_eos.margin = (28, 10)  # level with the number fields' boxes, under their labels
        self.answer = pn.pane.HTML(_pre(""), css_classes=["wb-answer"], sizing_mode="stretch_width",
                                   styles={"min-height": "4em"})
        self.image_input = w.FileInput(accept="image/*", css_classes=["wb-image"])
        self.image_pane = pn.pane.HTML("", css_classes=["wb-image-preview"], width=170)
        self.answer_stats = pn.pane.Markdown("", css_classes=["wb-answer-stats"])
        [workload] = panel_form(self, WORKLOAD_FORM)
        self.workload_md = pn.pane.Markdown("", css_classes=["wb-workload-status"])
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["wb-error"],
                                   sizing_mode="stretch_width")
        self.info = pn.pane.Alert("", alert_type="info", visible=False, css_classes=["wb-info"],
                                  sizing_mode="stretch_width")
        [window] = panel_form(self, [[WINDOW_FIELD]])
        self.charts = {name: pn.pane.Plotly(fig, height=charts.HEIGHT + 10, sizing_mode="stretch_width",
                                            css_classes=[f"wb-chart-{name.replace('_', '-')}"],
                                            config={"displaylogo": False, "responsive": True})
                       for name, fig in charts.all_figures([]).items()}

        self._build_tuning()
        whatif = whatif_view.panel_tab(self)
        self.wire_buttons()
        self.active_select.param.watch(lambda event: self.on_active(event.new), "value")
        self.image_input.param.watch(lambda event: self.on_image(event.new), "value")
        self.window_select.param.watch(lambda event: self.on_chart_window(event.new), "value")

        sidebar = pn.Column(
            "### Model", *load_rows, self.models_md, pn.layout.Divider(), "### Compile", *compile_rows,
            width=SIDEBAR_WIDTH, styles={"background": "#f6f8fa", "border-radius": "6px"}, margin=(0, 10, 0, 0))
        buttons.extend([pn.pane.Markdown("image (multimodal models):", margin=(12, 5)), self.image_input])
        workload.insert(0, pn.pane.Markdown("**Workload** — fire N random requests to watch continuous batching:"))
        generation = pn.Column(
            prompt, sampling, buttons, pn.Row(self.answer, self.image_pane, sizing_mode="stretch_width"),
            self.answer_stats, workload, self.workload_md, sizing_mode="stretch_width")
        grid = pn.GridBox(*(self.charts[n] for n in CHART_NAMES), ncols=2, sizing_mode="stretch_width")
        header = pn.Row(pn.pane.Markdown("## runner-workbench", margin=(0, 10)), self.spinner, self.status,
                        sizing_mode="stretch_width")
        main = pn.Column(self.error, self.info, generation, window, grid, sizing_mode="stretch_width")
        tabs = pn.Tabs(("Live", pn.Row(sidebar, main, sizing_mode="stretch_width")), ("Tuning", self.tuning),
                       ("What-if", whatif), sizing_mode="stretch_width", css_classes=["wb-tabs"])
        self.layout = pn.Column(header, tabs, sizing_mode="stretch_width", css_classes=["wb-dashboard"])

    def _build_tuning(self) -> None:
        """The Tuning tab: the sweep's form, Start / Cancel, its progress and the three charts."""
        self.tune_progress = pn.indicators.Progress(value=0, max=100, width=300, css_classes=["wb-tune-progress"])
        self.tune_status = pn.pane.Markdown("", css_classes=["wb-tune-status"])
        self.tune_recommendation = pn.pane.Markdown("", css_classes=["wb-tune-recommendation"])
        self.tune_charts = {name: pn.pane.Plotly(fig, height=charts.HEIGHT + 10, sizing_mode="stretch_width",
                                                 css_classes=[f"wb-tune-{name.replace('_', '-')}"],
                                                 config={"displaylogo": False, "responsive": True})
                            for name, fig in tuning_charts.all_figures([], Target()).items()}
        *form, buttons = panel_form(self, TUNE_FORM)
        buttons.append(self.tune_progress)
        self.tuning = pn.Column(
            pn.pane.Markdown("**Sweep** the loaded model's scheduler live (no reload): the most output tokens/s "
                             "whose target metric stays under the limit. The values come from its KV capacity."),
            *form, buttons, self.tune_status,
            self.tune_recommendation, pn.GridBox(*self.tune_charts.values(), ncols=2, sizing_mode="stretch_width"),
            sizing_mode="stretch_width")

    # ---- messages -------------------------------------------------------------------------------
    def show_error(self, message: str) -> None:
        logger.warning("dashboard: %s", message)
        self.info.visible = False
        self.error.object = html.escape(message)
        self.error.visible = True

    def show_info(self, message: str) -> None:
        self.info.object = html.escape(message)
        self.info.visible = True

    def clear_messages(self) -> None:
        self.error.visible = False
        self.info.visible = False

    # ---- actions -----------------------------------------------------------------------------------
    def show_generating(self) -> None:
        self.answer.object = _pre("")
        self.answer_stats.object = "_generating…_"

    def on_image(self, data: bytes | None) -> None:
        self.set_image(data)
        preview = self.image_preview()
        self.image_pane.object = "" if preview is None else (
            f'<img alt="the uploaded image" src="data:image/png;base64,{base64.b64encode(preview).decode()}">')

    # ---- the periodic refresh ---------------------------------------------------------------------
    def refresh(self) -> None:
        """Copy session state into the widgets; redraw charts when the metrics changed."""
        try:
            with pn.io.hold():  # one batched update per refresh
                self._refresh()
        except Exception as exc:  # a view bug must not kill the periodic callback
            logger.exception("dashboard refresh failed")
            self.show_error(f"dashboard refresh failed: {exc}")

    def _refresh(self) -> None:
        s = self.session
        self.status.object = f"**{html.escape(self._status_line(s))}**"
        self.spinner.value = s.busy
        for pane in self.charts.values():
            pane.loading = False
        for label, exc, result in self.finished_jobs():
            if exc is None:
                self.show_info(f"{label}: done" + _describe(result))
        self.sync_active(self.active_select)
        self._show_models(s.models)
        if self.handle is not None:
            text, self.answer_stats.object = self.answer_view()
            self.answer.object = _pre(text)
        if self.workload:
            self.workload_md.object = self.workload_summary()
        self._refresh_tuning()
        self._refresh_whatif()
        version = s.metrics.version
        if version != self._chart_version or s.active != self._chart_model:
            self._chart_version, self._chart_model = version, s.active
            for name, fig in self.chart_figures().items():
                self.charts[name].object = fig

    def _refresh_tuning(self) -> None:
        status, figures, self.tune_recommendation.object = self.refresh_tuning()
        self.tune_status.object = html.escape(status)
        for name, fig in (figures or {}).items():
            self.tune_charts[name].object = fig

    def _refresh_whatif(self) -> None:
        status, figures = self.refresh_whatif()
        self.whatif_status.object = html.escape(status)
        for name, fig in (figures or {}).items():
            self.whatif_charts[name].object = fig

    def _status_line(self, s: Session) -> str:
        """The session's status; while it is busy on one thing (loading, compiling), for how long."""
        status, since = self._status
        if s.status != status:
            status, since = self._status = (s.status, monotonic())
        elapsed = monotonic() - since
        return f"{status} ({elapsed:.0f} s)" if s.busy and elapsed >= 1 else status

    def _show_models(self, models: dict) -> None:
        lines = [f"- **{html.escape(e.name)}** ({e.status}): weights {e.weights_bytes / 2**20:.1f} MiB"
                 f"{' ' + e.config.quantization if e.config.quantization else ''}, "
                 f"KV {e.kv_pool_bytes / 2**20:.1f} MiB, "
                 f"{'compiled ' + str(e.compile.get('backend')) if e.compile.get('enabled') else 'eager'}"
                 + "".join(f"<br>{html.escape(line)}" for line in e.engine_lines())
                 for e in models.values()]
        text = "\n".join(lines) or "_no model loaded_"
        if self.models_md.object != text:
            self.models_md.object = text

    # ---- display -----------------------------------------------------------------------------------
    def start(self) -> SessionDashboard:
        """Attach the periodic refresh to the current document (a browser session or notebook)."""
        pn.state.add_periodic_callback(self.refresh, period=self.refresh_ms)
        return self

    def inline(self, inline_resources: bool = True):
        """The layout, refreshing itself, for display in a notebook cell. Panel's JavaScript comes
        with it (works offline), runs once in the page and is not kept in the saved notebook; with
        inline_resources=False it is loaded from a CDN instead."""
        load_extension_once_shown(inline_resources)
        self.start()
        return pn.Column(self.layout, FieldsKeepEnter(width=0, height=0, margin=0), sizing_mode="stretch_width")

    def servable(self):
        return self.start().layout


def _pre(text: str) -> str:
    return (f'<pre style="white-space: pre-wrap; word-break: break-word; margin: 0; padding: 8px; '
            f'background: #fbfbfd; border: 1px solid #e3e6ea; border-radius: 4px; min-height: 2.5em">'
            f"{html.escape(text)}</pre>")


def _describe(result) -> str:
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


write_queued_patches()


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(session: Session | None = None, *, port: int = 0, address: str = "127.0.0.1", show: bool = False,
          threaded: bool = False, basic_auth: str | None = None, model_roots: list[str] | tuple = (), **kwargs):
    """Serve the dashboard (one SessionDashboard per browser tab, one shared Session). Binds loopback
    unless `address` says otherwise; any other address needs `basic_auth` (a password, or a JSON file
    of {user: password}). The path box loads only from the presets, the Hugging Face cache and
    `model_roots`. Returns the server (a stoppable thread with threaded=True)."""
    session = session or Session.current()
    local = address in LOOPBACK
    if not local and not basic_auth:
        raise SessionError(f"serving on {address} exposes the dashboard (it loads models and runs them) to anyone who "
                           "can reach this machine; add --basic-auth PASSWORD (or a JSON file of users and "
                           "passwords), or bind 127.0.0.1 and reach it through an SSH tunnel")
    roots = ModelRoots(model_roots)
    port = port or free_port(address)
    origins = [f"127.0.0.1:{port}", f"localhost:{port}"] if local else "*"
    pn.extension("plotly")
    if basic_auth:
        kwargs.update(basic_auth=basic_auth, cookie_secret=kwargs.get("cookie_secret") or secrets.token_urlsafe(32))

    def app():
        return SessionDashboard(session, model_roots=roots).servable()

    server = pn.serve(app, port=port, address=address, websocket_origin=origins, show=show, threaded=threaded,
                      title="runner-workbench", verbose=False, start=threaded, **kwargs)
    server.url = f"http://{'127.0.0.1' if address in ('127.0.0.1', 'localhost') else address}:{port}/"
    return server

