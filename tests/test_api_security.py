"""The API's refusals: bad fields get a 4xx OpenAI error naming the field; with an API key every route but
/health needs `Authorization: Bearer`; off loopback it is refused without a key (in Python and on the command
line, saying how); the command line serves it alone or beside the dashboard, with the limits its flags set."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import stop
from tests.sessions import tiny_session
from workbench import SessionError


@pytest.fixture(scope="module")
def session(tiny_llama_path):
    yield from tiny_session()


REPO = Path(__file__).resolve().parents[1]
KEY = "test-key-1234"


@pytest.fixture(scope="module")
def url(session):
    srv = session.serve_api(api_key=KEY)
    yield srv.url
    srv.stop()


def _post(url, path, body, key=KEY):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


GOOD = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "tiny-llama", "max_tokens": 4}, 400, "prompt", "required"),
    ({**GOOD, "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "greater than 0"),
    ({**GOOD, "n": 2, "best_of": 1}, 400, "best_of", "an int >= n=2"),
    ({**GOOD, "prompt": ["one", "two"]}, 400, "prompt", "one prompt per request"),
    ({**GOOD, "logprobs": 21}, 400, "logprobs", "from 0 to 20"),
    ({**GOOD, "model": "gpt-4"}, 404, "model", "loaded: tiny-llama"),
    ({**GOOD, "prompt": "word " * 400}, 400, "prompt", "max_model_len is 256"),
    ({**GOOD, "prompt": "word " * 400, "stream": True}, 400, "prompt", "max_model_len is 256"),
    ({**GOOD, "prompt": [1, 10**6]}, 400, "prompt", "outside the vocabulary"),
    ({**GOOD, "stop": [""]}, 400, "stop", "non-empty"),
], ids=["missing-prompt", "negative-max-tokens", "text-temperature", "zero-top-p", "best-of-below-n", "two-prompts",
        "logprobs", "unknown-model", "too-long-prompt", "too-long-prompt-streamed",
        "token-out-of-vocab", "empty-stop"])
def test_a_bad_completion_field_is_a_json_error_naming_it(url, body, status, param, words):
    resp = _post(url, "/v1/completions", body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert _post(url, "/v1/completions", GOOD).status_code == 200  # the server goes on


def test_malformed_json_and_bad_chat_messages_are_400s(url):
    resp = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi",', timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    resp = _post(url, "/v1/chat/completions", {"model": "tiny-llama", "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    resp = _post(url, "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"content": "no role"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_an_unknown_path_is_a_json_404(url):
    resp = httpx.get(url + "/v2/engines", headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 404 and "/v1/completions" in resp.json()["error"]["message"]


@pytest.mark.parametrize("route", ["GET /v1/models", "GET /metrics", "POST /v1/completions",
                                   "POST /v1/chat/completions"])
def test_every_route_but_health_needs_the_key(url, route):
    method, path = route.split()
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        resp = httpx.request(method, url + path, json=GOOD, headers=headers, timeout=60)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health").status_code == 200


def test_the_openai_client_with_the_right_key_gets_answers_and_a_wrong_one_is_refused(url):
    right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in right.models.list()] == ["tiny-llama"]
    assert right.completions.create(model="tiny-llama", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-it", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_network_host_without_a_key_is_refused_saying_how(session):
    with pytest.raises(SessionError, match=r"pass api_key=\.\.\. \(clients send it as Authorization: Bearer"):
        session.serve_api(host="0.0.0.0")
    srv = session.serve_api(host="0.0.0.0", api_key=KEY)
    try:
        port = srv.port
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
    finally:
        srv.stop()


@pytest.mark.parametrize("argv", [["api", "--model", "tiny-llama", "--port", "0", "--host", "0.0.0.0"],
                                  ["serve", "--port", "0", "--api-port", "0", "--address", "0.0.0.0",
                                   "--basic-auth", "pw"]], ids=["api", "serve"])
def test_the_command_line_refuses_a_network_host_without_a_key(argv):
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_API_KEY"}
    res = subprocess.run([sys.executable, "-m", "workbench", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--api-key KEY or WORKBENCH_API_KEY" in res.stderr and "loaded" not in res.stdout


@contextlib.contextmanager
def _cli(*argv: str, env: dict, wait_s: float = 180):
    """Run `python -m workbench ARGV` until it prints the API's URL; yields {label: url} of the lines seen."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    urls: dict[str, str] = {}
    lines: list[str] = []
    found = threading.Event()

    def read():  # drains the output so the server never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"(OpenAI API|Workbench dashboard): (http://\S+)", line)
            if m:
                urls[m.group(1)] = m.group(2)
            if "Workbench dashboard" in urls or ("OpenAI API" in urls and argv[0] == "api"):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(wait_s):
            pytest.fail("no URL printed:\n" + "".join(lines))
        yield urls
    finally:
        stop(proc, 15)


def test_the_api_command_serves_a_model_with_the_key_from_the_environment_and_its_limits(tiny_llama_path):
    with _cli("api", "--model", "tiny-llama", "--port", "0", "--max-stop-sequences", "1",
              env={**os.environ, "WORKBENCH_API_KEY": KEY}) as urls:
        base = urls["OpenAI API"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base)
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=5).usage.completion_tokens
        assert httpx.get(base + "/models").status_code == 401
        (model,) = httpx.get(base + "/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
        assert model["id"] == "tiny-llama" and model["max_model_len"] == 2048  # the model's own limit
        two_stops = _post(base.removesuffix("/v1"), "/v1/completions", {"prompt": "hi", "stop": ["a", "b"]})
        assert two_stops.status_code == 400 and two_stops.json()["error"]["param"] == "stop"
        assert "maximum length 1, but got an array with length 2" in two_stops.json()["error"]["message"]


def test_serve_with_an_api_port_serves_the_api_beside_the_dashboard_with_its_limits(tiny_llama_path):
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_API_KEY"}
    with _cli("serve", "--port", "0", "--model", "tiny-llama", "--api-port", "0", "--max-body-mib", "1",
              env=env) as urls:
        assert set(urls) == {"OpenAI API", "Workbench dashboard"}
        models = httpx.get(urls["OpenAI API"] + "/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        big = httpx.post(urls["OpenAI API"] + "/completions", json={"prompt": "x" * (1 << 20)}, timeout=60)
        assert big.status_code == 413 and "max_body_bytes (1048576 bytes" in big.json()["error"]["message"]
