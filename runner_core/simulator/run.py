"""A simulated load run in one call: `simulate_workload(model, workload, simulate=...)` loads a simulated
runner (`SimulatedRunner(config, simulate)`), runs a tuning Workload on its virtual clock and shuts it down."""

from __future__ import annotations

from runner_core.config import RunnerConfig
from runner_core.simulator.runner import SimulatedRunner
from runner_core.tuning.driver import run_workload
from runner_core.tuning.request_metrics import RunResult


def simulate_workload(model, workload, *, simulate, target=None, **config_fields) -> RunResult:
    """Run `workload` (a tuning Workload) on a simulated runner of `model` with `config_fields`
    (RunnerConfig fields): loads, runs run_workload on the virtual clock, shuts down; a RunResult
    whose `settings` are the config's fields."""
    runner = SimulatedRunner(RunnerConfig(model=model, **config_fields), simulate).load_model()
    try:
        result = run_workload(runner, workload, target=target)
    finally:
        runner.shutdown()
    result.settings.update(config_fields)
    return result
