"""`Session`: one long-lived object per kernel (`Session.current()`), the façade over its parts in
workbench/runtime/: the engine thread and its pace (engine_thread.py), the loaded models and their
compile switch (loaded_models.py), request routing (routing.py), the metrics series and step records
(metrics.py), the demo workload (workload.py) and its background jobs (jobs.py). It does not know
its views; a view takes a session.

runner_core is not thread-safe, so every call into a runner happens on the engine thread:
public methods either post a command to it (and wait for the answer when asked to) or read
state the engine thread published.

    s = Session.current()
    s.load_model("tiny-llama", dtype="float32", kv_cache_memory=16 << 20)
    h = s.submit("Once upon a time", max_tokens=32, temperature=0.8)
    for piece in h.stream(): print(piece, end="")
    s.set_compile_mode(True, backend="inductor")   # refused while generations run (or when_idle=True)
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from runner_core import RequestOutput, RunnerConfig, SamplingParams
from workbench.runtime.engine_thread import EngineThread
from workbench.runtime.handles import RequestHandle, SessionError
from workbench.runtime.jobs import Jobs
from workbench.runtime.loaded_models import LoadedModels, ModelEntry
from workbench.runtime.metrics import MetricsSeries, Telemetry
from workbench.runtime.routing import Router
from workbench.runtime.stats import Stats
from workbench.runtime.workload import DEMO, random_requests

logger = logging.getLogger("workbench")

_CURRENT: Session | None = None
_CURRENT_LOCK = threading.Lock()


class Session:
    """Loaded models (one active), an engine thread, request handles and metrics.

    `sample_interval` (s): steps are folded into one metrics row per interval; `history`:
    rows kept. Construct directly for an isolated session, or use `Session.current()`.
    """

    def __init__(self, *, sample_interval: float = 0.1, history: int = 3000):
        self._telemetry = Telemetry(history=history, sample_interval=sample_interval)
        self._thread = EngineThread(advance=self._advance, has_work=self._has_work)
        self._models = LoadedModels(self._thread, self._telemetry)
        self._router = Router(self._thread, self._models, self._telemetry)
        self._api_servers: list = []  # serve_api's servers, stopped at close()
        self._jobs = Jobs()  # the latest background job of each kind (tune's, whatif's)
        self._thread.start()

    @classmethod
    def current(cls) -> Session:
        """The kernel's session, created on first use; re-running a cell gets the same one."""
        global _CURRENT
        with _CURRENT_LOCK:
            if _CURRENT is None or _CURRENT.closed:
                _CURRENT = cls()
            return _CURRENT

    # ---- state, readable from any thread ---------------------------------------------------
    @property
    def metrics(self) -> MetricsSeries:
        return self._telemetry.series

    @property
    def sample_interval(self) -> float:
        return self._telemetry.sample_interval

    @sample_interval.setter
    def sample_interval(self, seconds: float) -> None:
        self._telemetry.sample_interval = seconds

    @property
    def last_error(self) -> str | None:
        return self._telemetry.last_error

    @property
    def closed(self) -> bool:
        return self._thread.closed

    @property
    def models(self) -> dict[str, ModelEntry]:
        return self._models.entries

    @property
    def active(self) -> str | None:
        return self._models.active

    @property
    def active_model(self) -> ModelEntry | None:
        active = self._models.active
        return self._models.get(active) if active else None

    @property
    def loading(self) -> str | None:
        return self._models.loading

    def entry(self, model: str | None = None) -> ModelEntry:
        """The loaded model `model` (the active one by default); SessionError naming the loaded ones."""
        return self._models.entry(model)

    def on_engine_thread(self, fn) -> Future:
        """Run `fn()` on the engine thread between steps; its result (or exception) in the Future."""
        return self._thread.call(fn)

    def record_event(self, kind: str, **fields) -> dict:
        """Add an event to the session's record (`metrics.events()`)."""
        return self._telemetry.event(kind, **fields)

    def inflight(self, model: str | None = None) -> list[RequestHandle]:
        return self._router.inflight(model)

    @property
    def busy(self) -> bool:
        return bool(self.inflight()) or self.loading is not None or any(
            e.status == "compiling" for e in self.models.values())

    @property
    def status(self) -> str:
        """One line for a status bar."""
        if self.closed:
            return "closed"
        if self.loading:
            return f"loading {self.loading}…"
        models = self.models
        compiling = [e.name for e in models.values() if e.status == "compiling"]
        if compiling:
            return f"compiling {compiling[0]}…"
        n = len(self.inflight())
        if n:
            return f"generating: {n} request{'s' * (n != 1)} in flight"
        if not models:
            return "no model loaded"
        return f"idle — active model: {self.active}"

    def block_map(self, model: str | None = None) -> dict | None:
        """Latest KV block ownership snapshot of `model` (default: the active one)."""
        return self._telemetry.block_map(model or self.active or "")

    def memory(self) -> dict[str, dict]:
        """Last memory figures of every loaded model (no engine call)."""
        return {name: dict(e.memory) for name, e in self.models.items()}

    # ---- the engine loop's work ----------------------------------------------------------------
    def _has_work(self) -> bool:
        return any(e.ready and (e.runner.has_unfinished_requests() or self._router.has_backlog(e.name)
                                or e.pending_compile) for e in self._models.entries.values())

    def _advance(self) -> None:
        """One pass over the models: a due compile switch, then held requests, then one step."""
        for entry in self._models.entries.values():
            if not entry.ready:
                continue
            self._models.apply_pending_compile(entry)
            if not entry.pending_compile:
                self._router.release_backlog(entry)
            if entry.runner.has_unfinished_requests():
                self._telemetry.begin_step(entry)
                if self._router.step(entry):  # a paced or single-stepped step is shown at once
                    self._telemetry.end_step(entry, flush=self._thread.paused or self._thread.interval > 0)

    # ---- models ----------------------------------------------------------------------------
    def load_model(self, model: str, *, name: str | None = None, activate: bool = True, wait: bool = True,
                   **config) -> ModelEntry | Future:
        """Load `model` (a preset name or a local Hugging Face directory) with RunnerConfig
        fields `config`, on the engine thread. Returns the ModelEntry (or a Future of it with
        wait=False). Loading an already loaded name with the same config just activates it."""
        spec = str(model)
        cfg = RunnerConfig.coerce({"model": spec, **config})  # ConfigError here, in the caller
        fut = self._models.load(name or spec, cfg, activate)
        return fut.result() if wait else fut

    def use(self, name: str) -> ModelEntry:
        """Make a loaded model the active one (where submit and the charts go by default)."""
        return self._models.use(name)

    def unload(self, name: str | None = None, *, wait: bool = True) -> dict | Future:
        """Unload a model (default: the active one), aborting its requests, and free its memory.
        Returns {"name", "freed_bytes"} (a `Stats`: it prints as a table)."""
        entry = self._models.entry(name)

        def unload():
            self._router.drop_model(entry)
            return self._models.unload(entry)

        fut = self._thread.call(unload)
        return Stats(fut.result(), f"unloaded {entry.name}") if wait else fut

    def set_compile_mode(self, compile: bool = True, backend: str | None = None, mode: str | None = None, *,
                         scope: str | None = None, model: str | None = None, when_idle: bool = False,
                         wait: bool = True):
        """Switch torch.compile on or off (backend, mode, scope: model, layer, mlp, self_attn) on
        a loaded model, through the runner's compile cache, without reloading weights.

        While generations run on the model the switch is refused with SessionBusyError, or, with
        when_idle=True, queued until they finish (new requests wait for it). Returns
        runner.compile_stats() as a `Stats` table (or a Future of the dict with wait=False)."""
        entry = self._models.entry(model)
        settings = {"compile": bool(compile), "backend": backend, "mode": mode, "scope": scope}
        fut = self._models.set_compile_mode(entry, settings, running=len(self.inflight(entry.name)),
                                            has_backlog=lambda: self._router.has_backlog(entry.name),
                                            when_idle=when_idle)
        return Stats(fut.result(), f"compile stats of {entry.name}") if wait else fut

    def reconfigure(self, model: str | None = None, *, wait: bool = True, by_sweep: bool = False, **fields):
        """Change scheduler, KV-pool or compile settings of a loaded model without reloading its weights
        (max_num_seqs, max_num_batched_tokens; block_size, kv_cache_memory, enable_prefix_caching; compile
        settings), on the engine thread; refused while its generations run. Returns the runner's answer
        ({"changed", "rebuilt", "seconds", "kv_tokens"}) as a `Stats` table (or a Future with wait=False)."""
        entry = self._models.entry(model)
        fut = self._models.reconfigure(entry, fields, running=len(self.inflight(entry.name)), by_sweep=by_sweep)
        return Stats(fut.result(), f"reconfigured {entry.name}") if wait else fut

    def compile_stats(self, model: str | None = None) -> Stats:
        """The runner's `compile_stats()` (a dict that prints as a table, figures rounded)."""
        entry = self._models.entry(model)
        return Stats(self._thread.call(lambda: dict(entry.runner.compile_stats())).result(),
                     f"compile stats of {entry.name}")

    def memory_stats(self, model: str | None = None) -> Stats:
        """Fresh `memory_stats()` of a model, read on the engine thread (a dict that prints as a
        table: bytes in MiB, fractions in %)."""
        entry = self._models.entry(model)
        return Stats(self._thread.call(lambda: entry.runner.memory_stats()).result(), f"memory of {entry.name}")

    def defragment(self, model: str | None = None, shrink_to_blocks: int | None = None) -> Stats:
        entry = self._models.entry(model)

        def run():
            result = entry.runner.defragment(shrink_to_blocks)
            self._telemetry.record(entry)
            self._telemetry.event("defragment", model=entry.name, **result)
            return result

        return Stats(self._thread.call(run).result(), f"defragmented {entry.name}")

    # ---- generation ----------------------------------------------------------------------------
    def submit(self, prompt, *, model: str | None = None, sampling_params: SamplingParams | None = None,
               **sampling) -> RequestHandle:
        """Queue a generation and return its handle at once. Bad sampling values and a missing
        model raise here; a prompt the engine refuses fails the handle (result() raises)."""
        params = sampling_params or SamplingParams(**sampling)
        if sampling_params is not None and sampling:
            params = params.replace(**sampling)
        return self._router.submit(self._models.entry(model), prompt, params)

    def generate(self, prompt, *, timeout: float | None = None, **kwargs) -> RequestOutput:
        """Blocking generation: the final RequestOutput (raises the request's error). A timeout or an
        interrupt (Jupyter's stop button) aborts the request, frees its KV blocks, and re-raises."""
        handle = self.submit(prompt, **kwargs)
        try:
            return handle.result(timeout)
        except (TimeoutError, KeyboardInterrupt):
            handle.cancel()
            raise

    def run_workload(self, n: int = DEMO["n"], *, seed: int | None = None, model: str | None = None,
                     **options) -> list[RequestHandle]:
        """Send `n` random requests arriving over a few seconds (`options`, workload.DEMO's keys: rate (a
        second; 0: all at once), prompt_words, max_tokens, temperature, shared_prefix, ignore_eos), so
        that continuous batching, blocks allocated, shared and freed, and preemption can be watched. The
        handles come back at once; each request reaches the engine at its arrival."""
        requests = random_requests(seed=seed, **{**DEMO, **options, "n": n})
        params = [SamplingParams(**r.sampling()) for r in requests]  # a bad value raises here, before any is sent
        return self._router.submit_many(self._models.entry(model),
                                        [(r.prompt, p, r.arrival) for r, p in zip(requests, params, strict=True)])

    # ---- a run step by step (a teaching mode: the steps compute what they would unpaced) ----------------
    def pace(self, seconds: float) -> None:
        """Wait `seconds` (0 to 10) between engine steps, for every request (the API's too); 0: full speed."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 10:
            raise SessionError(f"pace must be a number of seconds in [0, 10], got {seconds!r}")
        self._thread.set_pace(seconds)

    def pause(self) -> None:
        """Stop stepping (requests and commands are still taken); step() runs one step, resume() goes on."""
        self._thread.pause()

    def resume(self) -> None:
        self._thread.resume()

    def step(self, timeout: float | None = 30.0) -> bool:
        """While paused: run one engine step and return once it has (False: nothing to run). Unpaused: True."""
        return self._thread.step().result(timeout)

    @property
    def paused(self) -> bool:
        return self._thread.paused

    def steps(self, model: str | None = None) -> tuple[list, list]:
        """The step records (runner_core StepMetrics) and step details (StepDetail: requests and blocks) of
        `model` (the active one by default), as last published by the engine thread."""
        return self._telemetry.steps(model or self.active or "")

    def run_load(self, workload=None, *, target=None, model: str | None = None):
        """Run a tuning workload (runner_core.tuning.Workload: arrivals x lengths x sampling) against a loaded
        model, blocking the caller (not the engine): a RunResult with one record per request (TTFT, TPOT,
        inter-token latencies, end to end) and the run's summary (percentiles, throughput, goodput)."""
        from workbench.tuning import run_load

        return run_load(self, workload, target=target, model=model)

    def tune(self, space=None, workload=None, *, target=None, model: str | None = None, **options):
        """Start a sweep of `space` (runner_core.tuning.SweepSpace; None: proposed from the KV capacity) with
        `workload` under `target` (default: p99 time per output token ≤ 100 ms) on a loaded model, in the
        background: returns a TuneJob (progress, rows so far, result(), cancel()). Scheduler knobs change live,
        without reloading weights. `options`: repeats, warmup, results (a .csv/.json path that resumes). The session
        keeps it (`latest_job("sweep")`) and cancels it at close()."""
        from workbench.tuning import TuneJob

        return TuneJob.start(self, space, workload, target=target, model=model, **options)

    def whatif(self, model: str, layouts, workload=None, *, target=None, band: bool = True, **options):
        """Simulate `model` (a catalogue name: a config-only model such as "llama-3-70b" or a preset; a
        directory with config.json, or a loaded model's name) serving `workload` on each of `layouts` (e.g.
        [{"hardware": "h200", "tensor_parallel_size": 8}]): the engine's scheduler on a virtual clock, no
        weights loaded, this session's engine and models untouched. In the background like tune(): returns a
        WhatifJob (progress, rows, points with "band_low"/"band_high", skipped layouts, result(), cancel()).
        `options`: space, repeats, results, and RunnerConfig fields of the simulated runners (dtype, ...). The session
        keeps it (`latest_job("what-if")`) and cancels it at close()."""
        from workbench.whatif.job import WhatifJob

        return WhatifJob.start(self, model, layouts, workload, target=target, band=band, **options)

    def keep_job(self, kind: str, start):
        """Keep the job `start()` builds and launches as the session's latest of `kind` (a TuneJob's "sweep", a
        WhatifJob's "what-if"; see latest_job), cancelled at close(). SessionBusyError while the latest of that kind
        still runs."""
        return self._jobs.keep(kind, start)

    def latest_job(self, kind: str):
        """The latest job of `kind` ("sweep": tune()'s, "what-if": whatif()'s), running or finished, or None."""
        return self._jobs.latest(kind)

    def serve_api(self, port: int = 0, *, host: str = "127.0.0.1", api_key: str | None = None, limits=None):
        """Serve an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions, /health,
        /metrics) over this session's models from a background thread; the notebook stays free and the
        dashboards show the served traffic. Loopback by default; any other host needs `api_key`. `limits`:
        a `workbench.api.ApiLimits` or a dict of its fields (None: its defaults). Returns the ApiServer
        (.url, .limits, .stop())."""
        from workbench.api import serve_api

        server = serve_api(self, port=port, host=host, api_key=api_key, limits=limits)
        self._api_servers.append(server)
        return server

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every request has finished and queued commands ran; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for h in self.inflight():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not h.wait(left):
                    return False
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._thread.call(lambda: None).result(left)
            except TimeoutError:
                return False
            if not self.inflight():
                return True

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self, job_timeout: float = 30.0) -> None:
        """Cancel the session's jobs (a sweep, a what-if; each waited for up to `job_timeout` s), stop its API
        servers, unload every model and stop the engine thread."""
        if self.closed:
            return
        self._jobs.cancel_all(job_timeout)
        for server in self._api_servers:
            server.stop()
        for name, entry in self.models.items():
            try:
                if entry.status != "loading":
                    self.unload(name)
            except Exception:
                logger.exception("unloading %s at close failed", name)
        self._thread.close()

    def __repr__(self) -> str:
        return f"<workbench.Session: {self.status}; models: {', '.join(self.models) or 'none'}>"
