"""Load runs and the sweep's backend over a session: `run_load` (a runner_core.tuning Workload against a
loaded model, sent from the caller's thread at its arrival times, summarized from each request's RequestMetrics,
which its handle holds and the engine fills, as the in-process driver's) and `SessionBackend` (the TuneBackend
a sweep drives: live knobs through the engine thread, the rest by reloading the model under the same name).
"""

from __future__ import annotations

import threading
import time

from runner_core import ConfigError, RunnerConfig, SamplingParams
from runner_core.config import RECONFIGURABLE
from runner_core.tuning import RunResult, Target, Workload, summarize, vocab_and_tokenizer
from workbench.runtime.handles import RequestHandle

__all__ = ["DEFAULT_WORKLOAD", "SessionBackend", "run_load"]

DEFAULT_WORKLOAD = Workload(num_requests=16)
LIVE_FIELDS = frozenset(f for group in RECONFIGURABLE.values() for f in group)  # changed without a reload
_WAKE_S = 0.05  # how often a waiting run_load looks at its stop event
OTHERS_WAIT_S = 60.0  # how long a sweep's change waits for requests others sent to the model


def run_load(session, workload: Workload | None = None, *, target: Target | None = None, model: str | None = None,
             stop: threading.Event | None = None) -> RunResult:
    """Send `workload`'s requests to a loaded model at their arrival times (a fixed concurrency keeps that many
    in flight), wait for them, and summarize the run, with the step view's recording off while it runs (as
    the engine runs unwatched). Blocks the calling thread, never the engine thread.
    `stop` (set from another thread) cancels the requests in flight and returns the records so far; an
    interrupt (Jupyter's stop button) cancels them and re-raises."""
    workload = DEFAULT_WORKLOAD if workload is None else workload
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a runner_core.tuning.Workload, not {type(workload).__name__}; "
                        "build one with Workload(num_requests=..., arrivals=Arrivals.poisson(4.0), ...)")
    entry = session.entry(model)
    runner = entry.runner
    vocab_size, tokenizer = session.on_engine_thread(lambda: vocab_and_tokenizer(runner)).result()
    requests = workload.requests(vocab_size, tokenizer)
    params = [SamplingParams(**r.sampling) for r in requests]  # a bad value raises here, before any request goes
    settings = {**entry.config.to_dict(), "name": entry.name}
    session.record_event("load_start", model=entry.name, workload=workload.label, num_requests=len(requests))
    watching = entry.watching  # a measured run records no step detail (it costs each step)
    session.on_engine_thread(lambda: entry.watch_steps(False)).result()
    try:
        sent, t0 = _send(session, entry.name, requests, params, workload.arrivals.concurrency, stop)
        duration = time.perf_counter() - t0
    finally:
        if entry.runner is not None:
            session.on_engine_thread(lambda: entry.watch_steps(watching)).result()
    records = [h.metrics for h in sent]
    summary = summarize(records, duration, target)
    session.record_event("load_end", model=entry.name, workload=workload.label,
                             stopped=bool(stop and stop.is_set()), **{k: summary.get(k) for k in _EVENT_FIGURES})
    return RunResult(records=records, summary=summary, workload=workload, settings=settings)


_EVENT_FIGURES = ("num_requests", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
                  "ttft_p99_ms", "tpot_p99_ms", "goodput", "target_met")


def _send(session, model: str, requests, params, cap: int | None, stop) -> tuple[list[RequestHandle], float]:
    """Submit each request when due and while fewer than `cap` are in flight; wait for them all.
    Returns the handles of those sent and the run's start (perf_counter)."""
    cond = threading.Condition()
    running: set[RequestHandle] = set()

    def finished(handle: RequestHandle) -> None:
        with cond:
            running.discard(handle)
            cond.notify_all()

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    sent: list[RequestHandle] = []
    t0 = time.perf_counter()
    try:
        for request, p in zip(requests, params):
            due = t0 + request.arrival_s
            with cond:
                while not stopped():
                    wait = due - time.perf_counter()
                    free = cap is None or len(running) < cap
                    if free and wait <= 0:
                        break
                    cond.wait(min(wait, _WAKE_S) if free else _WAKE_S)
            if stopped():
                break
            handle = session.submit(request.prompt, model=model, sampling_params=p)
            with cond:
                running.add(handle)
            handle.add_done_callback(finished)
            sent.append(handle)
        with cond:
            while running and not stopped():
                cond.wait(_WAKE_S)
    except BaseException:
        _cancel_all(sent)
        raise
    if stopped():
        _cancel_all(sent)
    return sent, t0


