"""The HTTP load driver: against a stub server that streams known chunks (how chunks become token times,
what is sent, errors as failed records, the concurrency cap), and against the session's OpenAI API on
tiny-llama, where it must give the same requests and output lengths as the in-process driver."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from runner_core.tuning import Arrivals, Lengths, Target, Workload, run_http_workload, run_workload

GAP = 0.05  # seconds between the stub's chunks


def _stub_app(seen: list, live: dict) -> FastAPI:
    """prompt [1]: "ab" (2 tokens) then "c"; [2]: a 400; [3]: one chunk then an error event; other prompts:
    one token per chunk, max_tokens of them, the last with finish_reason "length". Usage in every chunk when
    continuous_usage_stats is asked."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append({**body, "authorization": request.headers.get("authorization")})
        if body["prompt"] == [2]:
            return JSONResponse({"error": {"message": "prompt is too long", "type": "invalid_request_error"}}, 400)
        pieces = {(1,): [("ab", 2), ("c", 1)], (3,): [("x", 1)]}.get(tuple(body["prompt"]),
                                                                     [("t", 1)] * body["max_tokens"])
        continuous = body["stream_options"].get("continuous_usage_stats")

        async def events():
            live["now"] += 1
            live["max"] = max(live["max"], live["now"])
            sent = 0
            try:
                for i, (text, n) in enumerate(pieces, 1):
                    await asyncio.sleep(GAP)
                    sent += n
                    reason = "length" if i == len(pieces) and body["prompt"] != [3] else None
                    chunk = {"choices": [{"index": 0, "text": text, "finish_reason": reason}]}
                    if continuous:
                        chunk["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if body["prompt"] == [3]:
                    yield 'data: {"error": {"message": "the engine failed", "type": "server_error"}}\n\n'
                else:
                    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                live["now"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub():
    seen, live = [], {"now": 0, "max": 0}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_stub_app(seen, live), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen, live
    server.should_exit = True
    thread.join(10)
    sock.close()


def _dataset(tmp_path, prompts) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "output_len": 4}) + "\n" for p in prompts))
    return str(path)


@pytest.mark.parametrize("continuous", [True, False])
def test_chunks_become_token_times_and_usage_sets_the_counts(stub, tmp_path, continuous):
    url, seen, _ = stub
    w = Workload(num_requests=1, dataset=_dataset(tmp_path, [[1]]), seed=5)
    (r,) = run_http_workload(url, "stub", w, continuous_usage=continuous, api_key="sk-1").records
    assert r.ok and r.num_output_tokens == 3 and r.num_prompt_tokens == 1
    assert (r.side, r.finish_reason) == ("client", "length")
    # "ab" carries two tokens: with per-chunk usage both take its time; without, the chunk counts as one
    # and the final usage's extra token takes the last chunk's time
    first, last = r.token_times[0], r.token_times[-1]
    assert r.token_times == ([first, first, last] if continuous else [first, last, last])
    assert len(r.itls) == 1 and r.ttft >= GAP and r.finished_time >= last
    body = seen[-1]
    assert (body["prompt"], body["max_tokens"], body["seed"], body["ignore_eos"], body["stream"]) == ([1], 4, 5,
                                                                                                    True, True)
    assert body["stream_options"]["include_usage"] and body["authorization"] == "Bearer sk-1"


def test_server_errors_are_failed_records_with_the_servers_message(stub, tmp_path):
    url = stub[0]
    w = Workload(num_requests=3, dataset=_dataset(tmp_path, [[2], [3], [4]]))
    result = run_http_workload(url, "stub", w, target=Target("e2e_p99_ms", 60_000))
    refused, broken, fine = result.records
    assert refused.error == "HTTP 400: prompt is too long" and broken.error == "the engine failed"
    assert fine.ok and fine.num_output_tokens == 4 and refused.finish_reason == broken.finish_reason == "error"
    assert (result.summary["completed"], result.summary["failed"]) == (1, 2)


def test_a_server_that_is_not_there_fails_every_request(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    w = Workload(num_requests=2, dataset=_dataset(tmp_path, [[4], [5]]))
    result = run_http_workload(f"http://127.0.0.1:{port}", "stub", w)
    assert [r.ok for r in result.records] == [False, False] and "ConnectError" in result.records[0].error


def test_concurrency_caps_requests_in_flight_and_arrivals_spread_them(stub):
    url, _, live = stub
    w = Workload(num_requests=8, arrivals=Arrivals.fixed_concurrency(2), output_len=Lengths.fixed(3),
                 prompt_len=Lengths.fixed(4))
    live["max"] = 0
    result = run_http_workload(url, "stub", w, vocab_size=100)
    assert live["max"] == 2 and result.summary["completed"] == 8
    w = w.replace(arrivals=Arrivals.poisson(20.0))
    due = [q.arrival_s for q in w.requests(100)]
    before = time.perf_counter()
    for r, t in zip(run_http_workload(url, "stub", w, vocab_size=100).records, due):
        assert r.arrival_time - before >= t


def test_synthetic_prompts_need_a_vocabulary():
    with pytest.raises(ValueError, match="synthetic prompts need vocab_size="):
        run_http_workload("http://127.0.0.1:1", "m", Workload(num_requests=1))


def test_against_the_sessions_api_it_sends_what_the_in_process_driver_sends(tiny_llama_path):
    from runner_core import ModelRunner
    from workbench import Session

    config = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 4 << 20, "max_model_len": 256}
    w = Workload(num_requests=6, arrivals=Arrivals.fixed_concurrency(3), prompt_len=Lengths.uniform(4, 20),
                 output_len=Lengths.uniform(2, 8))
    runner = ModelRunner({"model": str(tiny_llama_path), **config}).load_model()
    in_process = run_workload(runner, w)
    session = Session()
    try:
        session.load_model("tiny-llama", **config)
        server = session.serve_api()
        over_http = run_http_workload(server.url, "tiny-llama", w, tokenizer=runner.tokenizer)  # its vocab
    finally:
        session.close()
    for a, b in zip(over_http.records, in_process.records, strict=True):  # one record class, two sides
        assert a.ok and (a.num_prompt_tokens, a.num_output_tokens, a.finish_reason) == (
            b.num_prompt_tokens, b.num_output_tokens, b.finish_reason)
        assert (a.side, b.side) == ("client", "engine")
    assert over_http.summary["output_tokens"] == sum(q.max_tokens for q in w.requests(runner.engine.vocab_size))


def test_it_runs_from_inside_an_event_loop_as_a_notebook_cell_does(stub, tmp_path):
    async def cell():
        return run_http_workload(stub[0], "stub", Workload(num_requests=1, dataset=_dataset(tmp_path, [[4]])))

    assert asyncio.run(cell()).records[0].num_output_tokens == 4
