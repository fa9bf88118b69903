"""The What-if tab's actions: `whatif_plan` (the form's layouts and workload, bounded by the fields of
workbench.views.forms' WHATIF_FORM) and `WhatifControls` (what both views add to their ViewController for it: the
Memory picture and Simulate actions, the job's state and charts; the tab's layout is workbench.views.layout's). No
engine logic here: the job and the memory figures come from workbench.whatif.job.
"""

from __future__ import annotations

from runner_core.models.catalogue import CONFIG_ONLY, PRESET, catalogue_names
from runner_core.simulator.calibrate import cpu_model_name
from runner_core.tuning import Target, Workload
from workbench.tuning.job import TuneJob
from workbench.views import tuning_charts, whatif_charts
from workbench.views.controller import parse_values
from workbench.views.forms import NONE, WHATIF_DEFAULTS, WHATIF_FIELDS
from workbench.whatif.job import layout_label, memory_layouts, model_source

WHATIF_CONFIG = {"dtype": "bfloat16"}  # the simulated runners' compute dtype (a loaded model keeps its own)


def whatif_plan(hardware: str, tp: str, pp: str, weight_format: str, requests: int) -> tuple[list[dict], Workload]:
    """(layouts, workload) from the form: one layout per TP x PP size on `hardware`; ValueError naming the field."""
    f = WHATIF_FIELDS
    tps, pps = parse_values(tp, f["tp"].label) or [1], parse_values(pp, f["pp"].label) or [1]
    hardware, weight_format = f["hardware"].check(hardware), f["format"].check(weight_format)
    requests = f["requests"].check(requests)
    fmt = {} if weight_format == NONE else {"weight_format": weight_format}
    layouts = [{"hardware": hardware, "tensor_parallel_size": t, "pipeline_parallel_size": p, **fmt}
               for p in pps for t in tps]
    return layouts, Workload(num_requests=requests)


class WhatifControls:
    """The What-if tab's state and actions, beside a ViewController (its `session` and `guard`)."""

    whatif_job = None  # the what-if the tab started (a workbench.whatif.job.WhatifJob)
    whatif_memory: list[dict] = []  # the memory picture's layouts (whatif_job.memory_layouts)
    _whatif_drawn = None  # (job version, measured sweep's version, memory picture) the charts show

    def wire_whatif(self) -> None:
        for button, action in ((self.whatif_memory_button, self.on_whatif_memory), (self.whatif_start, self.on_whatif),
                               (self.whatif_cancel, self.cancel_whatif)):
            button.on_click(lambda _event, action=action: action())

    def whatif_models(self) -> list[str]:
        """The model picker's choices: the models loaded in the session, the config-only models (published
        configs), then the presets (the catalogue's names)."""
        return list(dict.fromkeys([*self.session.models, *catalogue_names(CONFIG_ONLY), *catalogue_names(PRESET)]))

    def whatif_source(self, model: str) -> str:
        """`model` if the tab may simulate it: a model loaded in the session, a catalogue name (a config-only model
        or a preset), or (a served dashboard) a directory inside its model roots; else ModelPathRefused."""
        if self.model_roots is None or model in self.session.models:
            return model
        return self.model_roots.check(model)

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
            path, config = model_source(self.session, self.whatif_source(model), WHATIF_CONFIG)
            return memory_layouts(path, layouts, **config)

        memory = self.guard("Memory picture", draw)
        if memory is not None:
            self.whatif_memory = memory
        return memory

    def start_whatif(self, model: str, hardware: str, tp: str, pp: str, weight_format: str, requests: int):
        """Start a what-if of the form's layouts (and draw their memory picture); the job or None."""
        def start():
            layouts, workload = whatif_plan(hardware, tp, pp, weight_format, requests)
            return self.session.whatif(self.whatif_source(model), layouts, workload, **WHATIF_CONFIG)

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
