"""runner_core: a paged-KV, continuously batched LLM engine behind the ModelRunner API."""

from runner_core.config import RunnerConfig
from runner_core.errors import (CompileError, ConfigError, EngineBusyError, EngineNotReadyError, InvalidRequestError,
                                 ModelLoadError, RunnerError, WorkerError)
from runner_core.memory import MemoryEstimate, estimate_memory
from runner_core.model_runner import ModelRunner, StreamDelta
from runner_core.parallel.plan import ParallelSuggestion, suggest_parallel_config
from runner_core.sampling_params import SamplingParams
from runner_core.engine.sequence import RequestOutput

__version__ = "0.1.0"

__all__ = [
    "CompileError", "MemoryEstimate", "estimate_memory", "ConfigError", "EngineBusyError", "EngineNotReadyError", "InvalidRequestError", "ModelLoadError", "ModelRunner",
    "ParallelSuggestion", "RequestOutput", "RunnerConfig", "RunnerError", "SamplingParams", "StreamDelta",
    "WorkerError", "suggest_parallel_config",
]
