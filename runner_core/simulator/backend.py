"""What-if sweeps: `SimulatorBackend`, the tuning sweep's TuneBackend over a SimulatedRunner (devices,
layouts and weight formats are settings like any RunnerConfig field), and `whatif`, the tuning sweep over
layouts such as {"hardware": "h100-sxm", "tensor_parallel_size": 8} with each point's throughput also run at
the ends of the hardware's efficiency band, so a chart can draw the prediction as an error bar."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from runner_core.config import RECONFIGURABLE, RunnerConfig
from runner_core.simulator.runner import SimulatedRunner
from runner_core.simulator.simulation import Simulation
from runner_core.tuning.request_metrics import RunResult, Target
from runner_core.tuning.results import THROUGHPUT
from runner_core.tuning.space import SweepSpace, with_concurrency
from runner_core.tuning.sweep import RunnerBackend, TuneProgress, TuneResult, tune
from runner_core.tuning.workload import Workload

SIMULATION_SETTINGS = ("hardware", "band", "weight_format", "kv_cache_dtype")  # Simulation fields a sweep may set
BAND_ENDS = ("low", "high")


def _hardware_name(hardware) -> str:
    return hardware if isinstance(hardware, str) else hardware.name


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was after): a simulated run allocates millions
    of short-lived containers, which reference counting frees, and the collector's passes over them took
    ~40% of a 1,000/1,000-token run; what cycles the run leaves are collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class SimulatorBackend(RunnerBackend):
    """A TuneBackend over a simulated runner (`SimulatedRunner(config, simulate)`): no weights, a
    virtual clock. `apply` takes RunnerConfig fields and the simulation's "hardware" (a HARDWARE name),
    "band", "weight_format" and "kv_cache_dtype": the fields of RECONFIGURABLE change live through
    `reconfigure`, anything else builds a new simulated runner (cheap: it reads config.json only). A layout
    the hardware cannot hold raises the runner's ConfigError (a ValueError naming the memory it needs), which
    the sweep records as a skipped point; the backend then keeps its previous runner and settings."""

    def __init__(self, config, simulate="cpu") -> None:
        self.runner = SimulatedRunner(RunnerConfig(config), simulate).load_model()
        self.simulation = self.runner.simulation

    def apply(self, settings: dict) -> dict:
        current = self.settings()
        unknown = sorted(set(settings) - set(current))
        if unknown:
            raise ValueError(f"unknown what-if settings {unknown}: use RunnerConfig fields or "
                             f"{', '.join(SIMULATION_SETTINGS)}")
        changes = {k: v for k, v in settings.items() if current[k] != v}
        simulated = {k: changes.pop(k) for k in SIMULATION_SETTINGS if k in changes}
        if not changes and not simulated:
            return {"seconds": 0.0, "rebuilt": "none"}
        live = {f for fields in RECONFIGURABLE.values() for f in fields}
        if not simulated and set(changes) <= live:
            out = self.runner.reconfigure(**changes)
            return {"seconds": out["seconds"], "rebuilt": out["rebuilt"]}
        t0 = time.perf_counter()
        config = self.runner.config.replace(**changes)
        simulation = dataclasses.replace(self.simulation, **simulated)
        runner = SimulatedRunner(config, simulation).load_model()  # raises before the old runner goes
        self.runner.shutdown()
        self.runner, self.simulation = runner, simulation
        return {"seconds": time.perf_counter() - t0, "rebuilt": "reload"}

    def run(self, workload: Workload, target: Target) -> RunResult:
        with collector_paused():
            return super().run(workload, target)

    def settings(self) -> dict:
        return {**self.runner.config.to_dict(), "hardware": _hardware_name(self.simulation.hardware),
                "band": self.simulation.band, "weight_format": self.simulation.weight_format,
                "kv_cache_dtype": self.simulation.kv_cache_dtype}


def _first_loadable(config: RunnerConfig, layouts: list[dict], simulation: Simulation) -> SimulatorBackend:
    """A backend on the first layout that loads (the sweep starts there); ValueError with every reason if none."""
    reasons = []
    for layout in layouts:
        sim = {k: layout[k] for k in SIMULATION_SETTINGS if k in layout}
        fields = {k: v for k, v in layout.items() if k not in SIMULATION_SETTINGS}
        try:
            return SimulatorBackend(config.replace(**fields), dataclasses.replace(simulation, **sim))
        except ValueError as e:
            reasons.append(f"{layout}: {e}")
    raise ValueError("no layout of the what-if sweep loads:\n" + "\n".join(reasons))


def add_band(result: TuneResult, backend: SimulatorBackend, workload: Workload, target: Target) -> None:
    """Runs every measured point again at the band's low and high ends and adds its output_throughput there
    to the point as "band_low" / "band_high" (and to its "median", so points_dataframe() has the columns);
    the backend is left with the settings it had."""
    initial = backend.settings()
    try:
        for point in result.points:
            values = point["values"]
            settings = {k: v for k, v in values.items() if k != "concurrency"}
            load = with_concurrency(workload, values.get("concurrency"))
            for end in BAND_ENDS:
                backend.apply({**settings, "band": end})
                value = backend.run(load, target).summary[THROUGHPUT]
                point[f"band_{end}"] = point["median"][f"band_{end}"] = value
    finally:
        backend.apply(initial)


def whatif(model: str, workload: Workload | None = None, target: Target | None = None,
           layouts: list[dict] | None = None, *, base_config: dict | None = None, band: bool = True,
           space: SweepSpace | None = None, repeats: int = 1, results=None,
           on_progress: Callable[[TuneProgress], None] | None = None,
           stop: threading.Event | None = None) -> TuneResult:
    """The tuning sweep (`tune`) on simulated runners of `model` (the models' catalogue: a config-only model, a
    preset or a directory with config.json): `layouts` (e.g. [{"hardware": "h100-sxm", "tensor_parallel_size": 8},
    {"hardware": "l4", "tensor_parallel_size": 1}]; default: this CPU as configured) are the layout stage,
    then the concurrency and any knobs of `space`, at the band's typical efficiency. A layout that does not
    fit its hardware is in `result.skipped` with the reason. With `band`, each measured point also gets
    "band_low" / "band_high": its output_throughput at the pessimistic and optimistic ends. A simulation is
    deterministic, so `repeats` defaults to 1 and there is no warm-up."""
    layouts = [{}] if layouts is None else [dict(layout) for layout in layouts]
    workload = Workload() if workload is None else workload
    target = Target() if target is None else target
    space = SweepSpace(layout=layouts) if space is None else dataclasses.replace(space, layout=layouts)
    config = RunnerConfig({"model": model, **(base_config or {})})
    with _first_loadable(config, layouts, Simulation(band="typical")) as backend:
        result = tune(space, workload, target, backend=backend, repeats=repeats, warmup=0, results=results,
                      on_progress=on_progress, stop=stop)
        if band and not result.cancelled:
            add_band(result, backend, workload, target)
    return result
