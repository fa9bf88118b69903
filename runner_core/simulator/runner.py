"""The simulated runner: `SimulatedRunner(config, simulate)`, a ModelRunner whose `load_model` builds
`engine.py`'s SimulatedEngine (the real scheduler and memory manager on a virtual clock, no weights, no
ranks) on the hardware `simulate` names; everything else is ModelRunner's, save for what needs weights."""

from __future__ import annotations

from pathlib import Path

from runner_core.config import RunnerConfig
from runner_core.errors import ConfigError
from runner_core.model_runner import ModelRunner
from runner_core.simulator.engine import build_simulated_engine
from runner_core.simulator.hardware import HardwareSpec
from runner_core.simulator.simulation import Simulation


class SimulatedRunner(ModelRunner):
    """ModelRunner's API over a simulated engine. `simulate`: a Simulation, a HardwareSpec or a device name
    (a HARDWARE name such as "h200", or "cpu": this machine's saved calibration). The model is its config.json
    (a published model, a preset or a directory); a layout that does not fit the hardware is refused by
    `load_model` with a ConfigError. Steps advance a virtual clock by their predicted time and draw tokens;
    `forward`, `moe_stats` and `save_pretrained` need weights and are refused."""

    def __init__(self, config: RunnerConfig | dict | None = None, simulate: Simulation | HardwareSpec | str = "cpu",
                 **overrides):
        super().__init__(config, **overrides)
        self.simulation = Simulation.coerce(simulate)

    def load_model(self) -> SimulatedRunner:
        """Build the simulated engine: the model's config read, the layout validated, the KV pool planned on
        the hardware (ConfigError when the configuration cannot fit it). Nothing is spawned or loaded."""
        self.shutdown()
        self.engine = build_simulated_engine(self.config, self.simulation)
        self.config, self.memory_estimate = self.engine.config, self.engine.worker.estimate
        return self

    def shutdown(self) -> None:
        """Shut the engine down; it held no weights or KV tensor, so no freed memory is handed back."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None

    def save_pretrained(self, directory) -> Path:
        """Refused (ConfigError): there are no weights to save."""
        self._engine()
        raise ConfigError("a simulated runner has no weights to save; load the model with ModelRunner to save it")
