"""The models a session holds: `ModelEntry` per model, loading and unloading runners, which one
is active (the one loading), the compile switch (refused while generations run, or queued
until they finish with when_idle=True) and live reconfiguration of scheduler, pool and compile
settings (refused while generations run). Runner calls go through the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from runner_core import ModelRunner, RunnerConfig
from runner_core.process_memory import release_freed_memory
from workbench.runtime.engine_thread import EngineThread, run_into
from workbench.runtime.handles import NoModelError, SessionBusyError, SessionError
from workbench.runtime.metrics import StepAccumulator, Telemetry

logger = logging.getLogger("workbench")


@dataclass(frozen=True)
class PendingCompile:
    """A compile switch waiting for the model's generations to finish."""

    settings: dict  # compile, backend, mode, scope
    future: Future


@dataclass(eq=False)
class ModelEntry:
    """A model the session holds. `status`: loading, ready, compiling (unloaded once gone).
    `memory` is the last `memory_stats()` the engine thread read (safe to read from any thread)."""

    name: str
    config: RunnerConfig
    runner: ModelRunner | None
    status: str = "loading"
    load_seconds: float | None = None
    memory: dict = field(default_factory=dict)
    compile: dict = field(default_factory=dict)
    pending_compile: PendingCompile | None = None
    acc: StepAccumulator | None = None
    sweeping: bool = False  # a sweep (session.tune) drives its settings: compile switch and reconfigure refused
    watching: bool = False  # each step's detail and KV waste recorded, for the step view (watch_steps)

    def watch_steps(self, enabled: bool) -> None:
        """Record (or stop recording) each step's detail and KV waste figures: the step view's data, at a
        cost to each step (a pass over the pool's blocks and the running requests). Engine thread only."""
        self.runner.record_step_detail(enabled)
        self.runner.record_waste_per_step(enabled)
        self.watching = enabled

    @property
    def weights_bytes(self) -> int:
        return int(self.memory.get("weights_bytes", 0))

    @property
    def kv_pool_bytes(self) -> int:
        return int(self.memory.get("kv_pool_bytes", 0))

    @property
    def ready(self) -> bool:
        """Loaded, not compiling: the engine thread may step it."""
        return self.runner is not None and self.status == "ready" and self.runner.engine is not None

    def read_memory(self) -> dict:
        """Fresh memory figures from the runner (engine thread)."""
        self.memory = self.runner.memory_stats()
        return self.memory

    def _engine_info(self, key: str):
        """model_info[key] of the model's engine (None before its engine exists)."""
        engine = self.runner.engine if self.runner is not None else None
        return engine.model_info.get(key) if engine is not None else None

    def weights_storage(self) -> dict | None:
        """How the weights are stored (model_info's "quantization", with the compute "dtype"); None before
        the engine exists."""
        info = self._engine_info("quantization")
        return None if info is None else {**info, "dtype": self._engine_info("dtype")}

    def threads_line(self) -> str:
        """The CPU thread choice of the model's engine in words ("" before its engine exists)."""
        info = self._engine_info("threads")
        if not info:
            return ""
        return f"CPU threads: {info['count']} of {info['usable_cores']} usable cores, {info['policy']} ({info['why']})"

    def kernels_line(self) -> str:
        """The native CPU kernels' tier the engine loaded with, and why ("" before it exists, or off the CPU)."""
        info = self._engine_info("cpu_kernels")
        return f"CPU kernels: {info['tier']} ({info['why']})" if info else ""

    def engine_lines(self) -> list[str]:
        """What the dashboards show under the model: its CPU threads and kernel tier (those that apply)."""
        return [line for line in (self.threads_line(), self.kernels_line()) if line]

    def summary(self) -> dict:
        return {"name": self.name, "model": self.config.model, "status": self.status,
                "dtype": self.config.dtype, "device": str(self.config.torch_device),
                "weights_bytes": self.weights_bytes, "kv_pool_bytes": self.kv_pool_bytes,
                "load_seconds": self.load_seconds, **{f"compile_{k}": v for k, v in self.compile.items()}}

    def __repr__(self) -> str:
        return (f"<ModelEntry {self.name!r} {self.status}: weights {self.weights_bytes / 2**20:.1f} MiB, "
                f"KV pool {self.kv_pool_bytes / 2**20:.1f} MiB>")


