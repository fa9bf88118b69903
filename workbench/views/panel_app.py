"""The Panel dashboard: workbench.views.layout's tabs made with Panel (`PanelToolkit`) over a `Session`, refreshed
by workbench.views.dashboard. `python -m workbench serve` serves it; `SessionDashboard(session).inline()` shows it in
JupyterLab. Every action calls a Session method; nothing here touches a runner.
"""

from __future__ import annotations

import base64
import html
import logging
import secrets
import socket

import panel as pn

from workbench.runtime.handles import SessionError
from workbench.runtime.model_roots import ModelRoots
from workbench.session import Session
from workbench.views import charts
from workbench.views.dashboard import Dashboard
from workbench.views.fields import panel_control
from workbench.views.notebook_output import FieldsKeepEnter, load_extension_once_shown
from workbench.views.panel_writer import write_queued_patches

logger = logging.getLogger("workbench")

REFRESH_MS = 500
SIDEBAR_WIDTH = 300
WIDE = {"sizing_mode": "stretch_width"}


class PanelToolkit:
    """workbench.views.layout's slots in Panel: make a control, text, chart, note, element or box; set a text, a
    chart's figure, the spinner; watch a widget's value; hold a refresh's changes into one update."""

    control = staticmethod(panel_control)

    def text(self, slot):
        if slot.pre:
            return pn.pane.HTML(_pre(""), css_classes=[slot.css], styles={"min-height": "4em"}, **WIDE)
        return pn.pane.HTML("", css_classes=[slot.css], margin=(0, 10))

    def set_text(self, pane, slot, value: str) -> None:
        value = _pre(value) if slot.pre else value
        if pane.object != value:
            pane.object = value

    def chart(self, slot):
        return pn.pane.Plotly(None, height=charts.HEIGHT + 10, css_classes=[slot.css],
                              config={"displaylogo": False, "responsive": True}, **WIDE)

    def set_figure(self, pane, fig) -> None:
        pane.object = fig

    def note(self, text: str):
        return pn.pane.HTML(text)

    def element(self, element):
        css = [element.css] if element.css else []
        kind = element.kind
        if kind == "progress":
            return pn.indicators.Progress(value=0, max=100, width=300, css_classes=css)
        if kind == "spinner":
            return pn.indicators.LoadingSpinner(value=False, size=22, name="")
        if kind in ("error", "info"):
            return pn.pane.Alert("", alert_type="danger" if kind == "error" else "info", visible=False,
                                 css_classes=css, **WIDE)
        if kind == "image_input":
            return pn.widgets.FileInput(accept="image/*", css_classes=css)
        if kind == "image_view":
            return pn.pane.HTML("", css_classes=css, width=170)
        return pn.layout.Divider()

    def box(self, box, children: list):
        css = {"css_classes": [box.css]} if box.css else {}
        if box.kind == "tabs":
            return pn.Tabs(*zip(box.titles, children), **css, **WIDE)
        if box.kind == "side":
            return pn.Column(*children, width=SIDEBAR_WIDTH, styles={"background": "#f6f8fa", "border-radius": "6px"},
                             margin=(0, 10, 0, 0))
        if box.kind == "grid":
            return pn.GridBox(*children, ncols=2, **WIDE)
        return (pn.Column if box.kind == "column" else pn.Row)(*children, **css, **WIDE)

    def set_busy(self, spinner, busy: bool) -> None:
        spinner.value = busy

    def set_end(self, slider, end: int) -> None:
        """A slider's last value (its value kept within it)."""
        end = max(end, slider.start + 1)
        if slider.value > end:
            slider.value = end
        if slider.end != end:
            slider.end = end

    def on_change(self, widget, callback) -> None:
        widget.param.watch(lambda event: callback(event.new), "value")

    def hold(self):
        return pn.io.hold()


class SessionDashboard(Dashboard):
    """One dashboard per browser session (or notebook cell) over a shared Session."""

    def __init__(self, session: Session | None = None, refresh_ms: int = REFRESH_MS,
                 model_roots: ModelRoots | None = None):
        super().__init__(session, model_roots, PanelToolkit())
        self.refresh_ms = refresh_ms
        self.ignore_eos.margin = (28, 10)  # level with the number fields' boxes, under their labels
        self.refresh()
        # until the browser runs the first periodic refresh, the charts say they are still coming
        for pane in self.charts.values():
            pane.loading = True

    def refreshed(self) -> None:
        for pane in self.charts.values():
            pane.loading = False

    # ---- messages -------------------------------------------------------------------------------
    def show_error(self, message: str) -> None:
        logger.warning("dashboard: %s", message)
        self.info.param.update(object="", visible=False)
        self.error.param.update(object=html.escape(message), visible=True)  # text and visibility in one event

    def show_info(self, message: str) -> None:
        self.info.param.update(object=html.escape(message), visible=True)

    def clear_messages(self) -> None:
        # a hidden pane keeps no text: shown again, it can only carry the message that showed it
        self.error.param.update(object="", visible=False)
        self.info.param.update(object="", visible=False)

    def on_image(self, data: bytes | None) -> None:
        """FileInput's value: the file's bytes."""
        self.set_image(data)
        preview = self.image_preview()
        self.image_view.object = "" if preview is None else (
            f'<img alt="the uploaded image" src="data:image/png;base64,{base64.b64encode(preview).decode()}">')

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
        return pn.Column(self.root, FieldsKeepEnter(width=0, height=0, margin=0), **WIDE)

    def servable(self):
        return self.start().root


def _pre(text: str) -> str:
    return (f'<pre style="white-space: pre-wrap; word-break: break-word; margin: 0; padding: 8px; '
            f'background: #fbfbfd; border: 1px solid #e3e6ea; border-radius: 4px; min-height: 2.5em">'
            f"{html.escape(text)}</pre>")


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