def _cancel_all(handles) -> None:
    handles = [h for h in handles if not h.done]
    for h in handles:
        h.cancel()
    for h in handles:
        h.wait(10.0)


class SessionBackend:
    """The TuneBackend of a model loaded in `session`: live knobs (runner_core.config.RECONFIGURABLE) change
    through the engine thread without reloading weights; dtype, quantization and layout reload the model under
    the same name. `stop`: an event that cancels the run in progress."""

    def __init__(self, session, model: str | None = None, *, stop: threading.Event | None = None):
        self.session = session
        self.model = session.entry(model).name
        self.stop = stop

    def entry(self):
        """The swept model's ModelEntry (a reload replaces it under the same name)."""
        return self.session.entry(self.model)

    def settings(self) -> dict:
        """Every RunnerConfig field's current value (any of them may be swept; RECONFIGURABLE ones live)."""
        return self.entry().config.to_dict()

    def capacity(self) -> dict:
        memory = self.session.memory_stats(self.model)
        cfg = self.entry().config
        return {"kv_tokens": int(memory["blocks_total"]) * int(memory["block_size"]),
                "block_size": int(memory["block_size"]), "max_model_len": int(memory["max_model_len"]),
                "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "kv_bytes_per_token": memory.get("kv_bytes_per_token")}

    def apply(self, settings: dict) -> dict:
        entry = self.entry()
        current = entry.config.to_dict()
        unknown = sorted(set(settings) - set(current))
        if unknown:
            raise ConfigError(f"unknown setting{'s' * (len(unknown) > 1)} {', '.join(unknown)}: a sweep sets "
                              "RunnerConfig fields (runner_core.config.RECONFIGURABLE lists the live ones)")
        changes = {k: v for k, v in settings.items() if current[k] != v}
        if changes:
            self._wait_for_others(entry.name)
        t0 = time.perf_counter()
        if any(k not in LIVE_FIELDS for k in changes):
            self._reload(entry, {**current, **changes})
            rebuilt = "reload"
        elif changes:
            answer = self.session.reconfigure(entry.name, by_sweep=True, **changes)
            rebuilt = answer["rebuilt"]
        else:
            rebuilt = "none"
        return {"seconds": time.perf_counter() - t0, "rebuilt": rebuilt}

    def _wait_for_others(self, name: str) -> None:
        """Let requests others sent to the model (the dashboards, the API) finish before a change, for up to
        OTHERS_WAIT_S; past that the change is refused, saying they run."""
        deadline = time.monotonic() + OTHERS_WAIT_S
        for handle in self.session.inflight(name):
            handle.wait(max(0.0, deadline - time.monotonic()))

    def _reload(self, entry, config: dict) -> None:
        """Load the model again with `config` under its name (validated first; the old config comes back if
        the new load fails)."""
        RunnerConfig.coerce(config)  # a bad value raises here, with the model still loaded
        old = entry.config.to_dict()
        active = self.session.active == entry.name
        sweeping = entry.sweeping
        self.session.unload(entry.name)
        try:
            new = self.session.load_model(config.pop("model"), name=entry.name, activate=active, **config)
        except Exception:
            self.session.load_model(old.pop("model"), name=entry.name, activate=active, **old).sweeping = sweeping
            raise
        new.sweeping = sweeping

    def run(self, workload: Workload, target: Target) -> RunResult:
        return run_load(self.session, workload, target=target, model=self.model, stop=self.stop)
