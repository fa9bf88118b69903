"""Exception types of the runner: each names what went wrong and how to fix it."""


class RunnerError(Exception):
    """Base class of every error the runner raises on purpose."""


class ConfigError(RunnerError, ValueError):
    """A configuration field has a bad value, a bad type or an unknown name."""


class ModelLoadError(RunnerError):
    """A model directory, checkpoint, preset or tokenizer could not be loaded."""


class UnknownModelError(ModelLoadError, ValueError):
    """A model given by name or path is none of the catalogue's kinds (runner_core.models.catalogue)."""


class InvalidRequestError(RunnerError, ValueError):
    """One request (prompt or sampling parameters) is malformed; the engine is unaffected."""


class EngineNotReadyError(RunnerError):
    """An operation needs a loaded model (call `load_model()` first)."""


class EngineBusyError(RunnerError):
    """The operation needs an idle engine (no request in flight)."""


class CompileError(RunnerError):
    """torch.compile failed and `compile_fallback` is off."""


class WorkerError(RunnerError):
    """A parallel runner lost a worker (it died, hung or failed); every worker was shut down.
    Create a new ModelRunner to continue."""
