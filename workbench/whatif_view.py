"""The What-if tab of both dashboards: `WhatifControls` (what both views add to their ViewController for it:
the form's plan, the Memory picture and Simulate actions, the job's state and charts) and the tab's layout in
Panel (`panel_tab`) and in ipywidgets (`widgets_tab`), which also wire its buttons. The layouts create the
widgets the controls read:
`whatif_model`, `whatif_hardware`, `whatif_tp`, `whatif_pp` (lists as text: "4, 8"), `whatif_format`,
`whatif_requests` (each with `.value`), the buttons `whatif_memory_button`, `whatif_start`, `whatif_cancel` and
`whatif_progress` (0 to 100). No engine logic here: the job and the memory figures come from
workbench.whatif_job.
"""

from __future__ import annotations

from runner_core.simulator.calibrate import cpu_model_name
from runner_core.simulator.hardware import HARDWARE
from runner_core.simulator.model_configs import config_model_names
from runner_core.simulator.simulation import WEIGHT_FORMATS
from runner_core.tuning import Target, Workload
from workbench import charts, tuning_charts, whatif_charts
from workbench.controller import parse_values
from workbench.tune_job import TuneJob
from workbench.whatif_job import layout_label, memory_layouts, model_source

FORMAT_NONE = "none"  # the form's weight format for weights kept in the compute dtype
FORMATS = [FORMAT_NONE, *(f for f in WEIGHT_FORMATS if f)]
WHATIF_DEFAULTS = {"model": "llama-3-70b", "hardware": "h100-sxm", "tp": "1, 8", "pp": "1", "format": FORMAT_NONE,
                   "requests": 64}
WHATIF_CONFIG = {"dtype": "bfloat16"}  # the simulated runners' compute dtype (a loaded model keeps its own)
INTRO = ("**What-if**: the engine's real scheduler on a virtual clock, each step's time predicted for the device "
         "(no weights loaded). *Memory picture* shows at once what one device of each layout holds; *Simulate* "
         "sweeps the layouts and concurrency, with the device's efficiency band as error bars, next to the "
         "latest measured sweep of the Tuning tab.")


def whatif_plan(hardware: str, tp: str, pp: str, weight_format: str, requests: int) -> tuple[list[dict], Workload]:
    """(layouts, workload) from the form: one layout per TP x PP size on `hardware`; ValueError naming the field."""
    tps, pps = parse_values(tp, "TP sizes") or [1], parse_values(pp, "PP sizes") or [1]
    if int(requests) < 1:
        raise ValueError(f"requests per run {requests}: must be at least 1")
    fmt = {} if weight_format == FORMAT_NONE else {"weight_format": weight_format}
    layouts = [{"hardware": hardware, "tensor_parallel_size": t, "pipeline_parallel_size": p, **fmt}
               for p in pps for t in tps]
    return layouts, Workload(num_requests=int(requests))


class WhatifControls:
    """The What-if tab's state and actions, beside a ViewController (its `session` and `guard`)."""

    whatif_job = None  # the what-if the tab started (a workbench.whatif_job.WhatifJob)
    whatif_memory: list[dict] = []  # the memory picture's layouts (whatif_job.memory_layouts)
    _whatif_drawn = None  # (job version, measured sweep's version, memory picture) the charts show

    def wire_whatif(self) -> None:
        for button, action in ((self.whatif_memory_button, self.on_whatif_memory), (self.whatif_start, self.on_whatif),
                               (self.whatif_cancel, self.cancel_whatif)):
            button.on_click(lambda _event, action=action: action())

    def whatif_models(self) -> list[str]:
        """The model picker's choices: the models loaded in the session, then the published configs."""
        return [*self.session.models, *config_model_names()]

    def on_whatif_memory(self) -> None:
        self.draw_memory(self.whatif_model.value, self.whatif_hardware.value, self.whatif_tp.value,
                         self.whatif_pp.value, self.whatif_format.value)

    def on_whatif(self) -> None:
        self.start_whatif(self.whatif_model.value, self.whatif_hardware.value, self.whatif_tp.value,
                          self.whatif_pp.value, self.whatif_format.value, self.whatif_requests.value)

    def draw_memory(self, model: str, hardware: str, tp: str, pp: str, weight_format: str) -> list[dict] | None:
        """The memory picture of the form's layouts (no run); its layouts, or None after an error message."""
        def draw():
            layouts, _ = whatif_plan(hardware, tp, pp, weight_format, 1)
            path, config = model_source(self.session, model, WHATIF_CONFIG)
            return memory_layouts(path, layouts, **config)

        memory = self.guard("Memory picture", draw)
        if memory is not None:
            self.whatif_memory = memory
        return memory

    def start_whatif(self, model: str, hardware: str, tp: str, pp: str, weight_format: str, requests: int):
        """Start a what-if of the form's layouts (and draw their memory picture); the job or None."""
        def start():
            layouts, workload = whatif_plan(hardware, tp, pp, weight_format, requests)
            return self.session.whatif(model, layouts, workload, **WHATIF_CONFIG)

        job = self.guard("Simulate", start)
        if job is not None:
            self.whatif_job = job
            self.draw_memory(model, hardware, tp, pp, weight_format)
        return job

    def cancel_whatif(self) -> None:
        if self.whatif_job is not None:
            self.whatif_job.cancel()

    def refresh_whatif(self) -> tuple[str, dict | None]:
        """Keep the model picker's choices current, move the progress bar; (the status line, the tab's
        figures when something changed since the last call, else None)."""
        choices = self.whatif_models()
        if list(self.whatif_model.options) != choices:
            value = self.whatif_model.value
            self.whatif_model.options = choices
            self.whatif_model.value = value if value in choices else WHATIF_DEFAULTS["model"]
        job, measured = self.whatif_job, TuneJob.latest(self.session)
        drawn = (None if job is None else job.version, None if measured is None else measured.version,
                 id(self.whatif_memory))
        figures = None
        if drawn != self._whatif_drawn:
            self._whatif_drawn = drawn
            target = job.target if job is not None else Target()
            figures = whatif_charts.all_figures(
                [] if job is None else job.points, target, measured=[] if measured is None else measured.points,
                measured_label=f"measured: {measured.model} on {cpu_model_name()}" if measured else "")
            figures["memory"] = whatif_charts.memory_picture(self.whatif_memory)
        if job is None:
            self.whatif_progress.value = 0
            return "no what-if yet: pick a model and layouts, then press Simulate", figures
        done = job.done and job.error is None and not job.cancelled
        fraction = 1.0 if done else tuning_charts.progress_fraction(job.progress, job.repeats)
        self.whatif_progress.value = round(100 * fraction)
        skipped = "".join(f"; skipped {layout_label(s['settings'])}: {s['why'].split(' (')[0]}" for s in job.skipped)
        return job.status + skipped, figures


