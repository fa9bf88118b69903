"""Tuning: workloads with arrivals, a run's summary of its requests' RequestMetrics, the load drivers (in
process and over HTTP) and the sweeps that search the engine's settings under a latency target."""

from runner_core.tuning.driver import run_workload, vocab_and_tokenizer
from runner_core.tuning.http_load import run_http_workload
from runner_core.tuning.request_metrics import RunResult, Target, summarize
from runner_core.tuning.space import SweepSpace, propose_space, speculation_values
from runner_core.tuning.sweep import RunnerBackend, TuneBackend, TuneProgress, TuneResult, tune
from runner_core.tuning.workload import Arrivals, Lengths, Workload, WorkloadRequest, load_dataset

__all__ = [
    "Arrivals", "Lengths", "RunResult", "Target", "Workload", "WorkloadRequest", "load_dataset",
    "run_http_workload", "run_workload", "summarize", "vocab_and_tokenizer",
    "RunnerBackend", "SweepSpace", "TuneBackend", "TuneProgress", "TuneResult", "propose_space",
    "speculation_values", "tune",
]
