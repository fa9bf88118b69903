"""The in-process load driver: sends a Workload's requests to a ModelRunner when they are due, on the
caller's thread, with the engine's clock (the wall clock; a simulated runner's virtual clock, where waiting
for the next arrival takes no time). Each request's RequestMetrics is created at its send and handed to the
engine, which stamps its tokens and its end; the session's driver does the same through its handles, the
HTTP driver stamps its own client-side record.
"""

from __future__ import annotations

from collections import deque

from runner_core.engine.sequence import RequestMetrics
from runner_core.errors import InvalidRequestError
from runner_core.tuning.request_metrics import RunResult, Target, summarize
from runner_core.tuning.workload import Workload


def vocab_and_tokenizer(runner) -> tuple[int, object | None]:
    """The loaded model's vocabulary size (bounds synthetic token ids) and its tokenizer (or None)."""
    engine = runner.engine
    if engine is None:
        raise ValueError("the runner has no model loaded; call runner.load_model() before a load run")
    return engine.vocab_size, getattr(engine, "tokenizer", None)


def run_workload(runner, workload: Workload, *, target: Target | None = None) -> RunResult:
    """Run `workload` on a loaded `runner` and time it: each request is added when due (in
    "concurrency" mode, or with a concurrency cap, only while fewer than n are in flight), the engine
    steps while anything is unfinished and sleeps until the next due time otherwise. A request the
    engine refuses (InvalidRequestError) becomes a failed record and the run goes on. Requests other
    callers queued on the same engine run alongside and are not recorded. Returns a RunResult with
    `settings` empty (the caller fills them)."""
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}")
    vocab_size, tokenizer = vocab_and_tokenizer(runner)
    pending = deque(workload.requests(vocab_size, tokenizer))
    limit = workload.arrivals.concurrency
    records: list[RequestMetrics] = []
    inflight: dict[str, RequestMetrics] = {}
    clock = runner.engine.clock
    start = clock.now()
    try:
        while pending or inflight:
            now = clock.now()
            while pending and start + pending[0].arrival_s <= now and (limit is None or len(inflight) < limit):
                req = pending.popleft()
                record = RequestMetrics(clock.now(), len(req.prompt) if isinstance(req.prompt, list) else 0)
                records.append(record)
                try:
                    rid = runner.add_request(req.prompt, req.sampling_params(), stream=True, metrics=record)
                    inflight[rid] = record
                except InvalidRequestError as e:
                    record.finish(clock.now(), "error", str(e))
            if inflight:
                if not runner.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(inflight)} requests of the run unanswered")
                for out in runner.step():
                    if out.finished:
                        inflight.pop(out.request_id, None)
            elif pending:
                clock.sleep_until(start + pending[0].arrival_s)
    finally:
        for rid in inflight:
            runner.abort_request(rid)
    duration = clock.now() - start
    return RunResult(records, summarize(records, duration, target), workload, {})
