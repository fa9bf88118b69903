"""The HTTP load driver: sends a Workload to any OpenAI-compatible server's streamed `/v1/completions`
(ours, vLLM's, ...) with the same arrival times as the in-process driver, and stamps each request's
RequestMetrics on the client's side (`side="client"`) from the server-sent events, with asyncio and httpx.

Token times: with `continuous_usage` (vLLM's `stream_options.continuous_usage_stats`, which our server
also serves) every chunk carries the running `completion_tokens`, so a chunk's token count is exact.
Without it a chunk with text counts as one token (vLLM's benchmark counts chunks the same way), and the
final usage chunk reconciles the total: tokens the chunks did not show take the last chunk's time (or
the end's, when no chunk had text). TTFT, TPOT and ITL do not depend on that choice: they use the first
chunk's time, the total and the chunk gaps. The arrival is just before the request is written, after any
wait for the concurrency cap, and the end when the stream closed; times include the network and the
server's HTTP framing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from runner_core.engine.sequence import RequestMetrics
from runner_core.tuning.request_metrics import RunResult, Target, summarize
from runner_core.tuning.workload import Workload, WorkloadRequest, tokenizer_vocab


def run_http_workload(base_url: str, model: str, workload: Workload, *, api_key: str | None = None,
                      target: Target | None = None, tokenizer=None, vocab_size: int | None = None,
                      continuous_usage: bool = True, timeout: float | None = 600.0) -> RunResult:
    """Run `workload` against `{base_url}/v1/completions` (base_url without the /v1) for `model`.
    Synthetic prompts are token ids below `vocab_size` (default: the tokenizer's length; pass the
    model's, e.g. `runner.engine.vocab_size`, to send the in-process driver's requests). A request
    the server refuses (4xx/5xx, an error event) or that fails to connect is a failed record with the
    server's message. `timeout` bounds each read (seconds). Callable from a running event loop (a
    notebook): the run then goes on a worker thread. Returns a RunResult with `settings` empty."""
    coro_args = (base_url, model, workload, api_key, target, tokenizer, vocab_size, continuous_usage, timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_http_workload_async(*coro_args))
    box: dict = {}

    def work():
        try:
            box["result"] = asyncio.run(run_http_workload_async(*coro_args))
        except BaseException as e:  # handed to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=work, name="http-load", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


async def run_http_workload_async(base_url: str, model: str, workload: Workload, api_key: str | None = None,
                                  target: Target | None = None, tokenizer=None, vocab_size: int | None = None,
                                  continuous_usage: bool = True, timeout: float | None = 600.0) -> RunResult:
    """`run_http_workload` as a coroutine, for callers inside an event loop."""
    import httpx

    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}")
    if vocab_size is None and tokenizer is not None:
        vocab_size = tokenizer_vocab(tokenizer)
    if vocab_size is None and workload.dataset is None:
        raise ValueError("synthetic prompts need vocab_size= (the model's vocabulary, e.g. runner.engine.vocab_size) "
                         "or a tokenizer")
    requests = workload.requests(vocab_size or 0, tokenizer)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = workload.arrivals.concurrency
    gate = asyncio.Semaphore(limit) if limit else None
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), headers=headers,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    async with client:
        start = time.perf_counter()

        async def one(req: WorkloadRequest) -> RequestMetrics:
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            if gate is None:
                return await _send(client, url, _body(model, req, continuous_usage), req, tokenizer)
            async with gate:
                return await _send(client, url, _body(model, req, continuous_usage), req, tokenizer)

        records = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - start
    return RunResult(list(records), summarize(list(records), duration, target), workload, {})


def _body(model: str, req: WorkloadRequest, continuous_usage: bool) -> dict:
    options = {"include_usage": True}
    if continuous_usage:
        options["continuous_usage_stats"] = True
    s = req.sampling
    return {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": s["temperature"],
            "top_p": s["top_p"], "seed": s["seed"], "ignore_eos": s["ignore_eos"], "stream": True,
            "stream_options": options}


def _prompt_tokens(req: WorkloadRequest, tokenizer) -> int:
    if isinstance(req.prompt, list):
        return len(req.prompt)
    return len(tokenizer.encode(req.prompt)) if tokenizer is not None else 0  # with BOS, as the server counts


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:500] or "(no body)"
    return f"HTTP {status}: {message}"


async def _send(client, url: str, body: dict, req: WorkloadRequest, tokenizer) -> RequestMetrics:
    import httpx

    record = RequestMetrics(time.perf_counter(), _prompt_tokens(req, tokenizer), side="client")
    usage, counted, reason, error = None, 0, None, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                error = _error_message(resp.status_code, await resp.aread())
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk and not chunk.get("choices"):
                        err = chunk["error"]
                        error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        break
                    usage = chunk.get("usage") or usage
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                        k = chunk["usage"]["completion_tokens"] - counted
                        counted = chunk["usage"]["completion_tokens"]
                    else:
                        k = 1 if choices[0].get("text") else 0
                        counted += k
                    record.token_times.extend([now] * k)
                    reason = choices[0].get("finish_reason") or reason
    except (httpx.HTTPError, OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    record.finish(time.perf_counter(), "error" if error else reason, error)
    if record.ok and usage:
        _reconcile(record, usage)
    return record


def _reconcile(record: RequestMetrics, usage: dict) -> None:
    """Match the token times to the server's final counts (see the module docstring)."""
    total = usage.get("completion_tokens")
    if isinstance(total, int) and total >= 0:
        times = record.token_times
        if total < len(times):
            del times[total:]
        else:
            times.extend([times[-1] if times else record.finished_time] * (total - len(times)))
    if isinstance(usage.get("prompt_tokens"), int):
        record.num_prompt_tokens = usage["prompt_tokens"]
