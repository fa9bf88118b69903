"""`Session`: one long-lived object per kernel that owns the loaded models, a background
engine thread, request handles and the metrics time series the dashboards draw.

runner_core is not thread-safe, so every call into a runner happens on the session's single
engine thread: public methods either post a command to it (and wait for the answer when
asked to) or read state the engine thread published. Views never touch a runner.

    s = Session.current()
    s.load_model("tiny-llama", dtype="float32", kv_cache_memory=16 << 20)
    h = s.submit("Once upon a time", max_tokens=32, temperature=0.8)
    for piece in h.stream(): print(piece, end="")
    s.set_compile_mode(True, backend="inductor")   # refused while generations run (or when_idle=True)
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from runner_core import ModelRunner, RequestOutput, RunnerConfig, SamplingParams

from workbench.handles import GenerationError, NoModelError, RequestHandle, SessionBusyError, SessionError
from workbench.metrics import MetricsSeries, StepAccumulator

logger = logging.getLogger("workbench")

_WORDS = ("the model reads a token and writes the next one while the scheduler packs many requests into "
          "one batch so that blocks of the cache fill and free as prompts of every length arrive and leave "
          "memory time river stone light paper window garden signal number story engine").split()


@dataclass(eq=False)
class ModelEntry:
    """A model the session holds. `status`: loading, ready, compiling. `memory` is the last
    `memory_stats()` the engine thread read (safe to read from any thread)."""

    name: str
    config: RunnerConfig
    runner: ModelRunner | None
    status: str = "loading"
    load_seconds: float | None = None
    memory: dict = field(default_factory=dict)
    compile: dict = field(default_factory=dict)
    backlog: list = field(default_factory=list)  # handles held while a compile switch is pending
    pending_compile: tuple | None = None  # (kwargs, future)
    acc: StepAccumulator | None = None
    last_memory_time: float = 0.0

    @property
    def weights_bytes(self) -> int:
        return int(self.memory.get("weights_bytes", 0))

    @property
    def kv_pool_bytes(self) -> int:
        return int(self.memory.get("kv_pool_bytes", 0))

    def summary(self) -> dict:
        return {"name": self.name, "model": self.config.model, "status": self.status,
                "dtype": self.config.dtype, "device": str(self.config.torch_device),
                "weights_bytes": self.weights_bytes, "kv_pool_bytes": self.kv_pool_bytes,
                "load_seconds": self.load_seconds, **{f"compile_{k}": v for k, v in self.compile.items()}}

    def __repr__(self) -> str:
        return (f"<ModelEntry {self.name!r} {self.status}: weights {self.weights_bytes / 2**20:.1f} MiB, "
                f"KV pool {self.kv_pool_bytes / 2**20:.1f} MiB>")


_CURRENT: "Session | None" = None
_CURRENT_LOCK = threading.Lock()


class Session:
    """Loaded models (one active), an engine thread, request handles and metrics.

    `sample_interval` (s): steps are folded into one metrics row per interval; `history`:
    rows kept. Construct directly for an isolated session, or use `Session.current()`.
    """

    def __init__(self, *, sample_interval: float = 0.1, history: int = 3000):
        self.metrics = MetricsSeries(maxlen=history)
        self.sample_interval = sample_interval
        self.last_error: str | None = None
        self._models: dict[str, ModelEntry] = {}
        self._active: str | None = None
        self._loading: str | None = None
        self._inflight: dict[tuple[str, str], RequestHandle] = {}
        self._block_maps: dict[str, dict] = {}
        self._lock = threading.RLock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="workbench-engine", daemon=True)
        self._thread.start()
        atexit.register(_close_ref, weakref.ref(self))

    # ---- the one session per kernel -------------------------------------------------------
    @classmethod
    def current(cls) -> "Session":
        """The kernel's session, created on first use; re-running a cell gets the same one."""
        global _CURRENT
        with _CURRENT_LOCK:
            if _CURRENT is None or _CURRENT._closed:
                _CURRENT = cls()
            return _CURRENT

    # ---- state, readable from any thread ---------------------------------------------------
    @property
    def models(self) -> dict[str, ModelEntry]:
        with self._lock:
            return dict(self._models)

    @property
    def active(self) -> str | None:
        return self._active

    @property
    def active_model(self) -> ModelEntry | None:
        with self._lock:
            return self._models.get(self._active) if self._active else None

    @property
    def loading(self) -> str | None:
        return self._loading

    def inflight(self, model: str | None = None) -> list[RequestHandle]:
        with self._lock:
            return [h for (m, _), h in self._inflight.items() if model is None or m == model]

    @property
    def busy(self) -> bool:
        return bool(self._inflight) or self._loading is not None or any(
            e.status == "compiling" for e in self.models.values())

    @property
    def status(self) -> str:
        """One line for a status bar."""
        if self._closed:
            return "closed"
        if self._loading:
            return f"loading {self._loading}…"
        models = self.models
        compiling = [e.name for e in models.values() if e.status == "compiling"]
        if compiling:
            return f"compiling {compiling[0]}…"
        n = len(self._inflight)
        if n:
            return f"generating: {n} request{'s' * (n != 1)} in flight"
        if not models:
            return "no model loaded"
        return f"idle — active model: {self._active}"

    def block_map(self, model: str | None = None) -> dict | None:
        """Latest KV block ownership snapshot of `model` (default: the active one)."""
        return self._block_maps.get(model or self._active or "")

    def memory(self) -> dict[str, dict]:
        """Last memory figures of every loaded model (no engine call)."""
        return {name: dict(e.memory) for name, e in self.models.items()}

    # ---- engine thread plumbing -----------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread; its result or exception lands in the Future."""
        if self._closed:
            raise SessionError("the session is closed; use Session.current() for a new one")
        fut: Future = Future()
        if threading.current_thread() is self._thread:
            _run_into(fut, fn)
        else:
            self._commands.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._drain(block=not self._has_work())
                for entry in list(self._models.values()):
                    self._advance(entry)
            except Exception:  # never let the engine thread die
                logger.exception("workbench engine loop error")
                time.sleep(0.05)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.25) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            _run_into(fut, fn)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _has_work(self) -> bool:
        for e in self._models.values():
            if e.runner is None or e.status != "ready" or e.runner.engine is None:
                continue
            if e.runner.has_unfinished_requests() or e.backlog or e.pending_compile:
                return True
        return False

    def _advance(self, entry: ModelEntry) -> None:
        runner = entry.runner
        if runner is None or entry.status != "ready" or runner.engine is None:
            return
        if entry.pending_compile and not runner.has_unfinished_requests():
            kwargs, fut = entry.pending_compile
            entry.pending_compile = None
            _run_into(fut, lambda: self._apply_compile(entry, **kwargs))
        if entry.backlog and not entry.pending_compile:
            backlog, entry.backlog = entry.backlog, []
            for handle in backlog:
                self._add(entry, handle)
        if not runner.has_unfinished_requests():
            return
        if entry.acc.steps == 0:  # a row covers busy time only, not the idle time before it
            entry.acc.start = time.perf_counter()
        try:
            outputs = runner.step()
        except Exception as exc:  # the model's requests fail; the session goes on
            logger.exception("step of %s failed", entry.name)
            self._fail_model_requests(entry, GenerationError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        for out in outputs:
            self._dispatch(entry.name, out)
        metrics = runner.step_metrics
        if metrics:
            entry.acc.add(metrics[-1])
        now = time.perf_counter()
        if now - entry.acc.start >= self.sample_interval or not runner.has_unfinished_requests():
            self._record(entry, now)

    def _record(self, entry: ModelEntry, now: float | None = None) -> None:
        """Flush the step accumulator into a metrics row, with fresh memory figures."""
        now = time.perf_counter() if now is None else now
        entry.memory = entry.runner.memory_stats()
        entry.last_memory_time = now
        self.metrics.append(entry.acc.flush(now, entry.memory))
        self._block_maps[entry.name] = self._snapshot_blocks(entry)

    def _snapshot_blocks(self, entry: ModelEntry) -> dict:
        snap = entry.runner.kv_block_map()
        snap["blocks_cached"] = entry.memory.get("blocks_cached", 0)
        snap["t"] = time.time() - self.metrics.t0
        snap["model"] = entry.name
        return snap

    def _dispatch(self, model: str, out: RequestOutput) -> None:
        key = (model, out.request_id)
        handle = self._inflight.get(key)
        if handle is None:
            return
        if out.finished:
            with self._lock:
                self._inflight.pop(key, None)
            if out.finish_reason == "error":
                self.last_error = out.error
        handle._push(out)

    def _fail_handle(self, handle: RequestHandle, exc: BaseException) -> None:
        with self._lock:
            self._inflight.pop((handle.model, handle.request_id), None)
        self.last_error = str(exc)
        handle._fail(exc)

    def _fail_model_requests(self, entry: ModelEntry, exc: BaseException) -> None:
        for handle in self.inflight(entry.name):
            if entry.runner is not None and entry.runner.engine is not None:
                entry.runner.abort_request(handle.request_id)
            self._fail_handle(handle, exc)
        entry.backlog = []
        self.metrics.add_event("error", model=entry.name, message=str(exc))

    # ---- models ----------------------------------------------------------------------------
    def load_model(self, model: str, *, name: str | None = None, activate: bool = True, wait: bool = True,
                   **config) -> ModelEntry | Future:
        """Load `model` (a preset name or a local Hugging Face directory) with RunnerConfig
        fields `config`, on the engine thread. Returns the ModelEntry (or a Future of it with
        wait=False). Loading an already loaded name with the same config just activates it."""
        spec = str(model)
        name = name or spec
        cfg = RunnerConfig.coerce({"model": spec, **config})  # ConfigError here, in the caller
        with self._lock:
            if self._loading is not None:
                raise SessionBusyError(f"{self._loading!r} is still loading; wait for it to finish before "
                                       "loading another model")
            existing = self._models.get(name)
            if existing is not None:
                if existing.config.to_dict() != cfg.to_dict():
                    diff = ", ".join(f"{k}={v!r}" for k, v in existing.config.to_dict().items()
                                     if cfg.to_dict()[k] != v)
                    raise SessionError(f"a model named {name!r} is already loaded with {diff}; unload it "
                                       "first, or pass name=... to load this one alongside it")
                if activate:
                    self._active = name
                fut: Future = Future()
                fut.set_result(existing)
                return existing if wait else fut
            entry = ModelEntry(name, cfg, ModelRunner(cfg))
            self._models[name] = entry
            self._loading = name
        fut = self._call(lambda: self._do_load(entry, activate))
        return fut.result() if wait else fut

    def _do_load(self, entry: ModelEntry, activate: bool) -> ModelEntry:
        t0 = time.perf_counter()
        try:
            entry.runner.load_model()
        except Exception as exc:
            with self._lock:
                self._models.pop(entry.name, None)
                self._loading = None
            entry.runner = None
            self.last_error = str(exc)
            self.metrics.add_event("error", model=entry.name, message=f"loading failed: {exc}")
            raise
        entry.load_seconds = time.perf_counter() - t0
        cfg = entry.runner.config
        entry.compile = {"enabled": cfg.compile, "backend": cfg.compile_backend, "mode": cfg.compile_mode,
                         "scope": getattr(cfg, "compile_scope", None)}
        entry.acc = StepAccumulator(entry.name, self.metrics.t0)
        entry.status = "ready"
        with self._lock:
            self._loading = None
            if activate or self._active is None:
                self._active = entry.name
        self._record(entry)
        self.metrics.add_event("load", model=entry.name, seconds=entry.load_seconds,
                               weights_bytes=entry.weights_bytes, kv_pool_bytes=entry.kv_pool_bytes)
        logger.info("loaded %s in %.1f s", entry.name, entry.load_seconds)
        return entry

    def use(self, name: str) -> ModelEntry:
        """Make a loaded model the active one (where submit and the charts go by default)."""
        with self._lock:
            entry = self._entry(name)
            self._active = name
            return entry

    def _entry(self, name: str | None) -> ModelEntry:
        with self._lock:
            target = name or self._active
            if target is None:
                if self._loading:
                    raise SessionBusyError(f"{self._loading!r} is still loading; wait for it to finish")
                raise NoModelError("no model is loaded; load one first (session.load_model('tiny-llama') "
                                   "or the Load button)")
            entry = self._models.get(target)
            if entry is None:
                loaded = ", ".join(self._models) or "none"
                raise NoModelError(f"model {target!r} is not loaded (loaded: {loaded})")
            if entry.status == "loading":
                raise SessionBusyError(f"{target!r} is still loading; wait for it to finish")
            return entry

    def unload(self, name: str | None = None, *, wait: bool = True) -> dict | Future:
        """Unload a model (default: the active one), aborting its requests, and free its memory.
        Returns {"name", "freed_bytes"}."""
        entry = self._entry(name)
        fut = self._call(lambda: self._do_unload(entry))
        return fut.result() if wait else fut

    def _do_unload(self, entry: ModelEntry) -> dict:
        for handle in list(entry.backlog):
            self._fail_handle(handle, SessionError(f"model {entry.name!r} was unloaded"))
        entry.backlog = []
        if entry.pending_compile:
            entry.pending_compile[1].set_exception(SessionError(f"model {entry.name!r} was unloaded"))
            entry.pending_compile = None
        for handle in self.inflight(entry.name):
            out = entry.runner.abort_request(handle.request_id)
            if out is not None:
                self._dispatch(entry.name, out)
            else:
                self._fail_handle(handle, SessionError(f"model {entry.name!r} was unloaded"))
        freed = entry.weights_bytes + entry.kv_pool_bytes
        entry.runner.shutdown()
        entry.runner = None
        entry.status = "unloaded"
        with self._lock:
            self._models.pop(entry.name, None)
            self._block_maps.pop(entry.name, None)
            if self._active == entry.name:
                self._active = next(iter(self._models), None)
        gc.collect()
        self.metrics.add_event("unload", model=entry.name, freed_bytes=freed)
        return {"name": entry.name, "freed_bytes": freed}

    # ---- compile mode ------------------------------------------------------------------------
    def set_compile_mode(self, compile: bool = True, backend: str | None = None, mode: str | None = None, *,
                         scope: str | None = None, model: str | None = None, when_idle: bool = False,
                         wait: bool = True):
        """Switch torch.compile on or off (backend, mode, scope: model, layer, mlp, self_attn) on
        a loaded model, through the runner's compile cache, without reloading weights.

        While generations run on the model the switch is refused with SessionBusyError, or, with
        when_idle=True, queued until they finish (new requests wait for it). Returns
        runner.compile_stats() (or a Future of it with wait=False)."""
        entry = self._entry(model)
        if not hasattr(entry.runner, "set_compile_mode"):
            raise SessionError("this runner_core has no ModelRunner.set_compile_mode yet; reload the model "
                               "with compile=True instead")
        kwargs = {"compile": bool(compile), "backend": backend, "mode": mode, "scope": scope}
        busy = len(self.inflight(entry.name))
        if entry.status == "compiling" or entry.pending_compile:
            raise SessionBusyError(f"a compile mode switch of {entry.name!r} is already in progress; wait for it")
        if busy and not when_idle:
            raise SessionBusyError(
                f"cannot switch the compile mode of {entry.name!r} while {busy} generation"
                f"{'s are' if busy > 1 else ' is'} running on it; wait for them (session.wait_idle()), "
                "cancel them, or pass when_idle=True to switch as soon as they finish")
        fut: Future = Future()

        def queue_it():
            if entry.runner is None:
                fut.set_exception(SessionError(f"model {entry.name!r} was unloaded"))
            elif entry.runner.has_unfinished_requests() or entry.backlog:
                entry.pending_compile = (kwargs, fut)
                entry.status = "ready"
                self.metrics.add_event("compile_queued", model=entry.name, **kwargs)
            else:
                _run_into(fut, lambda: self._apply_compile(entry, **kwargs))

        if not busy:
            entry.status = "compiling"  # visible at once, and submissions wait for the switch
        self._call(queue_it)
        return fut.result() if wait else fut

    def _apply_compile(self, entry: ModelEntry, compile: bool, backend: str | None, mode: str | None,
                       scope: str | None = None) -> dict:
        entry.status = "compiling"
        t0 = time.perf_counter()
        try:
            extra = {"scope": scope} if scope is not None else {}
            entry.runner.set_compile_mode(compile, backend=backend, mode=mode, **extra)
        except Exception as exc:
            self.last_error = f"compile mode switch failed: {exc}"
            self.metrics.add_event("compile", model=entry.name, enabled=compile, backend=backend, mode=mode,
                                   seconds=time.perf_counter() - t0, ok=False, error=str(exc))
            raise
        finally:
            entry.status = "ready"
        seconds = time.perf_counter() - t0
        stats = dict(entry.runner.compile_stats()) if hasattr(entry.runner, "compile_stats") else {}
        cfg = entry.runner.config
        entry.compile = {"enabled": stats.get("enabled", compile),
                         "backend": stats.get("backend") or backend or cfg.compile_backend,
                         "mode": stats.get("mode") or mode or cfg.compile_mode,
                         "scope": stats.get("scope") or scope or getattr(cfg, "compile_scope", None)}
        self.metrics.add_event("compile", model=entry.name, enabled=compile, backend=entry.compile["backend"],
                               mode=entry.compile["mode"], scope=entry.compile["scope"], seconds=seconds, ok=True,
                               stats=stats)
        return stats

    def compile_stats(self, model: str | None = None) -> dict:
        entry = self._entry(model)
        if not hasattr(entry.runner, "compile_stats"):
            return {}
        return self._call(lambda: dict(entry.runner.compile_stats())).result()

    # ---- generation ----------------------------------------------------------------------------
    def submit(self, prompt, *, model: str | None = None, sampling_params: SamplingParams | None = None,
               **sampling) -> RequestHandle:
        """Queue a generation and return its handle at once. Bad sampling values and a missing
        model raise here; a prompt the engine refuses fails the handle (result() raises)."""
        params = sampling_params or SamplingParams(**sampling)
        if sampling_params is not None and sampling:
            params = params.replace(**sampling)
        entry = self._entry(model)
        with self._lock:
            handle = RequestHandle(f"wb-{next(self._ids)}", entry.name, prompt, params, self._cancel)
            self._inflight[(entry.name, handle.request_id)] = handle
        self._call(lambda: self._add(entry, handle))
        return handle

    def _add(self, entry: ModelEntry, handle: RequestHandle) -> None:
        if entry.runner is None:
            return self._fail_handle(handle, SessionError(f"model {entry.name!r} was unloaded"))
        if entry.pending_compile or entry.status != "ready":
            entry.backlog.append(handle)
            return
        try:
            entry.runner.add_request(handle.prompt, handle.params, request_id=handle.request_id, stream=True)
        except Exception as exc:
            self._fail_handle(handle, exc)

    def generate(self, prompt, *, timeout: float | None = None, **kwargs) -> RequestOutput:
        """Blocking generation: the final RequestOutput (raises the request's error)."""
        handle = self.submit(prompt, **kwargs)
        try:
            return handle.result(timeout)
        except TimeoutError:
            handle.cancel()
            raise

    def _cancel(self, handle: RequestHandle) -> None:
        def abort():
            entry = self._models.get(handle.model)
            if entry is not None and handle in entry.backlog:
                entry.backlog.remove(handle)
                return self._dispatch(handle.model, _aborted(handle))
            out = entry.runner.abort_request(handle.request_id) if entry and entry.runner else None
            self._dispatch(handle.model, out or _aborted(handle))
            if out is not None and entry.status == "ready":
                self._record(entry)  # its blocks are free now: show it

        if not self._closed:
            self._call(abort)

    def run_workload(self, n: int = 16, *, prompt_words: tuple[int, int] = (4, 40),
                     max_tokens: tuple[int, int] = (8, 64), temperature: float = 0.8, seed: int | None = None,
                     model: str | None = None) -> list[RequestHandle]:
        """Fire `n` random requests at once (random prompt lengths and output lengths), so that
        continuous batching, block allocation and freeing can be watched."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise SessionError(f"workload size must be an int in [1, 1024], got {n!r}")
        rng = random.Random(seed)
        handles = []
        for _ in range(n):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(*prompt_words))]
            handles.append(self.submit(" ".join(words), model=model, max_tokens=rng.randint(*max_tokens),
                                       temperature=temperature, seed=rng.randrange(2**31)))
        return handles

    def memory_stats(self, model: str | None = None) -> dict:
        """Fresh `memory_stats()` of a model, read on the engine thread."""
        entry = self._entry(model)
        return self._call(lambda: entry.runner.memory_stats()).result()

    def defragment(self, model: str | None = None, shrink_to_blocks: int | None = None) -> dict:
        entry = self._entry(model)

        def run():
            result = entry.runner.defragment(shrink_to_blocks)
            self._record(entry)
            self.metrics.add_event("defragment", model=entry.name, **result)
            return result

        return self._call(run).result()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every request has finished and queued commands ran; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            handles = self.inflight()
            for h in handles:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not h.wait(left):
                    return False
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._call(lambda: None).result(left)
            except TimeoutError:
                return False
            if not self.inflight():
                return True

    # ---- views ------------------------------------------------------------------------------------
    def dashboard(self, inline_resources: bool = True, **kwargs):
        """The Panel dashboard of this session, displayable inline in JupyterLab (its JavaScript
        embedded, so it works offline; inline_resources=False loads it from a CDN)."""
        from workbench.panel_app import Dashboard

        return Dashboard(self, **kwargs).inline(inline_resources)

    def widgets(self, **kwargs):
        """Compact ipywidgets controls and live plotly charts for a notebook cell."""
        from workbench.widgets import WorkbenchWidgets

        return WorkbenchWidgets(self, **kwargs)

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Unload every model and stop the engine thread."""
        if self._closed:
            return
        for name in list(self._models):
            try:
                if self._models[name].status != "loading":
                    self.unload(name)
            except Exception:
                logger.exception("unloading %s at close failed", name)
        self._closed = True
        self._thread.join(timeout=5)
        while True:  # commands that arrived too late: answer them rather than leave callers waiting
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if not fut.done():
                fut.set_exception(SessionError("the session was closed"))

    def __repr__(self) -> str:
        return f"<workbench.Session: {self.status}; models: {', '.join(self._models) or 'none'}>"


def _run_into(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
        if not fut.done():
            fut.set_exception(exc)
    else:
        if not fut.done():
            fut.set_result(result)


def _aborted(handle: RequestHandle) -> RequestOutput:
    return RequestOutput(handle.request_id, handle.prompt if isinstance(handle.prompt, str) else None, [],
                         list(handle.token_ids), handle.text, [], "", True, "abort", None, None, None, {})


def _close_ref(ref: "weakref.ref[Session]") -> None:
    session = ref()
    if session is not None:
        session._closed = True  # at interpreter exit: just stop the thread
