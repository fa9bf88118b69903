"""`python -m workbench serve`: binds loopback, prints its URL, loads --model first, and reports a
bad model as a one-line error; `serve` and `api` take the API's limits as flags (ApiLimits' defaults)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from workbench.__main__ import api_limits, build_parser
from workbench.api import ApiLimits

REPO = Path(__file__).resolve().parents[1]


def test_serve_with_a_model_prints_a_loopback_url(tiny_llama_path):
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", "0", "--model", "tiny-llama"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"Workbench dashboard: (http://\S+)", line)
            if m:
                break
        else:
            raise AssertionError("no URL printed:\n" + "".join(seen))
        assert any(line.startswith("loaded tiny-llama in") for line in seen), seen
        url = m.group(1)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
        with urllib.request.urlopen(url, timeout=60) as resp:
            page = resp.read().decode()
        assert resp.status == 200 and "<title>runner-workbench</title>" in page
    finally:
        proc.terminate()
        proc.wait(15)


def test_serve_with_a_missing_model_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "workbench", "serve", "--port", "0", "--model", str(tmp_path / "nope")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "error: unknown model" in res.stderr and "(no such directory)" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command", [["api", "--model", "tiny-llama"], ["serve", "--api-port", "0"]])
def test_the_limit_flags_set_the_api_limits_and_default_to_apilimits_defaults(command, capsys):
    parser = build_parser()
    assert api_limits(parser.parse_args(command)) == ApiLimits()
    args = parser.parse_args([*command, "--max-body-mib", "2", "--max-concurrent-requests", "3",
                              "--max-queued-requests", "0", "--max-stop-sequences", "5", "--max-stop-chars", "6",
                              "--max-messages", "7"])
    assert api_limits(args) == ApiLimits(max_body_bytes=2 << 20, max_concurrent_requests=3, max_queued_requests=0,
                                         max_stop_sequences=5, max_stop_chars=6, max_messages=7)
    with pytest.raises(SystemExit):
        parser.parse_args([command[0], "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-body-mib N the largest request body in MiB; over it a 413; default 16" in help_text
    assert "default 256" in help_text and "default 1024" in help_text and "default 2048" in help_text


@pytest.mark.parametrize("flag, value, least", [("--max-concurrent-requests", "0", 1), ("--max-body-mib", "1.5", 1),
                                                ("--max-queued-requests", "-1", 0)])
def test_a_bad_limit_flag_is_refused_naming_the_flag(flag, value, least, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["api", "--model", "tiny-llama", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: got '{value}'; allowed: an int >= {least}" in capsys.readouterr().err
