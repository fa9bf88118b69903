"""The saved calibration of this CPU: `Calibration` (the fitted HardwareSpec, the rows and errors it came from)
and `load_calibration()`, which `Simulation(hardware="cpu")` reads. Apart from `calibrate` (which runs the real
engine) so that the simulated runner reads a calibration without importing what makes one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from runner_core.cache_dir import cache_root
from runner_core.simulator.hardware import Coefficients, HardwareSpec


@dataclasses.dataclass
class Calibration:
    """A fitted CPU: `hardware` (its `efficiency` the fitted Coefficients), the main `model` and every model in
    `models` whose steps were measured, the compute `dtype`, the measured `rows`, the fit's own error on them
    (`fit_error`: median / p90 relative error, n), the engine `settings` the steps ran with, the date and the
    calibration's wall seconds."""

    hardware: HardwareSpec
    model: str
    dtype: str
    rows: list[dict]
    fit_error: dict
    models: list[str] = dataclasses.field(default_factory=list)
    settings: dict = dataclasses.field(default_factory=dict)
    date: str = ""
    seconds: float = 0.0

    @property
    def coefficients(self) -> Coefficients:
        return self.hardware.efficiency

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hardware": self.hardware.as_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """Read back `to_dict`'s dict; a calibration saved before decode attention had its own efficiency
        predicts as it did: its one attention efficiency serves both."""
        hw = dict(d["hardware"])
        hw["efficiency"] = _coefficients(hw["efficiency"]) if hw.get("efficiency") else None
        hw["band"] = {k: _coefficients(c) for k, c in hw.get("band", {}).items()}
        return cls(**{**d, "hardware": HardwareSpec(**hw)})

    def save(self, path=None) -> Path:
        path = Path(path) if path is not None else calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path


def _coefficients(d: dict) -> Coefficients:
    return Coefficients(**{"decode_attention_efficiency": d.get("attention_efficiency"), **d})


def calibration_path() -> Path:
    """Where the calibration is saved by default: $RUNNER_WORKBENCH_CACHE/whatif/calibration.json."""
    return cache_root() / "whatif" / "calibration.json"


def load_calibration(path=None) -> Calibration | None:
    """The saved calibration (default: calibration_path()), None when there is none; ValueError naming the
    file when it cannot be read back."""
    path = Path(path) if path is not None else calibration_path()
    if not path.exists():
        return None
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"calibration file {path} is unreadable ({type(e).__name__}: {e}); delete it and run "
                         "`make bench-whatif` or runner_core.simulator.calibrate() again") from None
