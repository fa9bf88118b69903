"""runner_core: a paged-KV, continuously batched LLM engine behind the ModelRunner API.

The folders are the boxes of the article it is built from: `model_runner` (ModelRunner, the
façade), `model_loader` (ModelLoader), `engine/` (ForwardPass and the step loop), `compile/`
(CompileOptimizer), `memory/` (MemoryManager), `parallel/` (ParallelManager), `models/`
(ModelAdapterRegistry); `layers/` and `kernels/` are their building blocks. ARCHITECTURE.md maps them.
"""

from runner_core import openmp_env  # noqa: F401  (first: OpenMP's wait policy is read when torch loads)
from runner_core.config import RunnerConfig, project_version
from runner_core.engine import CompletionOutput, RequestMetrics, RequestOutput
from runner_core.errors import (
                                CompileError,
                                ConfigError,
                                EngineBusyError,
                                EngineNotReadyError,
                                InvalidRequestError,
                                ModelLoadError,
                                RunnerError,
                                WorkerError,
)
from runner_core.memory import MemoryEstimate, estimate_memory
from runner_core.model_runner import ModelRunner, StreamDelta
from runner_core.models import MODEL_REGISTRY, register_model
from runner_core.parallel.plan import ParallelSuggestion, suggest_parallel_config
from runner_core.sampling_params import SamplingParams, StructuredOutputsParams
from runner_core.tuning import SweepSpace, Target, Workload, tune

__version__ = project_version()


def supported_architectures() -> dict[str, str]:
    """Architecture name -> "native" or "transformers": what `model_impl="auto"` runs and by which path."""
    return MODEL_REGISTRY.supported_architectures()


__all__ = [
    "CompileError", "CompletionOutput", "ConfigError", "EngineBusyError", "EngineNotReadyError", "InvalidRequestError",
    "MemoryEstimate", "ModelLoadError", "ModelRunner", "ParallelSuggestion", "RequestMetrics", "RequestOutput",
    "RunnerConfig", "RunnerError", "SamplingParams", "StreamDelta", "StructuredOutputsParams", "SweepSpace", "Target",
    "WorkerError", "Workload",
    "estimate_memory", "register_model", "suggest_parallel_config", "supported_architectures", "tune",
]
