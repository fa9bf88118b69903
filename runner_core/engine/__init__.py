"""The engine: ForwardPass and the loop around it (the seed's ForwardPass box and the step).

* `engine.LLMEngine` (rank 0): requests, the step loop, sampling, outputs;
* `scheduler.Scheduler`: continuous batching (chunked prefill, preemption by recompute);
* `sequence`: a request's state (`Sequence`), its timing record (`RequestMetrics`) and what callers get
  back (`RequestOutput`, its `CompletionOutput`s);
* `parallel_sampling`: a request with n or best_of > 1, forked after its prompt over shared KV blocks;
* `input_batch`: a step's batch (`StepBatch`) and the persistent buffers it is written into
  (`InputBuffers`);
* `forward_pass`: the filled buffers as the model's input, once per step, and the model call;
* `worker.Worker`: every rank's model, KV pool, forward pass and compile mode, run by an executor;
* `output_processor`: appending tokens, stop conditions, outputs;
* `step_metrics`: the per-step observer and its records.
"""

from runner_core.engine.engine import LLMEngine
from runner_core.engine.forward_pass import ForwardPass, ModelInput
from runner_core.engine.input_batch import InputBuffers, StepBatch
from runner_core.engine.scheduler import Scheduler, SchedulerOutput
from runner_core.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput, Sequence, SequenceStatus
from runner_core.engine.step_metrics import StepMetrics, StepObserver
from runner_core.engine.worker import Executor, LocalExecutor, Worker

__all__ = ["CompletionOutput", "Executor", "ForwardPass", "InputBuffers", "LLMEngine", "LocalExecutor", "ModelInput",
           "RequestMetrics", "RequestOutput", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus", "StepBatch",
           "StepMetrics", "StepObserver", "Worker"]
