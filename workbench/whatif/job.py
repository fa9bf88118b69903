"""What-if from the session: `WhatifJob` runs runner_core.simulator's `whatif` sweep (the engine's real
scheduler on a virtual clock, on named hardware and layouts) in a background thread, with the progress, rows,
points and cancel of a TuneJob (workbench/tuning/job.py's SweepJob). It never touches the session's engine
thread or its loaded models: a simulation loads no weights. The session keeps its latest one
(`session.latest_job("what-if")`, `WhatifJob.latest(session)`), so views can show it next to the latest measured
sweep (`TuneJob.latest`), and cancels it at close.

`memory_layouts` is the memory picture's data, at once and without a run: per layout, what one device holds
(weights, the KV pool the device's memory leaves, activation peak, the hardware's reserved bytes) and whether
it fits, with the simulated runner's own plan and refusal (runner_core.simulator.simulation).
"""

from __future__ import annotations

from pathlib import Path

from runner_core import ConfigError, RunnerConfig
from runner_core.memory.fit import required_bytes
from runner_core.models.catalogue import resolve_model
from runner_core.simulator.backend import SIMULATION_SETTINGS, whatif
from runner_core.simulator.hardware import get_hardware
from runner_core.simulator.simulation import Simulation, estimate_on, plan_memory, simulated_config, usable_bytes
from runner_core.tuning import SweepSpace, Target
from workbench.tuning.backend import DEFAULT_WORKLOAD
from workbench.tuning.job import SweepJob


class WhatifJob(SweepJob):
    """A what-if sweep over `layouts` (dicts such as {"hardware": "h100-sxm", "tensor_parallel_size": 8}) of
    `model` (a catalogue name: a config-only model or a preset; a model directory; or the name of a model
    loaded in the session: its model and dtype); see Session.whatif."""

    noun = "what-if"

    def __init__(self, session, model: str, layouts, workload, target, *, band: bool, space, results, repeats: int,
                 config: dict):
        self.model = model
        self.model_path, self.config = model_source(session, model, config)
        self.layouts = _check_layouts(layouts)
        self.space, self.band, self.results_path = space, band, results
        super().__init__(session, workload, target, thread_name=f"workbench-whatif-{model}", repeats=repeats)

    @classmethod
    def start(cls, session, model: str, layouts, workload=None, *, target=None, band: bool = True, space=None,
              results=None, repeats: int = 1, **config) -> WhatifJob:
        return session.keep_job(cls.noun, lambda: cls(
            session, model, layouts, DEFAULT_WORKLOAD if workload is None else workload,
            Target() if target is None else target, band=band, space=space, results=results, repeats=repeats,
            config=config).launch())

    def _sweep(self):
        return whatif(self.model_path, self.workload, self.target, self.layouts, base_config=self.config,
                      band=self.band, space=self.space, results=self.results_path, repeats=self.repeats,
                      on_progress=self._on_progress, stop=self._stop)

    def _fields(self) -> list[str]:
        return list(dict.fromkeys([*SweepSpace(layout=self.layouts).fields(), *(self.space or SweepSpace()).fields()]))

    @property
    def skipped(self) -> list[dict]:
        """The layouts the simulator refused (each {"stage", "settings", "why"}: the model named as given, not
        by its cached config's path), once the job finished."""
        if self._result is None:
            return []
        return [{**s, "why": s["why"].replace(self.model_path, self.model)} for s in self._result.skipped]

    def __repr__(self) -> str:
        return f"<WhatifJob of {self.model} on {len(self.layouts)} layouts: {self.status}>"


def model_source(session, model: str, config: dict) -> tuple[str, dict]:
    """(what the simulated runner reads, its base config) for `model`: a model loaded in the session gives
    its own model and dtype; anything else is resolved by the catalogue (a config-only model, a preset, a directory)
    and keeps `config`."""
    entry = session.models.get(model)
    if entry is not None:
        return entry.config.model, {**config, "dtype": entry.config.dtype}
    return str(resolve_model(model)), dict(config)


def _check_layouts(layouts) -> list[dict]:
    if not isinstance(layouts, (list, tuple)) or not layouts or not all(isinstance(x, dict) for x in layouts):
        raise ValueError(f"layouts must be a non-empty list of dicts such as [{{'hardware': 'h100-sxm', "
                         f"'tensor_parallel_size': 8}}], got {layouts!r}")
    return [dict(x) for x in layouts]


def layout_label(layout: dict) -> str:
    """ "h100-sxm tp=8", "l4 tp=2 pp=2 int4": the layout's device and what differs from one plain device."""
    parts = [str(layout.get("hardware", "cpu"))]
    parts += [f"{short}={layout[key]}" for key, short in (("tensor_parallel_size", "tp"),
                                                           ("pipeline_parallel_size", "pp"))
              if layout.get(key, 1) != 1]
    return " ".join(parts + ([layout["weight_format"]] if layout.get("weight_format") else []))


def memory_layouts(model: str, layouts, **config) -> list[dict]:
    """Each layout's memory per device, for whatif_charts.memory_picture (see the module docstring), as the
    simulated runner plans it (runner_core.simulator.simulation: estimate_on, plan_memory) from RunnerConfig
    fields `config`: on a GPU the KV pool gets what device memory x gpu_memory_utilization leaves after the
    reserved bytes, weights, rotary tables and activation peak (drawn with the activations). A layout that
    does not fit shows its least KV pool (one max_model_len sequence) and `why` says what would fit."""
    path = str(resolve_model(model))
    out = []
    for layout in _check_layouts(layouts):
        hardware = get_hardware(layout.get("hardware", "cpu"))
        fields = {k: v for k, v in layout.items() if k not in SIMULATION_SETTINGS}
        run_config = simulated_config(RunnerConfig({**config, **fields, "model": path}), hardware)
        fmt = Simulation(hardware, weight_format=layout.get("weight_format")).weight_format  # checked there
        estimate = estimate_on(run_config, Path(path), hardware, fmt)
        try:
            kv, fits, why = plan_memory(run_config, estimate, hardware).num_bytes, True, ""
        except ConfigError as exc:
            kv, fits, why = required_bytes(estimate) - estimate.fixed_bytes, False, str(exc).replace(path, model)
        reserved = hardware.reserved_bytes if hardware.kind == "gpu" else 0
        out.append({"label": layout_label(layout), "layout": layout, "hardware": hardware.name,
                    "weights_bytes": estimate.weights_bytes, "kv_pool_bytes": kv,
                    "activation_peak_bytes": estimate.fixed_bytes - estimate.weights_bytes,
                    "reserved_bytes": reserved, "device_memory_bytes": hardware.memory_bytes,
                    "usable_bytes": usable_bytes(run_config, hardware) + reserved, "fits": fits, "why": why})
    return out
