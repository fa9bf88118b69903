"""Tuning from the session (what Session.run_load and Session.tune use): `run_load` sends a runner_core.tuning
Workload to a loaded model and summarizes the run, `SessionBackend` is the TuneBackend over a loaded model,
`TuneJob` runs a sweep in the background."""

from workbench.tuning.backend import DEFAULT_WORKLOAD, SessionBackend, run_load
from workbench.tuning.job import TuneJob

__all__ = ["DEFAULT_WORKLOAD", "SessionBackend", "TuneJob", "run_load"]
