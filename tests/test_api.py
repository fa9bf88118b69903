"""The OpenAI-compatible API under the official `openai` client: completions and chat completions, streamed
and not, equal to the session's own greedy generation with the right usage; /v1/models, /health, /metrics;
a client that leaves mid-stream frees its blocks; one bad request among good ones harms none."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sessions import TINY, slow_steps, tiny_session, wait_until
from workbench import Session


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


PROMPT = "Once upon a time"
# a template of the usual shape (role markers, then the assistant's turn opened), for a tokenizer without one
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(session):
    srv = session.serve_api()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def chat_template(session):
    hf = session.models["tiny-llama"].runner.tokenizer.hf
    hf.chat_template = TEMPLATE
    yield hf
    hf.chat_template = None


def test_a_completion_equals_the_sessions_greedy_generation_with_its_usage(session, client):
    expected = session.generate(PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
    got = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.object == "text_completion" and got.model == "tiny-llama"
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(expected.prompt_token_ids), 20)
    assert got.usage.total_tokens == got.usage.prompt_tokens + 20


def test_a_streamed_completion_of_token_ids_equals_the_session_and_ends_with_usage(session, client):
    ids = [5, 17, 42, 99, 300, 7]
    expected = session.generate(ids, max_tokens=24, temperature=0.0, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny-llama", prompt=ids, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 1  # streamed, not one piece at the end
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == len(ids)


def test_models_lists_the_loaded_model_and_health_says_ok(server, client):
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    resp = httpx.get(server.url + "/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_chat_without_a_template_is_a_400_saying_what_to_do(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}])
    body = err.value.body
    assert body["param"] == "messages" and "chat template" in body["message"]
    assert "/v1/completions" in body["message"] and "chat_template" in body["message"]


def test_chat_applies_the_template_streamed_and_not(session, client, chat_template):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    text = chat_template.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = chat_template.encode(text, add_special_tokens=False)
    expected = session.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)

    got = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 12)

    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_may_fill_the_context(client, chat_template):
    got = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "go on"}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length" and got.usage.total_tokens == TINY["max_model_len"]


def _samples(server) -> dict:
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def test_metrics_parse_and_count_the_served_requests(server, client):
    model = (("model_name", "tiny-llama"),)
    before = _samples(server)
    client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=9, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _samples(server)

    def moved(name, labels=model):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("runner_workbench:generation_tokens_total") == 9
    assert moved("runner_workbench:prompt_tokens_total") > 0
    reason = (("finished_reason", "length"), ("model_name", "tiny-llama"))
    assert moved("runner_workbench:request_success_total", reason) == 1
    assert moved("runner_workbench:time_to_first_token_seconds_count") == 1
    assert moved("runner_workbench:time_per_output_token_seconds_count") == 1
    assert after[("runner_workbench:kv_cache_blocks_total", model)] > 0
    assert after[("runner_workbench:num_requests_running", model)] == 0


def test_metrics_observe_each_request_by_its_record():
    from prometheus_client import generate_latest

    from runner_core import RequestMetrics
    from workbench.api.prometheus import ApiMetrics

    metrics = ApiMetrics()
    served = RequestMetrics(10.0, 7, token_times=[10.2, 10.3, 10.5])
    served.finish(10.5, "stop")
    aborted = RequestMetrics(20.0, 3)  # cancelled before its first token: an E2E, no TTFT nor TPOT
    aborted.finish(20.25, "abort")
    for record in (served, aborted):
        metrics.observe(record, "m")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
           for s in family.samples}
    m = (("model_name", "m"),)
    assert got[("runner_workbench:prompt_tokens_total", m)] == 10
    assert got[("runner_workbench:generation_tokens_total", m)] == 3
    for reason in ("stop", "abort"):
        assert got[("runner_workbench:request_success_total", (("finished_reason", reason), *m))] == 1
    prefix = "runner_workbench:"
    assert got[(prefix + "time_to_first_token_seconds_count", m)] == 1
    assert (served.ttft, served.tpot) == pytest.approx((0.2, 0.15))
    assert got[(prefix + "time_to_first_token_seconds_sum", m)] == pytest.approx(served.ttft)
    assert got[(prefix + "time_per_output_token_seconds_sum", m)] == pytest.approx(served.tpot)
    assert got[(prefix + "e2e_request_latency_seconds_count", m)] == 2
    assert got[(prefix + "e2e_request_latency_seconds_sum", m)] == pytest.approx(0.5 + 0.25)


def test_a_client_that_leaves_mid_stream_aborts_its_request_and_frees_its_blocks(session, server):
    idle = session.memory_stats()["blocks_used"]
    body = {"model": "tiny-llama", "prompt": PROMPT * 8, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with slow_steps(session), httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            first = next(line for line in resp.iter_lines() if line.startswith("data: "))
            assert '"text_completion"' in first
            (handle,) = session.inflight()  # still generating when the client goes
        assert wait_until(lambda: not session.inflight())
    assert handle.finish_reason == "abort" and handle.num_tokens < 200
    assert wait_until(lambda: session.memory_stats()["blocks_used"] == idle)


def test_a_bad_request_among_good_concurrent_ones_harms_none(session, server):
    good = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    too_long = {**good, "prompt": "word " * 400}
    expected = session.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True).text
    with slow_steps(session, delay=0.01), concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, server.url + "/v1/completions", json=b, timeout=60)
                   for b in (good, too_long, good)]
        first, bad, last = (f.result() for f in futures)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert "max_model_len" in bad.json()["error"]["message"]
    for resp in (first, last):
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
    assert httpx.get(server.url + "/health").status_code == 200


def test_no_model_loaded_is_a_503_saying_so():
    s = Session()
    try:
        srv = s.serve_api()
        health = httpx.get(srv.url + "/health")
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT})
        assert health.status_code == 503 and resp.status_code == 503
        assert "no model is loaded" in resp.json()["error"]["message"]
    finally:
        s.close()
    assert not srv.running  # close() stopped the server it started


def test_continuous_usage_counts_every_chunks_tokens(session, server):
    expected = session.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 16
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(expected.prompt_token_ids)}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.text


def test_a_client_that_gives_up_on_a_non_streamed_request_aborts_it(session, server):
    idle = session.memory_stats()["blocks_used"]
    aborted = ("runner_workbench:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny-llama")))
    before = _samples(server).get(aborted, 0.0)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with slow_steps(session):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        assert wait_until(lambda: not session.inflight())
    assert _samples(server).get(aborted, 0.0) == before + 1
    assert wait_until(lambda: session.memory_stats()["blocks_used"] == idle)