class LoadedModels:
    """Owns the entries, the active name and the loading name (read from any thread under a lock)."""

    def __init__(self, thread: EngineThread, telemetry: Telemetry):
        self._thread = thread
        self._telemetry = telemetry
        self._entries: dict[str, ModelEntry] = {}
        self._active: str | None = None
        self._loading: str | None = None
        self._lock = threading.RLock()

    # ---- state ------------------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, ModelEntry]:
        with self._lock:
            return dict(self._entries)

    @property
    def active(self) -> str | None:
        return self._active

    @property
    def loading(self) -> str | None:
        return self._loading

    def get(self, name: str) -> ModelEntry | None:
        with self._lock:
            return self._entries.get(name)

    def entry(self, name: str | None) -> ModelEntry:
        """The loaded model `name` (default: the active one); a clear error when there is none."""
        with self._lock:
            target = name or self._active
            if target is None:
                if self._loading:
                    raise SessionBusyError(f"{self._loading!r} is still loading; wait for it to finish")
                raise NoModelError("no model is loaded; load one first (session.load_model('tiny-llama') "
                                   "or the Load button)")
            entry = self._entries.get(target)
            if entry is None:
                loaded = ", ".join(self._entries) or "none"
                raise NoModelError(f"model {target!r} is not loaded (loaded: {loaded})")
            if entry.status == "loading":
                raise SessionBusyError(f"{target!r} is still loading; wait for it to finish")
            return entry

    # ---- load, activate, unload ---------------------------------------------------------------
    def load(self, name: str, config: RunnerConfig, activate: bool) -> Future:
        """A Future of the entry, loading on the engine thread; a done one when `name` is loaded
        already with the same config (activated then)."""
        with self._lock:
            if self._loading is not None:
                raise SessionBusyError(f"{self._loading!r} is still loading; wait for it to finish before "
                                       "loading another model")
            existing = self._entries.get(name)
            if existing is not None:
                if existing.config.to_dict() != config.to_dict():
                    diff = ", ".join(f"{k}={v!r}" for k, v in existing.config.to_dict().items()
                                     if config.to_dict()[k] != v)
                    raise SessionError(f"a model named {name!r} is already loaded with {diff}; unload it "
                                       "first, or pass name=... to load this one alongside it")
                if activate:
                    self._active = name
                fut: Future = Future()
                fut.set_result(existing)
                return fut
            entry = ModelEntry(name=name, config=config, runner=ModelRunner(config))
            self._entries[name] = entry
            self._loading = name
        return self._thread.call(lambda: self._load(entry, activate))

    def _load(self, entry: ModelEntry, activate: bool) -> ModelEntry:
        t0 = time.perf_counter()
        try:
            entry.runner.load_model()
        except Exception as exc:
            with self._lock:
                self._entries.pop(entry.name, None)
                self._loading = None
            entry.runner = None
            self._telemetry.note_error(str(exc))
            self._telemetry.event("error", model=entry.name, message=f"loading failed: {exc}")
            raise
        entry.load_seconds = time.perf_counter() - t0
        cfg = entry.runner.config
        entry.compile = {"enabled": cfg.compile, "backend": cfg.compile_backend, "mode": cfg.compile_mode,
                         "scope": cfg.compile_scope}
        entry.acc = self._telemetry.accumulator(entry.name)
        entry.watch_steps(True)
        entry.status = "ready"
        with self._lock:
            self._loading = None
            if activate or self._active is None:
                self._active = entry.name
        self._telemetry.record(entry)
        self._telemetry.event("load", model=entry.name, seconds=entry.load_seconds,
                              weights_bytes=entry.weights_bytes, kv_pool_bytes=entry.kv_pool_bytes)
        logger.info("loaded %s in %.1f s", entry.name, entry.load_seconds)
        return entry

    def use(self, name: str) -> ModelEntry:
        with self._lock:
            entry = self.entry(name)
            self._active = name
            return entry

    def unload(self, entry: ModelEntry) -> dict:
        """Shut the runner down and forget the model (engine thread; its requests are gone already)."""
        if entry.pending_compile:
            entry.pending_compile.future.set_exception(SessionError(f"model {entry.name!r} was unloaded"))
            entry.pending_compile = None
        freed = entry.weights_bytes + entry.kv_pool_bytes
        entry.runner.shutdown()
        entry.runner = None
        entry.status = "unloaded"
        with self._lock:
            self._entries.pop(entry.name, None)
            self._telemetry.forget(entry.name)
            if self._active == entry.name:
                self._active = next(iter(self._entries), None)
        release_freed_memory()  # the runner's last references are gone only now
        self._telemetry.event("unload", model=entry.name, freed_bytes=freed)
        return {"name": entry.name, "freed_bytes": freed}

    # ---- the compile switch -------------------------------------------------------------------------
    def set_compile_mode(self, entry: ModelEntry, settings: dict, *, running: int,
                         has_backlog: Callable[[], bool], when_idle: bool) -> Future:
        """Switch compilation of `entry` (settings: compile, backend, mode, scope). `running`: its
        generations in flight; `has_backlog()`: whether requests wait for it (engine thread)."""
        if entry.status == "compiling" or entry.pending_compile:
            raise SessionBusyError(f"a compile mode switch of {entry.name!r} is already in progress; wait for it")
        if entry.sweeping:
            raise SessionBusyError(f"a sweep (session.tune) is setting the compile mode of {entry.name!r}; cancel it "
                                   "(job.cancel()) or wait for it (job.result()), then switch")
        if running and not when_idle:
            raise SessionBusyError(
                f"cannot switch the compile mode of {entry.name!r} while {running} generation"
                f"{'s are' if running > 1 else ' is'} running on it; wait for them (session.wait_idle()), "
                "cancel them, or pass when_idle=True to switch as soon as they finish")
        fut: Future = Future()

        def queue_it():
            if entry.runner is None:
                fut.set_exception(SessionError(f"model {entry.name!r} was unloaded"))
            elif entry.runner.has_unfinished_requests() or has_backlog():
                entry.pending_compile = PendingCompile(settings=settings, future=fut)
                entry.status = "ready"
                self._telemetry.event("compile_queued", model=entry.name, **settings)
            else:
                run_into(fut, lambda: self._apply_compile(entry, **settings))

        if not running:
            entry.status = "compiling"  # visible at once, and submissions wait for the switch
        self._thread.call(queue_it)
        return fut

    def apply_pending_compile(self, entry: ModelEntry) -> None:
        """Run a queued compile switch once the model has no unfinished requests (engine thread)."""
        pending = entry.pending_compile
        if pending and not entry.runner.has_unfinished_requests():
            entry.pending_compile = None
            run_into(pending.future, lambda: self._apply_compile(entry, **pending.settings))

    def _apply_compile(self, entry: ModelEntry, compile: bool, backend: str | None, mode: str | None,
                       scope: str | None) -> dict:
        entry.status = "compiling"
        t0 = time.perf_counter()
        try:
            entry.runner.set_compile_mode(compile, backend=backend, mode=mode, scope=scope)
        except Exception as exc:
            self._telemetry.note_error(f"compile mode switch failed: {exc}")
            self._telemetry.event("compile", model=entry.name, enabled=compile, backend=backend, mode=mode,
                                  seconds=time.perf_counter() - t0, ok=False, error=str(exc))
            raise
        finally:
            entry.status = "ready"
        seconds = time.perf_counter() - t0
        stats = dict(entry.runner.compile_stats())
        cfg = entry.runner.config
        entry.compile = {"enabled": stats.get("enabled", compile),
                         "backend": stats.get("backend") or backend or cfg.compile_backend,
                         "mode": stats.get("mode") or mode or cfg.compile_mode,
                         "scope": stats.get("scope") or scope or cfg.compile_scope}
        self._telemetry.event("compile", model=entry.name, enabled=compile, backend=entry.compile["backend"],
                              mode=entry.compile["mode"], scope=entry.compile["scope"], seconds=seconds, ok=True,
                              stats=stats)
        return stats

    # ---- live reconfiguration ------------------------------------------------------------------------
    def reconfigure(self, entry: ModelEntry, fields: dict, *, running: int, by_sweep: bool = False) -> Future:
        """Change RunnerConfig `fields` of a loaded model without reloading its weights, through
        `runner.reconfigure` on the engine thread (runner_core.config.RECONFIGURABLE lists them; others raise
        ConfigError saying they need a reload). `running`: its generations in flight: refused then, like the
        compile switch; refused too while a sweep drives the model, unless `by_sweep` (the sweep's own
        change). A Future of runner.reconfigure's answer ({"changed", "rebuilt", "seconds", ...})."""
        if entry.sweeping and not by_sweep:
            raise SessionBusyError(f"a sweep (session.tune) is setting {entry.name!r}; cancel it (job.cancel()) or "
                                   "wait for it (job.result()), then reconfigure")
        if entry.status == "compiling" or entry.pending_compile:
            raise SessionBusyError(f"a compile mode switch of {entry.name!r} is in progress; wait for it, then "
                                   "reconfigure")
        if running:
            raise SessionBusyError(
                f"cannot reconfigure {entry.name!r} while {running} generation{'s are' if running > 1 else ' is'} "
                "running on it; wait for them (session.wait_idle()) or cancel them")
        return self._thread.call(lambda: self._apply_reconfigure(entry, dict(fields)))

    def _apply_reconfigure(self, entry: ModelEntry, fields: dict) -> dict:
        if entry.runner is None:
            raise SessionError(f"model {entry.name!r} was unloaded")
        try:
            result = entry.runner.reconfigure(**fields)
        except Exception as exc:
            self._telemetry.note_error(f"reconfigure failed: {exc}")
            self._telemetry.event("reconfigure", model=entry.name, fields=fields, ok=False, error=str(exc))
            raise
        cfg = entry.config = entry.runner.config
        entry.compile = {"enabled": cfg.compile, "backend": cfg.compile_backend, "mode": cfg.compile_mode,
                         "scope": cfg.compile_scope}
        self._telemetry.record(entry)  # a fresh row: the pool's size and the settings as they are now
        self._telemetry.event("reconfigure", model=entry.name, changed=result["changed"], rebuilt=result["rebuilt"],
                              seconds=result["seconds"], ok=True)
        return result