CHART_NAMES = ("pareto", "memory", "latency")


def panel_tab(view):
    """The tab in Panel: the form, the buttons, progress, status and the three charts (`view.whatif_charts`)."""
    import panel as pn

    w, d = pn.widgets, WHATIF_DEFAULTS
    view.whatif_model = w.Select(name="model", options=view.whatif_models(), value=d["model"], width=200,
                                 css_classes=["wb-whatif-model"])
    view.whatif_hardware = w.Select(name="hardware", options=list(HARDWARE), value=d["hardware"], width=160,
                                    css_classes=["wb-whatif-hardware"])
    view.whatif_tp = w.TextInput(name="TP sizes", value=d["tp"], width=120, css_classes=["wb-whatif-tp"])
    view.whatif_pp = w.TextInput(name="PP sizes", value=d["pp"], width=120, css_classes=["wb-whatif-pp"])
    view.whatif_format = w.Select(name="weights stored as", options=FORMATS,
                                  value=d["format"], width=140, css_classes=["wb-whatif-format"])
    view.whatif_requests = w.IntInput(name="requests per run", value=d["requests"], start=1, width=140,
                                      css_classes=["wb-whatif-requests"])
    view.whatif_memory_button = w.Button(name="Memory picture", css_classes=["wb-whatif-memory-button"])
    view.whatif_start = w.Button(name="Simulate", button_type="primary", css_classes=["wb-whatif-start"])
    view.whatif_cancel = w.Button(name="Cancel what-if", css_classes=["wb-whatif-cancel"])
    view.whatif_progress = pn.indicators.Progress(value=0, max=100, width=300, css_classes=["wb-whatif-progress"])
    view.whatif_status = pn.pane.Markdown("", css_classes=["wb-whatif-status"])
    view.whatif_charts = {name: pn.pane.Plotly(None, height=charts.HEIGHT + 10, sizing_mode="stretch_width",
                                               css_classes=[f"wb-whatif-{name}"],
                                               config={"displaylogo": False, "responsive": True})
                          for name in CHART_NAMES}
    view.wire_whatif()
    return pn.Column(
        pn.pane.Markdown(INTRO), pn.Row(view.whatif_model, view.whatif_hardware, view.whatif_tp, view.whatif_pp,
                                        view.whatif_format, view.whatif_requests, sizing_mode="stretch_width"),
        pn.Row(view.whatif_memory_button, view.whatif_start, view.whatif_cancel, view.whatif_progress),
        view.whatif_status, pn.GridBox(*view.whatif_charts.values(), ncols=2, sizing_mode="stretch_width"),
        sizing_mode="stretch_width")


def widgets_tab(view, grid: dict, label: dict):
    """The tab in ipywidgets (FigureWidgets in `view.whatif_figures`), laid out as the Tuning tab is."""
    import ipywidgets as W
    import plotly.graph_objects as go

    d = WHATIF_DEFAULTS
    view.whatif_model = W.Dropdown(options=view.whatif_models(), value=d["model"], description="model", style=label)
    view.whatif_hardware = W.Dropdown(options=list(HARDWARE), value=d["hardware"], description="hardware",
                                      style=label, layout=W.Layout(width="210px"))
    view.whatif_tp = W.Text(value=d["tp"], description="TP sizes", style=label, layout=W.Layout(width="170px"))
    view.whatif_pp = W.Text(value=d["pp"], description="PP sizes", style=label, layout=W.Layout(width="170px"))
    view.whatif_format = W.Dropdown(options=FORMATS, value=d["format"],
                                    description="weights stored as", style=label, layout=W.Layout(width="230px"))
    view.whatif_requests = W.BoundedIntText(value=d["requests"], min=1, max=100_000, description="requests per run",
                                            style=label, layout=W.Layout(width="200px"))
    view.whatif_memory_button = W.Button(description="Memory picture", icon="th-large")
    view.whatif_start = W.Button(description="Simulate", button_style="primary", icon="play")
    view.whatif_cancel = W.Button(description="Cancel what-if", icon="stop")
    view.whatif_progress = W.IntProgress(value=0, min=0, max=100)
    view.whatif_status = W.HTML("")
    view.whatif_figures = {name: go.FigureWidget() for name in CHART_NAMES}
    view.wire_whatif()
    return W.VBox([W.HBox([view.whatif_model, view.whatif_hardware, view.whatif_format]),
                   W.HBox([view.whatif_tp, view.whatif_pp, view.whatif_requests]),
                   W.HBox([view.whatif_memory_button, view.whatif_start, view.whatif_cancel, view.whatif_progress]),
                   view.whatif_status, W.GridBox(list(view.whatif_figures.values()), layout=W.Layout(**grid))])
